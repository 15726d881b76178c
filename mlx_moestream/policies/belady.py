"""Belady's offline optimum, the bound replay measures the live policies against."""

from __future__ import annotations

import numpy as np

from .base import Policy, Resident
from .future import Future


class Belady(Policy, name="belady"):
    """Evicts the resident key whose next use is farthest away, keys never used again first.

    Replay only: `future` (a `Future`, or the key sequence to build one) must be exactly the
    keys the cache will pass to `access` and `insert`, in order.
    """

    offline = True

    def __init__(self, capacity: int, num_keys: int, future: Future | np.ndarray | None = None):
        super().__init__(capacity, num_keys)
        if future is None:
            raise ValueError("belady is offline, for replay only: it needs the future routing")
        self.future = future if isinstance(future, Future) else Future(future, num_keys)
        self.at = np.full(num_keys, -1, np.int64)  # position in the future of the latest use
        self.next_use = np.full(num_keys, float(len(self.future.keys)))
        self.resident = Resident(num_keys)

    def _use(self, key: int) -> None:
        self.at[key] = at = self.future.use(key, self.at[key])
        self.next_use[key] = self.future.next_at[at]

    def access(self, keys: list[int], new: list[int] = ()) -> None:
        for key in keys:
            self._use(key)
        self.insert(new)

    def insert(self, keys: list[int]) -> None:
        for key in keys:
            self.resident.add(key)

    def warm(self, keys: list[int]) -> None:
        """Rank keys resident before the replay (a profile's pre-warm) by their first use: a use
        here would be one the future does not hold."""
        for key in keys:
            self.next_use[key] = self.future.first_at[key]
        self.insert(keys)

    def victims(self, n: int, protected: set[int]) -> list[int]:
        resident = self.resident
        return [resident.pop_min(-self.next_use[resident.active], protected) for _ in range(n)]

    def remove(self, key: int) -> None:
        self.resident.drop(key)
