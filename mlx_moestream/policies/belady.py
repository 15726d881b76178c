"""Belady's offline optimum, the bound replay measures the live policies against."""

from __future__ import annotations

import numpy as np

from .base import Policy, Resident


class Future:
    """The keys a replay will pass to `access`/`insert`, in order, indexed for next uses.

    Each call's distinct keys, so that the next use of a key is one lookup, and optionally the
    token of each (`tokens`, which `next-call` needs). One `Future` serves every offline policy
    of a replay (one per layer with a per-layer partition).
    """

    def __init__(self, keys: np.ndarray, num_keys: int, tokens: np.ndarray | None = None):
        keys = np.asarray(keys, np.int64)
        n = len(keys)
        self.keys = np.append(keys, -1)
        self.tokens = None if tokens is None else np.append(np.asarray(tokens, np.int64), -1)
        self.next_at = np.full(n + 1, n, np.int64)  # [i]: where keys[i] is used next, n if never
        self.first_at = np.full(num_keys, n, np.int64)  # [key]: where it is first used, n if never
        order = np.argsort(keys, kind="stable")
        same = keys[order[1:]] == keys[order[:-1]]
        self.next_at[order[:-1][same]] = order[1:][same]
        starts = order[np.append(True, ~same)] if n else order
        self.first_at[keys[starts]] = starts

    def use(self, key: int, at: int) -> int:
        """The position of `key`'s use after position `at` (its first use for -1), checked."""
        at = self.first_at[key] if at < 0 else self.next_at[at]
        if self.keys[at] != key:
            raise RuntimeError(f"key {key} is used out of the order the replay's future holds")
        return at


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
