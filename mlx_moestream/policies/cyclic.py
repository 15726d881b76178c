"""The default policy, `cyclic`, over its compiled core (`_cyclic.pyx`, beside this file).

The only module that imports the compiled part, so that the other policies work without a build.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from .base import Policy, add_counts, check_blend, decay_per_token

try:
    import mlx_moestream.policies._cyclic as _cyclic
except ModuleNotFoundError:  # a checkout used as it is
    raise ImportError("mlx_moestream's compiled part (_cyclic.pyx) is not built: run "
                      "`pip install -e .` in the checkout") from None


def _check_build() -> None:
    """Refuse a compiled part built from other source than the one beside this file.

    After a pull that changed the source, or with another checkout's build found through a
    shared environment, it would run other code than the source reads. A wheel has no source.
    """
    source = Path(__file__).with_name("_cyclic.pyx")
    if (source.exists()
            and hashlib.sha256(source.read_bytes()).hexdigest() != _cyclic.SOURCE_DIGEST):
        raise ImportError(f"{source} is not the source of mlx_moestream's compiled part "
                          f"({_cyclic.__file__}): run `pip install -e .` in this checkout")


_check_build()


class LayerCyclic(_cyclic.CyclicCore, Policy, name="cyclic"):
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

    def seed(self, counts: dict[int, float]) -> None:
        add_counts(self.count, counts, self.weight)
        self._rescale(1.0)
