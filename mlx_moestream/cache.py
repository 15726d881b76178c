"""Residency of experts in a slot pool, and the eviction policies that choose victims.

Plain Python and numpy (no mlx): the live runtime, trace replay and any other backend all use
these same classes. A key is `layer * num_experts + expert`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

import numpy as np

from .stats import Stats


class Policy:
    """Orders resident keys for eviction. The cache owns residency; a policy only ranks.

    Calls: `access(keys)` for resident keys one call used (hits), `insert(key)` when a key
    becomes resident, `victim(protected)` to remove and return the key to evict next (never one
    in `protected`), `remove(key)` when a key leaves without eviction, `tick(tokens)` to advance time.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity

    def access(self, keys: Iterable[int]) -> None:
        raise NotImplementedError

    def insert(self, key: int) -> None:
        raise NotImplementedError

    def victim(self, protected: set[int]) -> int:
        raise NotImplementedError

    def remove(self, key: int) -> None:
        raise NotImplementedError

    def tick(self, tokens: int) -> None:
        pass


class LRU(Policy):
    """Evicts the least recently used key."""

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.order: OrderedDict[int, None] = OrderedDict()

    def access(self, keys: Iterable[int]) -> None:
        move = self.order.move_to_end
        for key in keys:
            move(key)

    def insert(self, key: int) -> None:
        self.order[key] = None

    def victim(self, protected: set[int]) -> int:
        for key in self.order:
            if key not in protected:
                del self.order[key]
                return key
        raise RuntimeError("every resident expert is in use by the current call")

    def remove(self, key: int) -> None:
        del self.order[key]


POLICIES: dict[str, type[Policy]] = {"lru": LRU}


def make_policy(name: str, capacity: int) -> Policy:
    try:
        return POLICIES[name](capacity)
    except KeyError:
        raise ValueError(
            f"unknown policy '{name}'; choose one of: {', '.join(sorted(POLICIES))}"
        ) from None


class ExpertCache:
    """Maps (layer, expert) to slots of one pool of `num_slots`; evicts by policy when full.

    With one policy for all layers the budget is global; with `per_layer` each layer owns a
    policy and at most `layer_slots[layer]` slots.
    """

    def __init__(
        self,
        num_slots: int,
        layers: list[int],
        num_experts: int,
        stats: Stats,
        policy: str = "lru",
        layer_slots: list[int] | None = None,
    ):
        self.num_slots = num_slots
        self.num_experts = num_experts
        self.stats = stats
        num_layers = len(stats.layer_names)
        self.slot_of = np.full((num_layers, num_experts), -1, np.int32)
        self.key_of_slot = np.full(num_slots, -1, np.int64)
        self.free = list(range(num_slots - 1, -1, -1))
        self.count = np.zeros(num_layers, np.int64)
        if layer_slots is None:
            shared = make_policy(policy, num_slots)
            self.policy_of = {layer: shared for layer in layers}
            self.limit = {layer: num_slots for layer in layers}
        else:
            self.policy_of = {l: make_policy(policy, n) for l, n in zip(layers, layer_slots)}
            self.limit = dict(zip(layers, layer_slots))
        self.policies = list({id(p): p for p in self.policy_of.values()}.values())

    def capacity(self, layer: int) -> int:
        """How many distinct experts one call of `layer` can have resident at once."""
        return self.limit[layer]

    def request(self, layer: int, experts: np.ndarray) -> list[tuple[int, int]]:
        """Make `experts` (distinct, at most `capacity(layer)`) resident.

        Returns the (expert, slot) pairs the caller must load before computing.
        """
        slots = self.slot_of[layer, experts]
        missing = slots < 0
        n_miss = int(missing.sum())
        stats = self.stats
        stats.hits[layer] += len(experts) - n_miss
        stats.seen[layer, experts] = True
        base = layer * self.num_experts
        policy = self.policy_of[layer]
        if n_miss < len(experts):
            policy.access((experts[~missing] + base).tolist())
        if not n_miss:
            return []
        stats.misses[layer] += n_miss
        protected = set((experts + base).tolist())
        loads = []
        for expert in experts[missing].tolist():
            slot = self._take_slot(layer, policy, protected)
            key = base + expert
            self.slot_of[layer, expert] = slot
            self.key_of_slot[slot] = key
            self.count[layer] += 1
            policy.insert(key)
            loads.append((expert, slot))
        return loads

    def _take_slot(self, layer: int, policy: Policy, protected: set[int]) -> int:
        if self.free and self.count[layer] < self.limit[layer]:
            return self.free.pop()
        victim = policy.victim(protected)
        v_layer, v_expert = divmod(victim, self.num_experts)
        slot = int(self.slot_of[v_layer, v_expert])
        self.slot_of[v_layer, v_expert] = -1
        self.count[v_layer] -= 1
        self.stats.evictions[v_layer] += 1
        return slot

    def discard(self, layer: int, expert: int) -> None:
        """Forget a resident expert whose load failed, so its slot is never read as valid."""
        slot = int(self.slot_of[layer, expert])
        self.policy_of[layer].remove(layer * self.num_experts + expert)
        self.slot_of[layer, expert] = -1
        self.key_of_slot[slot] = -1
        self.count[layer] -= 1
        self.free.append(slot)

    def tick(self, tokens: int) -> None:
        for policy in self.policies:
            policy.tick(tokens)

    @property
    def resident(self) -> int:
        return self.num_slots - len(self.free)
