"""What `stats(model)` reports: the counted statistics with the memory and the settings."""

from __future__ import annotations

from .backend import SlotPool
from .cache import ExpertCache
from .plan import ModelPlan
from .prewarming import Prewarmer


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
