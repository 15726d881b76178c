"""Every example runs as written, in its own process, on the embedded model."""

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("name, says", [("generate.py", "hit rate"),
                                        ("profiles.py", "pre-warmed: hit rate"),
                                        ("replay_policies.py", "cyclic at 25%: hit rate")])
def test_example_runs(name, says, tmp_path):
    out = subprocess.run([sys.executable, EXAMPLES / name], capture_output=True, text=True,
                         cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr
    assert says in out.stdout
