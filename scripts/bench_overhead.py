"""Per-token cost of streaming on a small model: the embedded model at a budget, against stock
mlx-lm on the same prompt, in one process. Prints JSON.

Both models are loaded once and warmed up; their passes then alternate (--repeats each). A pass
is a prompt and --tokens greedy decode tokens through `mlx_lm.generate.generate_step`; ms/token
is a pass's mean time per token past the first --skip tokens, and the result the median
over passes. The streamed model's statistics are those of the same timed tokens (read before
and after them, outside the timing): hit rate, host syncs per token (as `stats()` counts them),
and the time per token spent waiting for reads, which each pass subtracts from its own ms/token
for `ratio_without_read_stall`.
A third model, `synced`, is stock with the structure a streamed layer call needs and nothing
else: each expert module reads its routed ids to the host (one sync per layer) and schedules
its output at once (`mx.async_eval`). Its ratio to stock is what that structure costs, the
floor of `ratio_without_read_stall` at a budget that must sync.

    python scripts/bench_overhead.py --budget 30%
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import click
import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
from mlx.utils import tree_unflatten
from mlx_lm.generate import generate_step

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx_moestream  # noqa: E402
from mlx_moestream.hub import resolve_model_path  # noqa: E402
from mlx_moestream.mlx.model import expert_modules  # noqa: E402

PROMPT = "Ciao! Raccontami una storia breve su un gatto che vive a Roma."


def decode_ms(model, prompt: mx.array, tokens: int, skip: int,
              mark: Callable[[], None] | None = None) -> float:
    """Mean ms per decode token of one greedy pass, past the first `skip` tokens; `mark` is
    called, untimed, before and after those."""
    times, last = [], time.perf_counter()
    for i, _ in enumerate(generate_step(prompt, model, max_tokens=tokens)):
        now = time.perf_counter()
        times.append(now - last)
        if mark and i + 1 == skip:
            mark()
            now = time.perf_counter()
        last = now
    if mark:
        mark()
    return statistics.fmean(times[skip:]) * 1e3


class SyncedExperts(nn.Module):
    """Stock experts behind one host sync per call, their output scheduled at once."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        object.__setattr__(self, "inner", inner)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        y = self.inner(x, mx.array(np.array(indices)))
        mx.async_eval(y)
        return y


def synced(model: nn.Module) -> nn.Module:
    model.update_modules(tree_unflatten([(path, SyncedExperts(module))
                                         for path, module in expert_modules(model)]))
    return model


def counters(model) -> dict:
    s = mlx_moestream.stats(model)
    return {"tokens": s["tokens"], "hits": s["hits"], "misses": s["misses"], "syncs": s["syncs"],
            "stall_s": sum(layer["stall_ms"] for layer in s["layers"]) / 1e3}


@click.command()
@click.option("--budget", default="30%", show_default=True)
@click.option("--tokens", default=256, show_default=True, help="Decode tokens per pass.")
@click.option("--skip", default=8, show_default=True, help="Decode tokens left out of a pass.")
@click.option("--repeats", default=5, show_default=True, help="Measured passes of each model.")
@click.option("--prefetch/--no-prefetch", default=False, show_default=True)
def main(budget: str, tokens: int, skip: int, repeats: int, prefetch: bool) -> None:
    path = resolve_model_path(None)
    stock, tokenizer = mlx_lm.load(str(path))
    models = {"stock": stock, "synced": synced(mlx_lm.load(str(path))[0]),
              "streamed": mlx_moestream.load(path, budget=budget, prefetch=prefetch)[0]}
    prompt = mx.array(tokenizer.encode(PROMPT))
    for model in models.values():  # warm-up: the cache reaches its steady state
        decode_ms(model, prompt, tokens, skip)
    load = os.getloadavg()[0]
    streamed = models["streamed"]
    ms = {name: [] for name in models}
    marks = []  # the streamed model's counters around each pass's timed tokens
    for _ in range(repeats):
        for name, model in models.items():
            mark = (lambda: marks.append(counters(streamed))) if model is streamed else None
            ms[name].append(decode_ms(model, prompt, tokens, skip, mark))
    passes = [{k: after[k] - before[k] for k in after}
              for before, after in zip(marks[::2], marks[1::2])]
    timed = {k: sum(p[k] for p in passes) for k in passes[0]}
    n, hits, misses = timed["tokens"], timed["hits"], timed["misses"]
    stalls = [p["stall_s"] / p["tokens"] * 1e3 for p in passes]
    stock_ms, streamed_ms = statistics.median(ms["stock"]), statistics.median(ms["streamed"])
    synced_ms = statistics.median(ms["synced"])
    stall_ms = statistics.median(stalls)
    without_stall = statistics.median(m - s for m, s in zip(ms["streamed"], stalls))
    click.echo(json.dumps({
        "model": "embedded", "budget": budget, "prefetch": prefetch, "tokens": tokens, "repeats": repeats,
        "load_average": [round(load, 2), round(os.getloadavg()[0], 2)],
        "stock_ms_per_token": round(stock_ms, 3),
        "synced_ms_per_token": round(synced_ms, 3),
        "synced_ratio": round(synced_ms / stock_ms, 3),
        "streamed_ms_per_token": round(streamed_ms, 3),
        "ratio": round(streamed_ms / stock_ms, 3),
        "hit_rate": round(hits / (hits + misses), 4),
        "syncs_per_token": round(timed["syncs"] / n, 2),
        "read_stall_ms_per_token": round(stall_ms, 3),
        "ratio_without_read_stall": round(without_stall / stock_ms, 3),
        "passes_ms": {k: [round(v, 3) for v in vs] for k, vs in ms.items()},
    }, indent=1))


if __name__ == "__main__":
    main()
