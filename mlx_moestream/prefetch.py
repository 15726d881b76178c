"""Reading ahead: each next layer's experts, predicted while the current layer computes.

The backend computes a prediction (the next layer's router applied to the current layer's
input) in the same host sync as the call's own routed ids, so a prediction costs no sync of
its own. This module says when a layer call should predict (`wanted`), whether reading the
prediction ahead pays (`worth_reading`), and scores it once the predicted layer is called;
the runtime makes the reads (`Runtime.read_ahead`). A trace has no router: `CoActivation`
predicts there from the previous layer's experts (`replay --prefetch`).
"""

from __future__ import annotations

import numpy as np

from .cache import ExpertCache
from .stats import Stats

# Prefetch reads ahead for a layer only while at least this share of its predicted misses (the
# predicted experts that were not resident: what a prefetch reads) turn out routed, once this
# many have been scored; the tally halves past 16x that, so it follows a changing workload. Only
# one-token calls predict: a prompt's misses are read while it computes (`route_chunks`), and
# its prediction, naming the experts of many tokens at once, would say little of a decode step's.
PREFETCH_MIN_USEFUL = 0.25
PREFETCH_WARMUP = 16
PREFETCH_PROBE = 8  # while it does not pay, a layer is predicted on one token in this many


class Prefetch:
    """Predictions of each layer's next call, the experts read ahead for it, and whether they
    pay."""

    def __init__(self, layer_cache: list[ExpertCache], stats: Stats):
        self.layer_cache = layer_cache
        self.stats = stats
        layers = len(layer_cache)
        self.predictions: dict[int, np.ndarray] = {}  # layer -> experts predicted for its next call
        self.predicted_misses: dict[int, set[int]] = {}  # of those, the ones not resident then
        self.ahead: dict[int, set[int]] = {}  # layer -> experts read ahead for its next call
        self.reading: set[int] = set()  # keys the pending computation of the latest call reads
        self.gate_predicted = np.zeros(layers)  # tally of predicted misses per layer,
        self.gate_routed = np.zeros(layers)  # and of those then routed

    def wanted(self, layer: int) -> bool:
        """Whether this call of `layer` should predict the next layer's experts: not past the
        last layer, nor when the next one holds all its experts, and while reading ahead does
        not pay there, only now and then, to see if it does."""
        nxt = layer + 1
        return (nxt < len(self.layer_cache) and not self.layer_cache[nxt].holds_layer(nxt)
                and (self.pays(nxt) or self.stats.tokens % PREFETCH_PROBE == 0))

    def worth_reading(self, layer: int, predicted: np.ndarray) -> bool:
        """Record the next layer's `predicted` experts (distinct ids); whether to read them
        ahead: it pays there, and they fit beside the experts of this call, yet to compute."""
        nxt = layer + 1
        cache = self.layer_cache[nxt]
        self.predictions[nxt] = predicted
        self.predicted_misses[nxt] = set(cache.missing(nxt, predicted).tolist())
        # this call's experts take room from the next layer's only in a pool they share
        shared = self.layer_cache[layer] is cache and not cache.per_layer
        room = cache.capacity(nxt) - (len(self.reading) if shared else 0)
        return len(predicted) <= room and self.pays(nxt)

    def pays(self, layer: int) -> bool:
        """Whether reading `layer`'s predicted misses ahead is right often enough: a wrong read
        costs bandwidth and a slot. The tally counts predicted misses whether or not they were
        read, so a layer whose predictions improve gets its prefetch back."""
        predicted = self.gate_predicted[layer]
        return predicted < PREFETCH_WARMUP or self.gate_routed[layer] >= PREFETCH_MIN_USEFUL * predicted

    def score(self, layer: int, experts: list[int]) -> None:
        """Count how the prediction for this call did, for the statistics and `pays`."""
        predicted = self.predictions.pop(layer, None)
        if predicted is None:
            return
        routed = set(experts)
        misses = self.predicted_misses.pop(layer, set())  # unset if Ctrl-C fell in between
        self.gate_predicted[layer] += len(misses)
        self.gate_routed[layer] += len(misses & routed)
        if self.gate_predicted[layer] > 16 * PREFETCH_WARMUP:
            self.gate_predicted[layer] /= 2
            self.gate_routed[layer] /= 2
        stats = self.stats
        stats.predicted[layer] += len(predicted)
        stats.routed_scored[layer] += len(routed)
        stats.predicted_routed[layer] += len(routed.intersection(predicted.tolist()))
        stats.prefetch_used[layer] += len(routed & self.ahead.pop(layer, set()))


class CoActivation:
    """Predicts a layer's experts from the previous layer's, where no router can: by decayed
    counts of how often, within one token, expert a at layer l came with expert b at l + 1.

    Learned online from the routing seen so far (`learn`); an observation `half_life_tokens`
    tokens old counts half. Deterministic: ties go to the lower expert id.
    """

    def __init__(self, layers: int, num_experts: int, half_life_tokens: int = 256):
        self.counts = np.zeros((max(layers - 1, 0), num_experts, num_experts))  # [l, a, b]
        # a new observation weighs this much: growing, not decaying every count, each token
        self.weight = 1.0
        self.growth = 2.0 ** (1.0 / half_life_tokens)

    def tick(self, tokens: int = 1) -> None:
        """`tokens` new tokens: what was learned before weighs less."""
        self.weight *= self.growth**tokens
        if self.weight > 2.0**64:  # rescale everything before the floats overflow
            self.counts /= self.weight
            self.weight = 1.0

    def learn(self, layer: int, experts: list[int], following: list[int]) -> None:
        """One token routed to `experts` at `layer` and to `following` at `layer + 1`."""
        self.counts[layer][np.ix_(experts, following)] += self.weight

    def predict(self, layer: int, experts: list[int], n: int) -> np.ndarray:
        """At most `n` experts of `layer + 1` for a token routed to `experts` at `layer`: the
        highest summed counts, none never seen with them."""
        scores = self.counts[layer][experts].sum(axis=0)
        top = np.argsort(-scores, kind="stable")[:n]
        return top[scores[top] > 0]
