"""The `cyclic` policy over its compiled core (`_core_cyclic.pxi`, beside this file)."""

from __future__ import annotations

from .base import Policy, check_blend, decay_per_token
from .compiled import core


class LayerCyclic(core.CyclicCore, Policy, name="cyclic"):
    """Evicts the expert that promises the fewest uses per slot held until its layer's next call.

    Every token calls the MoE layers in order, so an expert of layer j waits `d` layer calls for
    its next chance of a use (1 for the next layer, every layer for the one just called), a use
    it gets with probability `p`: the victim is the key of least `p / d`. `p` blends, with
    `freq_share` of the first, the key's use rate (counts halve every `half_life` tokens) and
    the rate, learned online, at which keys used at their layer's latest call, and the others,
    are used at its next. Prefetched keys that no call has used go first.
    """

    layered = True

    def __init__(self, capacity: int, num_keys: int, num_experts: int | None = None,
                 half_life: int = 32, freq_share: float = 0.5):
        check_blend(half_life, freq_share)
        per_token = decay_per_token(half_life)
        self.capacity = capacity
        group_weight = (1.0 - freq_share) / max(freq_share, 1e-9) / per_token
        super().__init__(num_keys, num_experts or num_keys, half_life, group_weight)
