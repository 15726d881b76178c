"""Run by tests/test_distributed.py on two hosts over the ring backend: loads a model with
expert parallelism, checks it against single-process stock mlx-lm and writes its findings as
JSON to FOLDER/i/host{rank}.json for the i-th model of the command line.

    distributed_run.py BUDGET FOLDER MODEL [MODEL ...]"""

import json
import sys
from pathlib import Path

sys.modules["torch"] = None  # hosts run MLX alone: transformers starts as without torch

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

import mlx_moestream
from mlx_moestream.store import ExpertStore
from mlx_moestream.testing import PROMPT_IDS, greedy_logits

def reads_only_its_experts(runtime) -> bool:
    """Every byte range this host's store can read is one of its own experts'."""
    full = ExpertStore(runtime.store.model_dir)
    for i, layer in enumerate(runtime.plan.layers):
        specs = {n: (shape, nbytes) for n, (shape, _, nbytes) in layer.specs.items()}
        whole = full.layers[full.add_layer(layer.path, specs, layer.total_experts)]
        share = slice(layer.first_expert, layer.first_expert + layer.num_experts)
        mine = runtime.store.layers[runtime.residency.store_layer[i]]
        if any((a.offsets != b.offsets[share]).any() for a, b in zip(mine, whole)):
            return False
    return True


def refused(record) -> str:
    """The error of an API call a host must refuse ("" if it did not)."""
    try:
        record()
    except ValueError as e:
        return str(e)
    return ""


def check(path: str, budget: str, out: Path) -> None:
    expected = greedy_logits(mlx_lm.load(path)[0], decode_tokens=12)
    model, _ = mlx_moestream.load(path, budget=budget, distributed=True)
    got = greedy_logits(model, decode_tokens=12)
    sampled = generate_step(mx.array(PROMPT_IDS[0, :8]), model, max_tokens=8,
                            sampler=make_sampler(temp=1.0))
    stats, hosts = mlx_moestream.stats(model), mlx_moestream.host_stats(model)
    (out / f"host{stats['host']}.json").write_text(json.dumps({
        "host": stats["host"],
        "tokens": stats["tokens"],
        "equal": all(mx.array_equal(a, b).item() for a, b in zip(expected, got)),
        "evictions": stats["evictions"],
        "loads": stats["loads"],
        "bytes_read": stats["bytes_read"],
        "syncs": stats["syncs"],
        "calls": 13,  # a prompt and 12 tokens
        "layer_calls": 13 * model.moestream.plan.num_layers,
        "own_reads": reads_only_its_experts(model.moestream),
        "combined_loads": hosts["combined"]["loads"],
        "sampled": [int(token) for token, _ in sampled],
        "profile_refused": refused(lambda: mlx_moestream.save_profile(model, out / "p.json")),
        "trace_refused": refused(lambda: mlx_moestream.start_trace(model)),
    }))


budget, folder = sys.argv[1], Path(sys.argv[2])
for i, path in enumerate(sys.argv[3:]):
    (folder / str(i)).mkdir(exist_ok=True)
    check(path, budget, folder / str(i))
