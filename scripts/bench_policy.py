"""Bookkeeping cost and hit rates of every eviction policy. Prints JSON.

Cost: microseconds per MoE layer per token, at top-k 8, 128 experts, 48 layers, one pool for all
layers (no expert is read):
  - `hit_us`: every expert fits and is resident, so every request is a hit (steady state);
  - `miss_us`: the synthetic drift trace at 25% and 50% capacity, after a warm-up of a quarter
    of the trace; `miss_rate` is the share of accesses that missed while timed.
Each gives `us`, the whole `ExpertCache.request` + `tick` and the counting of its result
(residency map, statistics and policy),
and `policy_us`, the policy's own calls (`access`, `victims`, `tick`): the calls the
cache made, recorded and replayed on a fresh policy, timed with the replay loop's overhead.
Hit rates: each policy replayed on synthetic drift traces (see `synthetic_trace`; the workload
switches halfway) at 10%, 25% and 50% capacity, with the difference to LRU in points and the
tokens each needs to recover after the switch (see `replay`). Timings are the fastest of
`--runs` runs; the setup's garbage is collected before each timed loop, so that no collection of
it (the recorded calls are a large heap) lands in the timed part.

    python scripts/bench_policy.py --layers 48 --tokens 2048
"""

from __future__ import annotations

import gc
import json
import sys
import time
from functools import partial
from typing import Callable
from pathlib import Path

import click
import numpy as np

# Run from a plain checkout as well as from an installed package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlx_moestream.cache import ExpertCache  # noqa: E402
from mlx_moestream.policies import (  # noqa: E402
    POLICIES,
    Future,
    Policy,
    make_policy,
    policy_class,
)
from mlx_moestream.replay import sweep  # noqa: E402
from mlx_moestream.stats import Stats  # noqa: E402
from mlx_moestream.trace import synthetic_trace  # noqa: E402


def time_requests(name: str, slots: int, rows: list[list[list[int]]], num_experts: int,
                  warm_tokens: int, runs: int) -> dict:
    """Fastest of `runs` runs (the machine may be shared) of `time_once`, each timing on its
    own."""
    timed = [time_once(name, slots, rows, num_experts, warm_tokens) for _ in range(runs)]
    return {key: min(run[key] for run in timed) for key in timed[0]}


class Recorder:
    """Forwards every call to `policy` and logs it, to replay later."""

    def __init__(self, policy: Policy):
        self.policy = policy
        self.calls: list[tuple[str, tuple]] = []

    def __getattr__(self, name: str):
        method = getattr(self.policy, name)

        def call(*args):
            self.calls.append((name, args))
            return method(*args)

        return call


def time_once(name: str, slots: int, rows: list[list[list[int]]], num_experts: int,
              warm_tokens: int) -> dict:
    """Replay `rows[token][layer]` through a fresh cache; time all but the first `warm_tokens`,
    then time the policy calls of that part alone."""
    layers = len(rows[0])
    num_keys = layers * num_experts
    options = {}
    if policy_class(name).offline:  # it is given the rows ahead, and their keys per token
        future = [l * num_experts + e for row in rows for l, r in enumerate(row) for e in r]
        per_token = [sum(map(len, row)) for row in rows]
        options["future"] = Future(future, num_keys, np.array(per_token))
    new_policy = partial(make_policy, name, num_keys=num_keys, num_experts=num_experts,
                         **options)
    stats = Stats([f"layer{i}" for i in range(layers)], num_experts)
    cache = ExpertCache(slots, list(range(layers)), num_experts, layers, new_policy)
    request, tick = cache.request, cache.tick
    count, count_evictions = stats.count_request, stats.count_evictions

    def replay(rows):
        for row in rows:
            tick(1)
            for layer, experts in enumerate(row):
                loads, hits, evicted = request(layer, experts)
                count(layer, hits, len(loads))
                if evicted:
                    count_evictions(evicted)

    replay(rows[:warm_tokens])
    hits0, misses0 = int(stats.hits.sum()), int(stats.misses.sum())
    gc.collect()
    start = time.perf_counter()
    replay(rows[warm_tokens:])
    seconds = time.perf_counter() - start
    hits, misses = int(stats.hits.sum()) - hits0, int(stats.misses.sum()) - misses0
    per_call = (len(rows) - warm_tokens) * layers
    return {
        "us": round(seconds / per_call * 1e6, 2),
        "policy_us": round(policy_seconds(new_policy, slots, rows, num_experts, warm_tokens)
                           / per_call * 1e6, 2),
        "miss_rate": round(misses / (hits + misses), 4),
    }


def policy_seconds(new_policy: Callable[[int], Policy], slots: int,
                   rows: list[list[list[int]]], num_experts: int, warm_tokens: int) -> float:
    """Seconds a policy spends on the calls a cache makes for `rows` after `warm_tokens`: the
    calls are recorded from a cache run, then replayed on a fresh policy."""
    layers = len(rows[0])
    recorder = Recorder(new_policy(slots))
    cache = ExpertCache(slots, list(range(layers)), num_experts, layers, lambda _: recorder)
    for i, row in enumerate(rows):
        if i == warm_tokens:
            warm_calls = len(recorder.calls)
        cache.tick(1)
        for layer, experts in enumerate(row):
            cache.request(layer, experts)
    policy = new_policy(slots)
    calls = [(getattr(policy, name), args) for name, args in recorder.calls]
    for method, args in calls[:warm_calls]:
        method(*args)
    gc.collect()
    start = time.perf_counter()
    for method, args in calls[warm_calls:]:
        method(*args)
    return time.perf_counter() - start


def rows_of(experts: np.ndarray) -> list[list[list[int]]]:
    """Each token's and layer's distinct experts, as the runtime passes them (in order)."""
    return np.sort(experts.astype(np.int64), axis=2).tolist()


@click.command()
@click.option("--layers", type=int, default=48, show_default=True)
@click.option("--experts", "num_experts", type=int, default=128, show_default=True)
@click.option("--top-k", type=int, default=8, show_default=True)
@click.option("--tokens", type=int, default=2048, show_default=True, help="Per trace.")
@click.option("--repeat", "repeats", type=float, multiple=True, default=(0.1, 0.3),
              show_default=True, help="Temporal locality of the hit-rate traces (repeatable).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--runs", type=int, default=5, show_default=True,
              help="Timed runs of each configuration; the fastest is reported.")
def main(layers: int, num_experts: int, top_k: int, tokens: int, repeats: tuple[float, ...],
         seed: int, runs: int) -> None:
    names = sorted(POLICIES, key=lambda name: POLICIES[name].offline)  # the optimum last
    total = layers * num_experts
    trace = synthetic_trace(tokens, layers, num_experts, top_k, seed=seed)
    rows = rows_of(trace.experts)
    warm_rows = [[list(range(num_experts))] * layers] + rows
    cost = {}
    for name in names:
        click.echo(f"timing {name}", err=True)
        cost[name] = {
            "hit_us": time_requests(name, total, warm_rows, num_experts, 1, runs),
            "miss_us": {
                f"{round(f * 100)}%": time_requests(name, round(f * total), rows, num_experts,
                                                   tokens // 4, runs)
                for f in (0.25, 0.5)
            },
        }
    hit_rates = {}
    for repeat in repeats:
        click.echo(f"replaying repeat={repeat}", err=True)
        drift = synthetic_trace(tokens, layers, num_experts, top_k, repeat=repeat, seed=seed)
        table = {}
        for r in sweep(drift, names, [0.1, 0.25, 0.5]):
            row = table.setdefault(f"{round(r['capacity_fraction'] * 100)}%", {
                "hit_rate": {}, "vs_lru_points": {}, "recovery_tokens": {}})
            row["hit_rate"][r["policy"]] = round(r["hit_rate"], 4)
            row["vs_lru_points"][r["policy"]] = round(100 * (r["hit_rate"] - r["lru_hit_rate"]), 1)
            row["recovery_tokens"][r["policy"]] = r["recovery_tokens"][0]
        hit_rates[f"skew=1.0 repeat={repeat}"] = table
    out = {
        "layers": layers,
        "num_experts": num_experts,
        "top_k": top_k,
        "tokens": tokens,
        "bookkeeping_us_per_layer_token": cost,
        "hit_rates": hit_rates,
    }
    click.echo(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
