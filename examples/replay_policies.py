"""Record a session's routing as a trace, then replay it through every cache policy.

Replay runs the same policy classes as the live runtime, so comparing policies on your own
workload takes seconds and no model reads: hit rates at two budgets, next to Belady's optimum.
"""

import tempfile
from pathlib import Path

import mlx_lm

import mlx_moestream
from mlx_moestream.replay import sweep
from mlx_moestream.trace import Trace

model, tokenizer = mlx_moestream.load(budget="100%")
mlx_moestream.start_trace(model)
for prompt in ["Ciao, come stai?", "The meaning of life is", "import numpy as np"]:
    mlx_lm.generate(model, tokenizer, prompt, max_tokens=48)

with tempfile.TemporaryDirectory() as folder:
    path = Path(folder) / "session.npz"
    mlx_moestream.save_trace(model, path)
    trace = Trace.load(path)

print(f"{trace.tokens} tokens x {trace.layers} layers, top-{trace.top_k} of {trace.num_experts}")
for r in sweep(trace, ["lru", "lfu", "slru", "age", "cyclic"], [0.25, 0.5]):
    print(f"{r['policy']:>7} at {r['capacity_fraction']:.0%}: hit rate {r['hit_rate']:.1%} "
          f"(Belady {r['belady_hit_rate']:.1%})")
