"""What a streamed model reports: `stats(model)`'s statistics with the memory and the
settings, and `Runtime.state`'s snapshot of what it holds."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .backend import SlotPool
from .cache import ExpertCache
from .plan import ModelPlan
from .prewarming import Prewarmer
from .reads import Reads
from .residency import Residency


@dataclass(frozen=True)
class RuntimeState:
    """What a streamed model holds between layer calls, read without reaching into the
    runtime's caches and reads (tests, tools, a server's view of its cache)."""

    resident: tuple[frozenset[int], ...]  # per layer, the experts holding a slot
    pinned: tuple[frozenset[int], ...]  # per layer, the pinned ones (never evicted)
    reading: frozenset[tuple[int, int]]  # (layer, expert) reads started, not yet waited for
    held_policy_updates: int  # uses and ticks the policies learn at the next tally
    free_slots: tuple[tuple[int, ...], ...]  # per slot pool, the slots no expert holds


def runtime_state(residency: Residency, reads: Reads) -> RuntimeState:
    """The snapshot `Runtime.state` returns."""
    plan, caches, layer_cache = residency.plan, residency.caches, residency.layer_cache
    shape = (plan.num_layers, plan.num_experts)
    layers = range(plan.num_layers)
    return RuntimeState(
        resident=tuple(frozenset(np.flatnonzero(layer_cache[l].slot_of[l] >= 0).tolist())
                       for l in layers),
        pinned=tuple(frozenset(np.flatnonzero(layer_cache[l].pinned.reshape(shape)[l]).tolist())
                     for l in layers),
        reading=frozenset((group.layer, expert) for group in reads.pending
                          for expert, _ in group.reads),
        held_policy_updates=sum(len(cache.held) for cache in caches),
        free_slots=tuple(tuple(cache.free) for cache in caches))


def stats_report(counted: dict, plan: ModelPlan, pools: list[SlotPool],
                 caches: list[ExpertCache], prewarm: Prewarmer, budget_bytes: int, policy: str,
                 prefetch: bool, host: tuple[int, int]) -> dict:
    """`Stats.as_dict`'s `counted`, with the budget, the memory the pools hold, the settings,
    the latest pre-warm's effect, and each layer's pre-warmed and pinned experts.

    `resident_bytes` counts what the budget counts: a slot's bytes for each resident expert
    (with torch's rows, the pages its rows touch, not only its weights' bytes).
    """
    groups = plan.layer_groups()
    out = {**counted,
           "budget_bytes": budget_bytes,
           "resident_bytes": sum(plan.pool_bytes(group, cache.resident)
                                 for cache, group in zip(caches, groups)),
           "slot_bytes": sum(p.nbytes for p in pools),
           "slots": sum(p.num_slots for p in pools),
           "policy": policy,
           "prefetch": prefetch,
           "host": host[0],
           "hosts": host[1],
           "prewarm": prewarm.effect(counted["hits"], counted["misses"])}
    for cache, group in zip(caches, groups):
        for i in group:
            out["layers"][i]["warm"] = int(prewarm.warm[i])
            out["layers"][i]["pinned"] = cache.pinned_in(i)
    return out
