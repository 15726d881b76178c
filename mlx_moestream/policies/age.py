"""The `age` policy over its compiled core (`_core_age.pxi`, beside this file)."""

from __future__ import annotations

import math

from .base import Policy, check_blend, decay_per_token
from .compiled import core


class LayerAge(core.AgeCore, Policy, name="age"):
    """Evicts the expert of least `p / d`, `p` learned from how many calls ago it was used.

    As in `cyclic`, `d` is the number of layer calls until the key's layer is called again and
    `p` blends, with `freq_share` of the first, the key's use rate (counts halving every
    `half_life` tokens) and a rate learned online. Here that rate is per age: how often keys
    whose latest use was 1, 2-3, 4-7, ... calls of their layer ago (or never) are used at its
    next call, as learned until the current token. `cyclic`'s two groups are its first age and
    the rest merged; finer ages keep an expert that comes back a few calls later. The oldest
    age starts at the largest power of two up to four half-lives (in calls), past which the
    counts hold little; pre-warmed keys rank as never used, on their seeded counts. Ranking by
    a use chance learned per age is LHD's (Beckmann et al., NSDI 2018). Prefetched keys that
    no call used go first, least key first.
    """

    layered = True

    def __init__(self, capacity: int, num_keys: int, num_experts: int | None = None,
                 half_life: int = 32, freq_share: float = 0.5):
        check_blend(half_life, freq_share)
        self.capacity = capacity
        # 1, 2-3, ..., then all from 4 half-lives (ages of more calls ago), then never used
        ages = int(math.log2(4 * half_life)) + 2
        super().__init__(num_keys, num_experts or num_keys, half_life, freq_share,
                         decay_per_token(half_life), ages)
