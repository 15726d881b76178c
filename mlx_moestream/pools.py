"""A model's slot pools and their caches, sized from the budget: one per expert shape."""

from __future__ import annotations

from typing import TypeVar

import numpy as np

from .backend import Backend, SlotPool
from .budget import format_bytes
from .cache import ExpertCache, split_slots
from .errors import BudgetError
from .plan import ModelPlan

T = TypeVar("T")


def minimum_budget(plan: ModelPlan, whole_calls: bool, per_layer: bool) -> int:
    """The bytes one call of a layer must hold: its top-k experts, or every expert of the
    layer where the backend computes a call at once (`whole_calls`)."""
    return plan.budget_holding(None if whole_calls else plan.top_k, per_layer)


def check_budget(plan: ModelPlan, budget_bytes: int, whole_calls: bool, per_layer: bool) -> None:
    """Refuse a budget below `minimum_budget`, saying why it is the minimum."""
    need = minimum_budget(plan, whole_calls, per_layer)
    if budget_bytes >= need:
        return
    what = ("every expert of one layer must fit: the backend computes a call at once"
            if whole_calls else f"one token's top-{plan.top_k} experts must fit")
    if per_layer:
        what += " in each layer's share of a per-layer split"
    raise BudgetError(f"budget {format_bytes(budget_bytes)} ({budget_bytes} bytes) is "
                      f"below the minimum {format_bytes(need)} ({need} bytes): {what}")


def make_pools(plan: ModelPlan, budget_bytes: int, backend: Backend, policy: str,
               call_experts: int, per_layer: bool, layer_weights: np.ndarray | None
               ) -> tuple[list[SlotPool], list[ExpertCache]]:
    """A pool and its cache for each group of `plan.layer_groups()`, the budget split among
    them by their expert bytes (`ModelPlan.pool_slots`).

    Args:
        call_experts: the most distinct experts one call of a layer must hold at once.
        per_layer: give each layer its own share of its pool, in proportion to
            `layer_weights` (uniform when None).
    """
    pools, caches = [], []
    for group, slots in zip(plan.layer_groups(), plan.pool_slots(budget_bytes)):
        layer_slots = None
        if per_layer:
            weights = np.ones(len(group)) if layer_weights is None else layer_weights[group]
            layer_slots = split_slots(slots, weights, call_experts, plan.num_experts)
        pools.append(backend.new_pool(plan.layers[group[0]], slots))
        caches.append(ExpertCache(slots, group, plan.num_experts, plan.num_layers, policy,
                                  layer_slots))
    return pools, caches


def by_layer(plan: ModelPlan, per_group: list[T]) -> list[T]:
    """Each layer's item of `per_group` (one per group of `plan.layer_groups()`)."""
    items: list[T] = [None] * plan.num_layers
    for group, item in zip(plan.layer_groups(), per_group):
        for i in group:
            items[i] = item
    return items
