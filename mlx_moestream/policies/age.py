"""Age cyclic (`age`): `cyclic`'s rule with the recency part of `p` learned per age."""

from __future__ import annotations

import math

import numpy as np

from .base import ScoredCyclic, add_counts, check_blend, decay_per_token


class LayerAge(ScoredCyclic, name="age"):
    """Evicts the expert of least `p / d`, `p` learned from how many calls ago it was used.

    As in `cyclic`, `d` is the number of layer calls until the key's layer is called again and
    `p` blends, with `freq_share` of the first, the key's use rate (counts halving every
    `half_life` tokens) and a rate learned online. Here that rate is per age: how often keys
    whose latest use was 1, 2-3, 4-7, ... calls of their layer ago (or never) are used at its
    next call. `cyclic`'s two groups are its first age and the rest merged; finer ages keep an
    expert that comes back a few calls later. The oldest age starts at the largest power of two
    up to four half-lives (in calls), past which the counts hold little; pre-warmed keys rank
    as never used, on their seeded counts. Ranking by a use chance learned per age is LHD's
    (Beckmann et al., NSDI 2018). Prefetched keys that no call used go first.
    Pure numpy, for replay: a victim search reads every key.
    """

    def __init__(self, capacity: int, num_keys: int, num_experts: int | None = None,
                 half_life: int = 32, freq_share: float = 0.5):
        super().__init__(capacity, num_keys, num_experts)
        check_blend(half_life, freq_share)
        self.per_token = decay_per_token(half_life)
        self.half_life, self.freq_share = half_life, freq_share
        # 1, 2-3, ..., then all from 4 half-lives (ages of more calls ago), then never used
        self.ages = int(math.log2(4 * half_life)) + 2
        shape = (self.layers, self.experts)
        self.count = np.zeros(shape)  # decayed uses, times `weight`
        self.last = np.full(shape, -1, np.int64)  # its layer's call that last used it, -1: none
        self.calls = np.zeros(self.layers, np.int64)
        self.age_uses = np.ones(self.ages)  # per age, times `weight`: uses at the next call
        self.age_offers = np.full(self.ages, 2.0)  # and keys of that age at a call
        self.tokens, self.rescaled, self.weight = 0, 0.0, 1.0

    def _age(self, layers: int | slice, ahead: int | np.ndarray) -> np.ndarray:
        """The age of each key of `layers` at its layer's call `ahead` calls from the latest."""
        calls_ago = (self.calls[layers] + ahead)[..., None] - self.last[layers]
        age = np.log2(calls_ago).astype(np.int64).clip(max=self.ages - 2)
        return np.where(self.last[layers] < 0, self.ages - 1, age)

    def access(self, keys: list[int], new: list[int] = ()) -> None:
        layer = keys[0] // self.experts
        used = np.asarray(keys, np.int64) - layer * self.experts
        age = self._age(layer, 1)
        self.age_offers += self.weight * np.bincount(age, minlength=self.ages)
        self.age_uses += self.weight * np.bincount(age[used], minlength=self.ages)
        self.calls[layer] += 1
        self.last[layer, used] = self.calls[layer]
        self.count[layer, used] += self.weight
        self.state[keys] = 2
        self.position = (layer + 1) % self.layers

    def use_chances(self) -> np.ndarray:
        ahead = np.ones(self.layers, np.int64)
        ahead[self.position] = 2  # its keys outside the current call wait for the next one
        age = self._age(slice(None), ahead)
        rate = self.count * (self.per_token / self.weight)
        by_age = self.age_uses / self.age_offers
        return self.freq_share * rate + (1.0 - self.freq_share) * by_age[age]

    def tick(self, tokens: int) -> None:
        """Advance the clock: a use weighs twice as much after each half-life."""
        self.tokens += tokens
        halvings = self.tokens / self.half_life - self.rescaled
        if halvings > 64:  # rescale long before the weight overflows; the order is unchanged
            for array in (self.count, self.age_uses, self.age_offers):
                array *= 0.5**halvings
            if not self.age_offers.min() > 0:  # a tick of over a thousand half-lives
                self.age_uses[:], self.age_offers[:] = 1.0, 2.0
            self.rescaled += halvings
            halvings = 0.0
        self.weight = 2.0**halvings

    def seed(self, counts: dict[int, float]) -> None:
        add_counts(self.count.reshape(-1)[: self.num_keys], counts, self.weight)
