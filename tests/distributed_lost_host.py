"""Run by tests/test_distributed.py on two hosts over the ring backend: host 1 hangs,
exits after loading, or fails its first read (`read-error`); host 0 must end with a clear
error, not wait forever, whatever it waits for: a forward call (`decode`), the hosts'
statistics (`stats`), or its input line reaching the others (`line`, as `chat` sends it)."""

import builtins
import os
import sys
import time

sys.modules["torch"] = None  # hosts run MLX alone: transformers starts as without torch

import mlx_moestream
from mlx_moestream.cli import user_input
from mlx_moestream.errors import StoreError
from mlx_moestream.testing import greedy_logits

path, mode, step = sys.argv[1], sys.argv[2], sys.argv[3]
model, _ = mlx_moestream.load(path, budget="60%", distributed=True, timeout_seconds=3)
if mode == "read-error" and model.moestream.host[0] == 1:  # its first read fails
    def failing(*args):
        raise StoreError("injected read error")

    model.moestream.store.read_expert = failing
elif model.moestream.host[0] == 1:
    if mode == "hang":
        time.sleep(600)
    os._exit(0)
builtins.input = lambda prompt: "Ciao"
try:
    if step == "decode":
        greedy_logits(model, decode_tokens=4)
    elif step == "stats":
        mlx_moestream.host_stats(model)
    else:
        user_input.read_on_host_0(model.moestream.backend.watchdog, ">>> ")
except RuntimeError as e:
    print(f"Error: {e}", file=sys.stderr, flush=True)
    sys.exit(1)
