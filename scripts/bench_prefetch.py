"""Live prefetch on the embedded model: reading ahead off against on at one budget, in one
process. Prints JSON.

Both streamed models are loaded once and warmed up; their passes then alternate (--repeats
each), each a prompt and --tokens greedy decode tokens (`bench_overhead.decode_ms`). Counts are
those of the timed tokens (read before and after them, outside the timing), the process's CPU
time among them (every thread's: the I/O pool reads ahead on the cores compute would use);
prediction precision and recall are the whole session's, as `stats()` reports them.
`on_over_off_time` is the median of on's time over off's in passes run one after the other.

    python scripts/bench_prefetch.py --budget 30%
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import click
import mlx.core as mx
import mlx_lm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx_moestream  # noqa: E402
from bench_overhead import PROMPT, decode_ms  # noqa: E402  (the overhead benchmark's passes)
from mlx_moestream.hub import resolve_model_path  # noqa: E402

COUNTED = ("tokens", "hits", "misses", "demand_loads", "prefetch_loads", "prefetch_used")


def counters(model) -> dict:
    s = mlx_moestream.stats(model)
    return {**{k: s[k] for k in COUNTED}, "stall_s": s["stall_ms"] / 1e3,
            "cpu_s": time.process_time()}


def summary(model, ms: list[float], marks: list[dict]) -> dict:
    """One model's medians and the counts of its timed tokens, per token."""
    timed = {k: sum(after[k] - before[k] for before, after in zip(marks[::2], marks[1::2]))
             for k in marks[0]}
    n, s = timed["tokens"], mlx_moestream.stats(model)
    return {
        "ms_per_token": round(statistics.median(ms), 3),
        "tokens_per_second": round(1e3 / statistics.median(ms), 1),
        "hit_rate": round(timed["hits"] / (timed["hits"] + timed["misses"]), 4),
        "demand_reads_per_token": round(timed["demand_loads"] / n, 3),
        "prefetch_reads_per_token": round(timed["prefetch_loads"] / n, 3),
        "prefetch_used_per_token": round(timed["prefetch_used"] / n, 3),
        "read_stall_ms_per_token": round(timed["stall_s"] / n * 1e3, 3),
        "cpu_ms_per_token": round(timed["cpu_s"] / n * 1e3, 3),
        "prediction_precision": s["prediction_precision"],
        "prediction_recall": s["prediction_recall"],
        "passes_ms": [round(m, 3) for m in ms],
    }


@click.command()
@click.option("--budget", default="30%", show_default=True)
@click.option("--tokens", default=256, show_default=True, help="Decode tokens per pass.")
@click.option("--skip", default=8, show_default=True, help="Decode tokens left out of a pass.")
@click.option("--repeats", default=5, show_default=True, help="Measured passes of each model.")
def main(budget: str, tokens: int, skip: int, repeats: int) -> None:
    path: Path = resolve_model_path(None)
    tokenizer = mlx_lm.load(str(path))[1]
    models = {name: mlx_moestream.load(path, budget=budget, prefetch=on)[0]
              for name, on in (("off", False), ("on", True))}
    prompt = mx.array(tokenizer.encode(PROMPT))
    for model in models.values():  # warm-up: the cache reaches its steady state
        decode_ms(model, prompt, tokens, skip)
    load = os.getloadavg()[0]
    ms = {name: [] for name in models}
    marks = {name: [] for name in models}
    for _ in range(repeats):
        for name, model in models.items():
            ms[name].append(decode_ms(model, prompt, tokens, skip,
                                      lambda: marks[name].append(counters(model))))
    click.echo(json.dumps({
        "model": "embedded", "budget": budget, "tokens": tokens, "repeats": repeats,
        "load_average": [round(load, 2), round(os.getloadavg()[0], 2)],
        **{f"prefetch_{name}": summary(model, ms[name], marks[name])
           for name, model in models.items()},
        "on_over_off_time": round(statistics.median(
            on / off for off, on in zip(ms["off"], ms["on"])), 3),
    }, indent=1))


if __name__ == "__main__":
    main()
