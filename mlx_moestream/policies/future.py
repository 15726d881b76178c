"""The routing a replay will run, indexed for the offline policies (`belady`, `next-call`)."""

from __future__ import annotations

import numpy as np


class Future:
    """The keys a replay will pass to `access`/`insert`, in order, indexed for next uses.

    Each call's distinct keys, so that the next use of a key is one lookup, and optionally how
    many of them each token holds (`per_token`, which `next-call` needs). One `Future` serves
    every offline policy of a replay (one per layer with a per-layer partition).
    """

    def __init__(self, keys: np.ndarray, num_keys: int, per_token: np.ndarray | None = None):
        keys = np.asarray(keys, np.int64)
        n = len(keys)
        self.keys = np.append(keys, -1)
        # [t]: where token t's keys end; one more token past the last, that holds none
        self.token_end = (None if per_token is None
                          else np.append(np.cumsum(per_token, dtype=np.int64), n))
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

    def token_of(self, at: int) -> int:
        """The token whose keys hold position `at` (with `per_token`)."""
        return int(np.searchsorted(self.token_end, at, side="right"))
