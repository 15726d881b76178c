"""Which expert sits in which slot: the slot pools, their caches, and the reads into them.

The runtime decides when to read (route -> ensure resident -> compute); this module owns
where an expert lands, how a slot is filled from the store, and how an expert leaves it.
"""

from __future__ import annotations

import time

import numpy as np

from .backend import Backend
from .interrupts import CRITICAL
from .plan import ModelPlan
from .pools import by_layer, make_pools
from .store import ExpertStore


class Residency:
    """The slot pools of one streamed model, the caches that assign their slots, per layer."""

    def __init__(self, plan: ModelPlan, store: ExpertStore, budget_bytes: int, backend: Backend,
                 policy: str, call_experts: int, per_layer: bool,
                 layer_weights: np.ndarray | None):
        """
        Args:
            call_experts: the most distinct experts one call of a layer must hold at once.
            per_layer: give each layer its own share of a pool (`layer_weights`, or uniform).
        """
        self.plan = plan
        self.store = store
        self.store_layer = [
            store.add_layer(l.path, {n: (shape, b) for n, (shape, _, b) in l.specs.items()},
                            l.total_experts or l.num_experts,
                            range(l.first_expert, l.first_expert + l.num_experts))
            for l in plan.layers
        ]
        self.pools, self.caches = make_pools(plan, budget_bytes, backend, policy, call_experts,
                                             per_layer, layer_weights)
        self.layer_pool, self.layer_cache = by_layer(plan, self.pools), by_layer(plan, self.caches)
        # every expert can have a slot of its own: none is ever reused, so the backend may
        # read all of them at load (`Runtime.read_all`) and compute without waiting on the host
        self.holds_all = all(cache.holds_all for cache in self.caches)

    def capacity(self, layer: int) -> int:
        """The most experts of `layer` resident at once."""
        return self.layer_cache[layer].capacity(layer)

    def slot_map(self, layer: int) -> np.ndarray:
        """The slot of every expert of `layer` (-1: not resident)."""
        return self.layer_cache[layer].slots(layer, np.arange(self.plan.layers[layer].num_experts))

    def read(self, layer: int, expert: int, slot: int) -> tuple[int, float]:
        """Read one expert into its slot: (bytes, seconds)."""
        start = time.perf_counter()
        with self.layer_pool[layer].landing(layer, expert, slot) as destination:
            nbytes = self.store.read_expert(self.store_layer[layer], expert, destination)
        return nbytes, time.perf_counter() - start

    def forget(self, layer: int, *experts: int) -> None:
        """Take experts whose reads failed, were cut short or never started out of their slots.

        Forgetting one twice does nothing. One step that an interrupt cannot cut: the held
        policy updates first, then every expert leaves before any is released (a release may
        fail).
        """
        with CRITICAL:
            gone = [layer * self.plan.num_experts + expert for expert in experts
                    if self.layer_cache[layer].discard(layer, expert)]
            self.release(gone)

    def release(self, keys: list[int]) -> None:
        """Tell the pools that want to know that `keys` (`layer * num_experts + expert`) left
        their slots."""
        resident = {}  # per layer, which experts hold a slot now
        for key in keys:
            layer, expert = divmod(key, self.plan.num_experts)
            pool = self.layer_pool[layer]
            if pool.releases:
                if layer not in resident:
                    resident[layer] = self.slot_map(layer) >= 0
                pool.release(layer, expert, resident[layer])
