"""Resident memory stays within dense weights + budget + KV cache (+10% slack)."""

import json
import subprocess
import sys

PROBE = r"""
import json, sys
import mlx.core as mx, mlx_lm
from mlx_lm.models.cache import make_prompt_cache
import mlx_moestream
model, tok = mlx_moestream.load(sys.argv[1], budget="25%")
runtime = model.moestream
after_load = mx.get_active_memory()
mx.reset_peak_memory()
cache = make_prompt_cache(model)
prompt = mx.arange(3, 67)[None]
y = model(prompt, cache=cache)
for _ in range(32):
    y = model(mx.argmax(y[:, -1], -1)[:, None], cache=cache)
    mx.eval(y)
kv = sum(c.nbytes for c in cache)
print(json.dumps(dict(after_load=after_load, peak=mx.get_peak_memory(),
    dense=runtime.plan.dense_bytes, experts=runtime.plan.expert_bytes,
    budget=runtime.budget_bytes, kv=kv)))
"""


def test_active_memory_stays_within_dense_plus_budget_plus_kv(tiny_model):
    path = tiny_model("qwen3_moe", num_experts=64, num_layers=4, hidden_size=128,
                      moe_intermediate_size=128)
    out = subprocess.run([sys.executable, "-c", PROBE, str(path)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    m = json.loads(out.stdout)
    assert m["experts"] >= 10 * m["dense"]
    assert m["after_load"] <= 1.1 * (m["dense"] + m["budget"])
    assert m["peak"] <= 1.1 * (m["dense"] + m["budget"] + m["kv"])
