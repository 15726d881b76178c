"""Run by tests/test_distributed.py on two hosts over the ring backend: each host loads the
model and budget given for its rank (`PATH0 BUDGET0 PATH1 BUDGET1`) and prints `loaded` or
its error, in one line."""

import sys

sys.modules["torch"] = None  # hosts run MLX alone: transformers starts as without torch

import mlx.core as mx

import mlx_moestream

rank = mx.distributed.init().rank()
path, budget = sys.argv[1 + 2 * rank : 3 + 2 * rank]
try:
    mlx_moestream.load(path, budget=budget, distributed=True, timeout_seconds=30)
except ValueError as e:
    print(f"host {rank}: Error: {e}", flush=True)
else:
    print(f"host {rank}: loaded", flush=True)
