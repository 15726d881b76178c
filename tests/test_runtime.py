"""The backend-neutral runtime streams experts on its own: no mlx, no torch."""

import dataclasses
import json
import subprocess
import sys

import numpy as np

from mlx_moestream.mlx import load_lazy

# Runs with mlx and torch blocked: a plan (made here by the MLX backend) and numpy slot pools.
CORE_ONLY = """
import json, sys
for name in ("mlx", "mlx_lm", "torch", "transformers"):
    sys.modules[name] = None
import numpy as np
from safetensors.numpy import load_file
from mlx_moestream.plan import ExpertLayer, ModelPlan
from mlx_moestream.backend import Backend, SlotPool
from mlx_moestream.runtime import Runtime
from mlx_moestream.store import ExpertStore

path, raw = sys.argv[1], json.loads(sys.argv[2])
layers = [ExpertLayer(l["path"], l["num_experts"],
                      {n: (tuple(s), d, b) for n, (s, d, b) in l["specs"].items()})
          for l in raw.pop("layers")]
raw.pop("num_layers")
plan = ModelPlan(layers=layers, **raw)


class NumpyBackend(Backend):
    def new_pool(self, like, num_slots):
        return SlotPool({n: np.zeros((num_slots, *s), d) for n, (s, d, _) in like.specs.items()})


budget = plan.expert_bytes // 4
runtime = Runtime(plan, ExpertStore(path), budget, NumpyBackend())
weights = load_file(f"{path}/model.safetensors")
rng = np.random.default_rng(0)
for token in range(16):
    for layer, spec in enumerate(plan.layers):
        ids = rng.permutation(spec.num_experts)[: plan.top_k][None, :]
        slots = runtime.route(layer, ids)
        pool = runtime.residency.layer_pool[layer]
        for expert, slot in zip(ids[0], slots[0]):
            for name, view in pool.views.items():
                assert np.array_equal(view[slot], weights[f"{spec.path}.{name}"][expert]), \\
                    (layer, expert, name)
stats = runtime.stats_dict()
assert stats["evictions"] > 0 and stats["resident_bytes"] <= budget, stats
runtime.close()
print("streamed", stats["loads"], "experts")
"""


def test_the_core_runtime_streams_exact_experts_with_mlx_and_torch_blocked(tiny_model):
    path = tiny_model("qwen3_moe")
    plan = dataclasses.asdict(load_lazy(path)[-1])
    out = subprocess.run([sys.executable, "-c", CORE_ONLY, str(path), json.dumps(plan)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("streamed")


def test_the_minimum_budget_gives_every_pool_its_experts_with_several_expert_shapes():
    """Budgets split by integer arithmetic: `budget_holding(k)` always yields k slots a pool
    (float shares once left a pool one slot short)."""
    from mlx_moestream.plan import ExpertLayer, ModelPlan

    rng = np.random.default_rng(0)
    for _ in range(500):
        sizes = rng.integers(1, 5000, size=2).tolist()
        layers = [ExpertLayer(f"l{i}", 64, {"w": ((size,), "uint8", size)})
                  for i, size in enumerate([sizes[0]] * 3 + [sizes[1]] * 2)]
        plan = ModelPlan("t", 8, layers, 0, "")
        for k in (8, 64):
            assert min(plan.pool_slots(plan.budget_holding(k))) >= k


def test_state_shows_what_a_call_made_resident_and_stays_a_snapshot(tiny_model):
    import mlx_moestream

    model, _ = mlx_moestream.load(tiny_model("qwen3_moe"), budget="50%")
    runtime = model.moestream
    before = runtime.state()
    runtime.route(1, np.array([[[2, 5]]]))
    after = runtime.state()
    assert before.resident == (frozenset(), frozenset()) and not before.held_policy_updates
    assert after.resident == (frozenset(), frozenset({2, 5})) and not after.reading
    assert after.held_policy_updates > 0  # the call's uses, learnt at the next tally
    assert len(after.free_slots[0]) == len(before.free_slots[0]) - 2
    assert after.pinned == (frozenset(), frozenset())


def test_stall_per_token_counts_each_token_of_a_call_once():
    from mlx_moestream.stats import Stats

    stats = Stats(["a", "b"], 4)
    stats.tick(3)
    stats.stall_seconds[1] += 0.006  # the 3-token call waited 6 ms: 2 ms a token
    stats.tick(1)
    histogram = stats.as_dict()["stall_seconds_per_token_histogram"]
    bucket = histogram["bounds"].index(0.0025)  # the first bound at or above 2 ms
    assert histogram["counts"][bucket] == 3 and sum(histogram["counts"]) == 3
    assert abs(histogram["sum"] - 0.006) < 1e-12
