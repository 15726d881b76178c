"""Loading by Hugging Face repo id, offline, from a local hub cache."""

import os
import shutil
import subprocess
import sys

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def test_repo_id_loads_offline_from_the_hub_cache(tiny_model, tmp_path):
    repo = tmp_path / "hub" / "models--moestream-tests--tiny-qwen3-moe"
    shutil.copytree(tiny_model("qwen3_moe"), repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    code = ("import mlx_moestream, mlx_lm; m, t = mlx_moestream.load('moestream-tests/tiny-qwen3-moe',"
            " budget='50%'); print(len(mlx_lm.generate(m, t, 'hi', max_tokens=4)) >= 0,"
            " mlx_moestream.stats(m)['loads'] > 0)")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]


def test_unknown_repo_id_offline_is_a_clear_error(tmp_path):
    code = "import mlx_moestream; mlx_moestream.load('nobody/nothing')"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode != 0
    assert "'nobody/nothing' is not a local directory" in out.stderr


def test_a_repo_id_downloads_every_file_mlx_lm_downloads():
    """A tokenizer shipped as tiktoken.model alone (Kimi) or a *.jsonl file mlx-lm reads was
    left out of the download, and the model loaded without it."""
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    from mlx_moestream.hub import HUB_PATTERNS

    assert set(DEFAULT_ALLOW_PATTERNS) <= set(HUB_PATTERNS)
