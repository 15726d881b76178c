"""Window LFU (`wlfu`), the previous default: frequency with decay, behind a recency guard."""

from __future__ import annotations

import numpy as np

from .base import Policy, add_counts, all_in_use, check_tokens

MAX_RECENT_TOKENS = 1024  # the guard keeps a list this long, updated every token
_RANK_SIZE = 256  # candidates sorted at once: more than a token evicts at common shapes


class WindowLFU(Policy, name="wlfu"):
    """LFU over a sliding window, behind a short recency guard.

    Counts halve every `half_life` tokens (seeded ones too), so the cache follows a workload
    that shifts; among equal counts the least recently used goes. Experts used in the last
    `recent_tokens` tokens go only when no other is left, as consecutive tokens share many
    experts; when they fill more than `guard_share` of the capacity only the current token's
    are guarded, so the policy does not turn into LRU at small budgets.
    """

    def __init__(self, capacity: int, num_keys: int, half_life: int = 64, recent_tokens: int = 2,
                 guard_share: float = 0.75):
        super().__init__(capacity, num_keys)
        check_tokens(half_life)
        if not 1 <= recent_tokens <= MAX_RECENT_TOKENS:  # a longer guard holds every key
            raise ValueError(f"recent_tokens must be in [1, {MAX_RECENT_TOKENS}], got "
                             f"{recent_tokens}")
        if not 0.0 <= guard_share <= 1.0:
            raise ValueError(f"guard_share must be in [0, 1], got {guard_share}")
        self.half_life = half_life
        self.guard_limit = capacity * guard_share
        self.count = np.zeros(num_keys)  # decayed uses, times `weight`, but for `pending`
        self.pending: list[list[int]] = []  # keys of the calls not yet added to `count`
        self.weight = 1.0  # what one use adds now, so that no count is halved
        self.rescaled = 0  # halvings already applied to `count`
        self.tokens = 0
        self.uses = 0  # calls to `access` so far
        self.now = np.zeros((), np.int64)  # `uses` as an array: numpy assigns it without converting
        self.last_use = np.zeros(num_keys, np.int64)  # `uses` at the key's latest use; 0: never
        self.starts = [0] * recent_tokens  # `uses` before each guarded token, oldest first
        self.resident = np.zeros(num_keys, np.bool_)
        # the same memory, read and written one key at a time at half numpy's cost per item
        self._last_use, self._resident = memoryview(self.last_use), memoryview(self.resident)
        self.guarded = 0  # guarded residents at the latest count
        self.touched = 0  # keys used since that count, a bound on the guarded ones it missed
        self.evictable_below = 0  # keys used after `uses` reached this are guarded
        self.bound = np.inf  # a token's first ranking reads only the keys counted at most this
        self._forget_order()

    def access(self, keys: list[int], new: list[int] = ()) -> None:
        self.uses += 1
        self.now[()] = self.uses
        self.touched += len(keys)
        self.pending.append(keys)
        self.last_use[keys] = self.now
        resident = self._resident
        for key in new:
            resident[key] = True

    def insert(self, keys: list[int]) -> None:
        self.resident[keys] = True

    def remove(self, key: int) -> None:
        self._resident[key] = False
        self._forget_order()

    def victims(self, n: int, protected: set[int]) -> list[int]:
        """Read victims off the token's ranking: a use cannot make a key evictable within its
        token, so the evictable keys are ranked once per token, not once per call."""
        if self.level == 0 and self.guarded + self.touched > self.guard_limit:
            self._forget_order()  # the guard may be over its share: rank again, counting
        chosen: list[int] = []
        resident, last_use = self._resident, self._last_use
        while True:
            order, below = self.order, self.evictable_below
            for i in range(self.next, len(order)):
                key = order[i]
                if last_use[key] <= below and key not in protected:
                    resident[key] = False
                    chosen.append(key)
                    if len(chosen) == n:
                        self.next = i + 1
                        return chosen
            self._rank(protected)

    def _rank(self, protected: set[int]) -> None:
        """Order the next candidates, least count first, widening them once all are ranked.

        They widen from the unguarded (but the current token's, when the guard is over its
        share) to all but the current token's, then to every resident but `protected`. Only
        the lowest `_RANK_SIZE` counts are sorted, and the highest of them is kept as `bound`:
        counts only grow, so a token's first ranking reads only the candidates counted at most
        `bound`, a prefix of the full order, and skips partitioning every candidate.
        """
        self._count_pending()
        first = self.level < 0  # the token's first ranking (or the first since a change)
        level = min(self.level + 1, 2) if self.complete else self.level
        resident, last_use, count = self.resident, self.last_use, self.count
        below = (self.starts[0], self.starts[-1], self.uses)[level]
        candidates = resident & (last_use <= below)
        if level == 0:
            self.guarded = int(np.count_nonzero(resident) - np.count_nonzero(candidates))
            self.touched = 0
            if self.guarded > self.guard_limit:
                level, below = 1, self.starts[-1]
                candidates = resident & (last_use <= below)
        bounded = first and self.bound < np.inf
        if bounded:
            eligible = (candidates & (count <= self.bound)).nonzero()[0]
            bounded = len(eligible) >= _RANK_SIZE // 2  # else too few to last the token
        if not bounded:
            eligible = candidates.nonzero()[0]
        self.complete = not bounded
        if level == 2:
            eligible = eligible[~np.isin(eligible, list(protected))]
            if not len(eligible):
                raise all_in_use()
        ranked = count[eligible]
        if len(eligible) > _RANK_SIZE:  # the lowest counts, every key of the highest of them
            self.complete = False
            self.bound = np.partition(ranked, _RANK_SIZE)[_RANK_SIZE]
            keep = ranked <= self.bound
            eligible, ranked = eligible[keep], ranked[keep]
        order = np.lexsort((last_use[eligible], ranked))
        self.order = eligible[order].tolist()
        self.next = 0
        self.level = level
        self.evictable_below = below

    def _forget_order(self) -> None:
        self.order: list[int] = []
        self.next = 0
        self.level = -1
        self.complete = True

    def _count_pending(self) -> None:
        """Add the pending uses to `count`: one numpy call per token instead of one per call."""
        if self.pending:
            np.add.at(self.count, np.concatenate(self.pending), self.weight)
            self.pending = []

    def tick(self, tokens: int) -> None:
        """Advance the clock: past each multiple of `half_life`, a use weighs twice as much."""
        self._count_pending()  # at the weight of the token they were used in
        guarded = len(self.starts)
        self.starts = (self.starts + [self.uses] * min(tokens, guarded))[-guarded:]
        clock = self.tokens + tokens
        self.tokens = clock
        halvings = clock // self.half_life - self.rescaled
        if halvings > 512:  # rescale before the weight overflows; the order is unchanged
            self.count *= 0.5**halvings
            self.bound *= 0.5**halvings
            self.rescaled += halvings
            halvings = 0
        self.weight = 2.0**halvings
        self._forget_order()

    def seed(self, counts: dict[int, float]) -> None:
        self._count_pending()
        add_counts(self.count, counts, self.weight)
        self._forget_order()
