"""`next-call`: `cyclic`'s rule with the next call known, a bound on what prediction can win."""

from __future__ import annotations

import numpy as np

from .base import Policy, Resident, all_in_use, check_tokens
from .future import Future


class NextCall(Policy, name="next-call"):
    """Evicts the key of least `p / d`, as `cyclic` does, with `p` known rather than estimated:
    1 if its layer's next call uses it, else 0; among equals, the least used per slot-call
    (counts halving every `half_life` tokens) goes.

    Replay only: `future` must hold the replay's keys and their count per token. `cyclic` with
    a perfect predictor of each layer's next call would rank as this one does, so its hit rate
    bounds what better prediction can win under `p / d`; Belady bounds every policy.
    """

    offline = True
    layered = True

    def __init__(self, capacity: int, num_keys: int, num_experts: int | None = None,
                 future: Future | None = None, half_life: int = 32):
        super().__init__(capacity, num_keys)
        if future is None or future.token_end is None:
            raise ValueError("next-call is offline, for replay only: it needs the future "
                             "routing and its tokens")
        check_tokens(half_life)
        self.future = future
        self.num_experts = num_experts or num_keys
        self.layers = num_keys // self.num_experts
        self.at = np.full(num_keys, -1, np.int64)  # position in the future of the latest use
        self.count = np.zeros(num_keys)
        self.decay = 0.5 ** (1.0 / half_life)
        self.resident = Resident(num_keys)

    def access(self, keys: list[int], new: list[int] = ()) -> None:
        for key in keys:
            self.at[key] = self.future.use(key, self.at[key])
        self.count[keys] += 1.0
        self.insert(new)

    def insert(self, keys: list[int]) -> None:
        for key in keys:
            self.resident.add(key)

    def warm(self, keys: list[int]) -> None:
        """Keys a profile pre-warmed: resident without a use, so the future is not advanced."""
        self.insert(keys)

    def tick(self, tokens: int) -> None:
        self.count *= self.decay ** tokens

    def victims(self, n: int, protected: set[int]) -> list[int]:
        future, E = self.future, self.num_experts
        current = next(iter(protected))  # a key of the call being served: its layer and token
        layer, token = current // E, future.token_of(future.use(current, self.at[current]))
        keys = self.resident.active
        later = keys // E > layer
        d = np.where(later, 0, self.layers) + keys // E - layer  # calls to its layer's next
        at = self.at[keys]
        coming = np.where(at < 0, future.first_at[keys], future.next_at[at])
        # a later layer's next call is in this token, another's in the next: a key of either is
        # not used again before that call, so a use before the token's end is at that call
        p = coming < future.token_end[token + ~later]
        rank = (p + 1e-9 * self.count[keys]) / d  # a count (below ~50) only breaks ties
        rank[np.isin(keys, list(protected))] = np.inf
        order = np.argsort(rank, kind="stable")[:n]
        if len(order) < n or np.isinf(rank[order]).any():
            raise all_in_use()
        chosen = keys[order].tolist()
        for key in chosen:
            self.resident.drop(key)
        return chosen

    def remove(self, key: int) -> None:
        self.resident.drop(key)
