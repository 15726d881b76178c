"""A workload profile: record one from a session, save it, and start later sessions warm.

Records which experts Python code routes to (half of the embedded model's held-out Python),
saves that as a profile, then compares a cold session with one pre-warmed from the profile on
the first tokens of the same prompt, where a warm start matters.
"""

import tempfile
from pathlib import Path

import mlx_lm

import mlx_moestream

text = (Path(mlx_moestream.__file__).parent / "assets/embedded/heldout/python.txt").read_text()
PROMPT = "def read_config(path):"

recorder, tokenizer = mlx_moestream.load(budget="30%")
mlx_moestream.run_text(recorder, tokenizer, text[: len(text) // 2])

with tempfile.TemporaryDirectory() as folder:
    saved = mlx_moestream.save_profile(recorder, Path(folder) / "my-python.json")
    for profile in (None, saved):
        model, tokenizer = mlx_moestream.load(budget="30%", profile=profile)
        mlx_lm.generate(model, tokenizer, PROMPT, max_tokens=8)
        print(f"{'pre-warmed' if profile else 'cold':>10}: hit rate "
              f"{mlx_moestream.stats(model)['hit_rate']:.1%}")
