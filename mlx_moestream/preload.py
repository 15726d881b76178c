"""The read of every expert at load, when each has a slot of its own (`Residency.holds_all`).

Then no slot is ever reused: the experts are read once, as stock mlx-lm reads its weights at
load, and the backend computes without waiting on the host.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Callable

from .reads import Reads
from .residency import Residency
from .store import ExpertStore, Run

Counted = list[tuple[int, int, float, int]]  # (layer, bytes, seconds, experts) of one read


def read_all(residency: Residency, reads: Reads, progress: Callable | None = None) -> None:
    """Give every expert a slot and read it there, on the I/O threads of `reads`.

    A layer whose slots are one block in expert order is read in a few large reads in file
    order (`ExpertStore.plan_reads`), any other (a repacked copy, a pool placing experts
    otherwise) expert by expert. `progress(items, label)` may wrap the reads.
    """
    plan, store, store_layer = residency.plan, residency.store, residency.store_layer
    layer_cache, layer_pool = residency.layer_cache, residency.layer_pool
    jobs, in_runs = [], {}  # store layer -> (layer, destination) of those read in runs
    for layer in range(plan.num_layers):
        slots = layer_cache[layer].admit_layer(layer)
        dest = layer_pool[layer].layer_destination(layer, slots)
        if dest is not None and not store.expert_major(store_layer[layer]):
            in_runs[store_layer[layer]] = (layer, dest)
        else:
            jobs.append(reads.pool.submit(_read_experts, reads, layer, slots))
    runs = store.plan_reads({i: dest for i, (_, dest) in in_runs.items()})
    layer_of = {i: layer for i, (layer, _) in in_runs.items()}
    jobs += [reads.pool.submit(_read_run, store, run, layer_of) for run in runs]
    context = progress(jobs, "read experts") if progress else nullcontext(jobs)
    try:
        with context as items:
            for job in items:  # items first: the bar ends at 100%
                for layer, nbytes, seconds, experts in job.result():
                    reads.stats.count_read(layer, nbytes, seconds, experts)
    except BaseException:
        for job in jobs:
            job.cancel()
        raise
    for layer, _ in in_runs.values():
        reads.stats.loads[layer] += plan.layers[layer].num_experts


def _read_experts(reads: Reads, layer: int, slots: list[int]) -> Counted:
    """Every expert of a layer into `slots`, one read each: (layer, bytes, seconds, 1)."""
    return [(layer, *reads.read(layer, e, s), 1) for e, s in enumerate(slots)]


def _read_run(store: ExpertStore, run: Run, layer_of: dict[int, int]) -> Counted:
    """One read of `plan_reads` (`layer_of` maps its store layers to layers): (layer, bytes,
    seconds, 0) for each layer it reads, the seconds shared by bytes; `read_all` counts a
    layer's experts once all its runs are read."""
    start = time.perf_counter()
    store.read_run(run)
    seconds = time.perf_counter() - start
    nbytes: dict[int, int] = {}
    for _, store_layer, _, buf in run.pieces:
        layer = layer_of[store_layer]
        nbytes[layer] = nbytes.get(layer, 0) + len(buf)
    total = sum(nbytes.values())
    return [(layer, n, seconds * n / total, 0) for layer, n in nbytes.items()]
