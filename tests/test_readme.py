"""Commands the README shows run as written (those that need no model download)."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_the_tiny_model_command_builds_a_model_that_loads(tmp_path):
    command = re.search(r"`(python scripts/make_tiny_moe\.py [^`]*)`", README).group(1)
    _, script, out, *flags = shlex.split(command)
    done = subprocess.run([sys.executable, ROOT / script, tmp_path / out, *flags],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    inspect = subprocess.run([sys.executable, "-m", "mlx_moestream.cli", "inspect", "--model",
                              tmp_path / out], capture_output=True, text=True, timeout=300)
    assert inspect.returncode == 0 and "minimum budget" in inspect.stdout, inspect.stderr


def test_the_first_command_is_the_embedded_chat_the_readme_promises():
    first = re.search(r"```bash\n(.*?)\n```", README, re.S).group(1)
    chat = first.split("&& ")[-1]
    assert chat.startswith(".venv/bin/mlx-moestream chat ")
    args = shlex.split(chat)[1:]
    done = subprocess.run([sys.executable, "-m", "mlx_moestream.cli", *args],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "hit rate" in done.stdout


def test_the_python_api_example_runs_on_a_local_model(tiny_model, tmp_path):
    """As written but for the model (no download here): a tiny one of the same architecture."""
    import os

    block = re.search(r"## Python API\n\n```python\n(.*?)\n```", README, re.S).group(1)
    hub_id = "mlx-community/Qwen3-30B-A3B-4bit"
    assert block.count(hub_id) == 2
    code = block.replace(f'"{hub_id}"', repr(str(tiny_model("qwen3_moe", bits=4))))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path,
                          env={**os.environ, "MLX_MOESTREAM_PROFILES": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "my-workload.json").exists()
