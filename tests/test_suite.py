"""The suite's own configuration (pyproject.toml's pytest options) does what it promises."""

import re
import subprocess
import sys
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def test_tests_of_one_xdist_group_run_on_one_worker(tmp_path):
    """The torch.compile tests share a worker (`compiles` in test_torch.py), where inductor
    starts once: 40 CPU-s less than on two. pytest 9.2 made xdist drop the groups silently
    (pytest-xdist#1386)."""
    (tmp_path / "test_grouped.py").write_text(
        "import pytest\n\n"
        "@pytest.mark.xdist_group('g')\n"
        "@pytest.mark.parametrize('i', range(6))\n"
        "def test_grouped(i):\n"
        "    pass\n\n"
        "@pytest.mark.parametrize('i', range(6))\n"
        "def test_free(i):\n"
        "    pass\n")
    out = subprocess.run([sys.executable, "-m", "pytest", "-c", str(PYPROJECT), "--rootdir",
                          str(tmp_path), "-n", "2", "-v", "-p", "no:cacheprovider",
                          str(tmp_path / "test_grouped.py")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:]
    workers = set(re.findall(r"^\[(gw\d)\] .* PASSED \S*test_grouped\[", out.stdout, re.M))
    assert len(workers) == 1, out.stdout
