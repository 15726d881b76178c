"""The classic eviction policies: LRU, LFU and segmented LRU."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from .base import Policy, Resident, add_counts, all_in_use


class LRU(Policy, name="lru"):
    """Evicts the least recently used key."""

    def __init__(self, capacity: int, num_keys: int):
        super().__init__(capacity, num_keys)
        self.order: OrderedDict[int, None] = OrderedDict()

    def access(self, keys: list[int], new: list[int] = ()) -> None:
        move = self.order.move_to_end
        for key in keys:
            if key not in new:
                move(key)
        self.order.update(dict.fromkeys(new))  # the misses, after the hits

    def insert(self, keys: list[int]) -> None:
        self.order.update(dict.fromkeys(keys))
        for key in keys:
            self.order.move_to_end(key, last=False)

    def victims(self, n: int, protected: set[int]) -> list[int]:
        return [_pop_oldest(self.order, protected) for _ in range(n)]

    def remove(self, key: int) -> None:
        del self.order[key]


class LFU(Policy, name="lfu"):
    """Evicts the resident key used least often; the least recently used among equals.

    Counts are exact (one per call that used the key) and kept for keys that are not resident,
    so a returning expert is remembered. They never decay: see `WindowLFU` for that.
    """

    def __init__(self, capacity: int, num_keys: int):
        super().__init__(capacity, num_keys)
        self.count = np.zeros(num_keys)
        self.last_use = np.zeros(num_keys, np.int64)  # value of `uses` at the key's latest use
        self.uses = 0
        self.resident = Resident(num_keys)

    def access(self, keys: list[int], new: list[int] = ()) -> None:
        self.uses += 1
        self.count[keys] += 1
        self.last_use[keys] = self.uses
        self.insert(new)

    def insert(self, keys: list[int]) -> None:
        for key in keys:
            self.resident.add(key)

    def victims(self, n: int, protected: set[int]) -> list[int]:
        resident = self.resident
        return [resident.pop_min(self.count[resident.active], protected, tie=self.last_use)
                for _ in range(n)]

    def remove(self, key: int) -> None:
        self.resident.drop(key)

    def seed(self, counts: dict[int, float]) -> None:
        add_counts(self.count, counts)


class SLRU(Policy, name="slru"):
    """Segmented LRU: a key enters probation, and a hit promotes it to the protected segment.

    The protected segment holds `protected_share` of the capacity; when it overflows, its least
    recently used key falls back to probation. The victim comes from probation: the key that
    entered it in the earliest token, the least used (counted like `LFU`) among keys that
    entered in the same token. Protected keys go, least recently used first, only when
    probation has none to give.
    """

    def __init__(self, capacity: int, num_keys: int, protected_share: float = 0.8):
        super().__init__(capacity, num_keys)
        if not 0.0 <= protected_share <= 1.0:
            raise ValueError(f"protected_share must be in [0, 1], got {protected_share}")
        self.protected_slots = int(capacity * protected_share)
        self.probation = Resident(num_keys)
        self.protected: OrderedDict[int, None] = OrderedDict()
        self.entered = np.zeros(num_keys)  # token in which the key entered probation
        self.count = np.zeros(num_keys)
        self.tokens = 0

    def access(self, keys: list[int], new: list[int] = ()) -> None:
        self.count[keys] += 1
        protected = self.protected
        for key in keys:
            if key in new:
                continue
            if key in protected:
                protected.move_to_end(key)
                continue
            self.probation.drop(key)  # a hit in probation is promoted
            protected[key] = None
            if len(protected) > self.protected_slots:
                self._enter_probation(protected.popitem(last=False)[0])
        for key in new:  # a miss enters probation
            self._enter_probation(key)

    def insert(self, keys: list[int]) -> None:
        for key in keys:
            self._enter_probation(key)
            self.entered[key] = -1  # before every key that a call used

    def _enter_probation(self, key: int) -> None:
        self.probation.add(key)
        self.entered[key] = self.tokens

    def victims(self, n: int, protected: set[int]) -> list[int]:
        probation = self.probation
        chosen = []
        for _ in range(n):
            key = probation.pop_min(self.entered[probation.active], protected, tie=self.count,
                                    or_none=True)
            chosen.append(_pop_oldest(self.protected, protected) if key is None else key)
        return chosen

    def remove(self, key: int) -> None:
        if key in self.protected:
            del self.protected[key]
        else:
            self.probation.drop(key)

    def tick(self, tokens: int) -> None:
        self.tokens += tokens

    def seed(self, counts: dict[int, float]) -> None:
        add_counts(self.count, counts)


def _pop_oldest(order: OrderedDict, protected: set[int]) -> int:
    """Remove and return the least recent key of `order` that is not in `protected`."""
    for key in order:
        if key not in protected:
            del order[key]
            return key
    raise all_in_use()
