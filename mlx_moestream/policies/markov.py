"""Markov cyclic (`markov`): `cyclic`'s rule with each layer's call-to-call transitions learned."""

from __future__ import annotations

import numpy as np

from .base import ScoredCyclic, add_counts, check_tokens

MAX_HALVINGS = 512  # counts are rescaled before a weight of 2**512 nears a float's limit


class LayerMarkov(ScoredCyclic, name="markov"):
    """Evicts the expert of least `p / d`, `p` predicted from what its layer's latest call used.

    As in `cyclic`, `d` is the number of layer calls until the key's layer is called again and
    `p` the chance that the key is used there. Here `p` is the mean, over the experts `a` of
    the layer's latest call, of how often a call using `a` was followed at that layer by one
    using the key: transition counts halving every `memory` tokens, each row smoothed by one
    call's worth of `cyclic`'s estimate (the mean of the key's use rate per call, halving every
    `half_life` tokens, and the rate at which keys in or out of a layer's latest call are used
    at its next, learned over all layers). It starts as that estimate, i.e. from recency and
    frequency, and follows the routing's own token-to-token structure as evidence comes.
    Prefetched keys that no call used go first.
    Pure numpy, for replay: a victim search reads every key.
    """

    def __init__(self, capacity: int, num_keys: int, num_experts: int | None = None,
                 half_life: int = 32, memory: int = 256):
        super().__init__(capacity, num_keys, num_experts)
        check_tokens(half_life)
        check_tokens(memory, "memory")
        self.half_life, self.memory = half_life, memory
        shape = (self.layers, self.experts)
        self.count = np.zeros(shape)  # decayed uses, times `weight`
        self.calls = np.zeros(self.layers)  # decayed calls, times `weight`
        self.moves = np.zeros(shape + (self.experts,))  # [layer, a, b]: b used the call after a
        self.starts = np.zeros(shape)  # [layer, a]: calls using a that another call followed
        # uses and chances of keys in and out of a layer's latest call, at its next (all layers)
        self.groups = np.array([1.0, 2.0, 1.0, 2.0])
        self.p = np.zeros(shape)  # chance of use at the layer's next call
        self.latest = [np.zeros(0, np.int64) for _ in range(self.layers)]
        self.tokens = 0
        self.halvings = np.zeros(2)  # applied to the counts and to the transitions
        self.weight = self.move_weight = 1.0

    def access(self, keys: list[int], new: list[int] = ()) -> None:
        layer = keys[0] // self.experts
        used = np.asarray(keys, np.int64) - layer * self.experts
        before = self.latest[layer]
        if len(before):
            self.moves[layer][np.ix_(before, used)] += self.move_weight
            self.starts[layer, before] += self.move_weight
            reused = int(np.isin(used, before).sum())
            self.groups += self.move_weight * np.array(
                [reused, len(before), len(used) - reused, self.experts - len(before)])
        self.count[layer, used] += self.weight
        self.calls[layer] += self.weight
        self.latest[layer] = used
        self.state[keys] = 2
        self.position = (layer + 1) % self.layers
        self._predict(layer)

    def _predict(self, layer: int) -> None:
        """The layer's `p`, from its latest call (the use rate when it has none)."""
        rate = np.minimum((self.count[layer] + 1.0 / self.experts * self.weight)
                          / (self.calls[layer] + self.weight), 1.0)
        rows = self.latest[layer]
        if not len(rows):
            self.p[layer] = rate
            return
        group = np.full(self.experts, self.groups[2] / self.groups[3])
        group[rows] = self.groups[0] / self.groups[1]
        prior = (rate + group) / 2
        w = self.move_weight
        self.p[layer] = ((self.moves[layer][rows] + w * prior)
                         / (self.starts[layer, rows, None] + w)).mean(axis=0)

    def use_chances(self) -> np.ndarray:
        return self.p

    def tick(self, tokens: int) -> None:
        """Advance the clock: a use weighs twice as much after each half-life."""
        self.tokens += tokens
        for i, (life, counts) in enumerate(((self.half_life, (self.count, self.calls)),
                                            (self.memory, (self.moves, self.starts, self.groups)))):
            halvings = self.tokens / life - self.halvings[i]
            if halvings > MAX_HALVINGS:  # the order is unchanged
                for array in counts:
                    array *= 0.5 ** halvings
                self.halvings[i] += halvings
                halvings = 0.0
            if i:
                self.move_weight = 2.0 ** halvings
            else:
                self.weight = 2.0 ** halvings

    def seed(self, counts: dict[int, float]) -> None:
        flat = self.count.reshape(-1)[: self.num_keys]
        add_counts(flat, counts, self.weight)
        for layer in range(self.layers):
            self._predict(layer)
