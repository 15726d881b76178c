"""Reading ahead: each next layer's experts, predicted while the current layer computes.

Backend neutral: this module says when a layer call should predict the next layer's experts
(`wanted`), and the backend computes that prediction, the next layer's router applied to the
current layer's input, in the same host sync as the call's own routed ids, so a prediction
costs no sync of its own; the runtime supplies reads. This module decides when a prediction
pays, keeps the reads in flight and scores them.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import TYPE_CHECKING

import numpy as np

from .interrupts import CRITICAL
from .errors import StoreError

if TYPE_CHECKING:
    from .runtime import Runtime

# Prefetch reads ahead for a layer only while at least this share of its predicted misses (the
# predicted experts that were not resident: what a prefetch reads) turn out routed, once this
# many have been scored; the tally halves past 16x that, so it follows a changing workload. Only
# one-token calls predict: a prompt's misses are read while it computes (`route_chunks`), and
# its prediction, naming the experts of many tokens at once, would say little of a decode step's.
PREFETCH_MIN_USEFUL = 0.25
PREFETCH_WARMUP = 16
PREFETCH_PROBE = 8  # while it does not pay, a layer is predicted on one token in this many


def only_the_wait_failed(read: Future) -> bool:
    """Whether an error from `read.result()` cut the wait short (Ctrl-C) and not the read:
    it still runs, or it ended well just after. It is left for the next call to finish and
    count; forgotten, its bytes went uncounted and the expert was read again."""
    return not read.done() or not (read.cancelled() or read.exception() is not None)


class Prefetch:
    """Predictions of each layer's next call, the reads they started, and whether they pay."""

    def __init__(self, runtime: "Runtime"):
        self.runtime = runtime
        layers = runtime.plan.num_layers
        self.reads: list[tuple[int, int, Future]] = []  # (layer, expert, read) in flight
        self.predictions: dict[int, np.ndarray] = {}  # layer -> experts predicted for its next call
        self.predicted_misses: dict[int, set[int]] = {}  # of those, the ones not resident then
        self.prefetched: dict[int, set[int]] = {}  # layer -> experts read ahead for its next call
        self.reading: set[int] = set()  # keys the pending computation of the latest call reads
        self.gate_predicted = np.zeros(layers)  # tally of predicted misses per layer,
        self.gate_routed = np.zeros(layers)  # and of those then routed

    def wanted(self, layer: int) -> bool:
        """Whether this call of `layer` should predict the next layer's experts: not past the
        last layer, nor when the next one holds all its experts, and while reading ahead does
        not pay there, only now and then, to see if it does."""
        runtime, nxt = self.runtime, layer + 1
        return (nxt < runtime.plan.num_layers and not runtime.layer_cache[nxt].holds_layer(nxt)
                and (self.pays(nxt) or runtime.stats.tokens % PREFETCH_PROBE == 0))

    def after(self, layer: int, predicted: np.ndarray) -> None:
        """Start reading the next layer's `predicted` experts (distinct ids) that are not
        resident; the experts of this call, which it has yet to compute, stay."""
        runtime, nxt = self.runtime, layer + 1
        cache = runtime.layer_cache[nxt]
        self.predictions[nxt] = predicted
        self.predicted_misses[nxt] = set(cache.missing(nxt, predicted).tolist())
        # this call's experts take room from the next layer's only in a pool they share
        shared = runtime.layer_cache[layer] is cache and not cache.per_layer
        room = cache.capacity(nxt) - (len(self.reading) if shared else 0)
        if len(predicted) > room or not self.pays(nxt):
            return
        with CRITICAL:
            loads, evicted = cache.prefetch(nxt, predicted, self.reading)
            runtime.evicted(evicted, nxt, loads)
            started: list[tuple[int, Future]] = []
            try:
                runtime.submit_reads(nxt, loads, started)
            finally:  # what started is waited for and counted, whatever stopped the rest
                self.prefetched[nxt] = {e for e, _ in started}
                self.reads += [(nxt, e, read) for e, read in started]

    def pays(self, layer: int) -> bool:
        """Whether reading `layer`'s predicted misses ahead is right often enough: a wrong read
        costs bandwidth and a slot. The tally counts predicted misses whether or not they were
        read, so a layer whose predictions improve gets its prefetch back."""
        predicted = self.gate_predicted[layer]
        return predicted < PREFETCH_WARMUP or self.gate_routed[layer] >= PREFETCH_MIN_USEFUL * predicted

    def wait(self, layer: int) -> None:
        """Finish the reads in flight before any slot may be reused, counting each once. A
        failed one is forgotten, so a real need reads it again (and reports a StoreError);
        an error of another kind is raised once. An interrupt while a read runs leaves it in
        flight, for the next call to finish."""
        runtime, stats, reads = self.runtime, self.runtime.stats, self.reads
        start = time.perf_counter()
        try:
            while reads:
                owner, expert, read = reads[0]
                try:
                    result = read.result()
                except BaseException as e:
                    if only_the_wait_failed(read):
                        raise
                    runtime.forget(owner, expert)  # then off the list: forgetting twice is safe
                    reads.pop(0)
                    self.prefetched.get(owner, set()).discard(expert)
                    if not isinstance(e, StoreError):
                        raise
                    stats.read_errors += 1
                    continue
                reads.pop(0)
                runtime.count_read(owner, *result)
                stats.prefetch_loads[owner] += 1
        finally:
            stats.stall_seconds[layer] += time.perf_counter() - start

    def score(self, layer: int, experts: list[int]) -> None:
        """Count how the prediction for this call did, for the statistics and the gate of
        `pays`."""
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
        stats = self.runtime.stats
        stats.predicted[layer] += len(predicted)
        stats.routed_scored[layer] += len(routed)
        stats.predicted_routed[layer] += len(routed.intersection(predicted.tolist()))
        stats.prefetch_used[layer] += len(routed & self.prefetched.pop(layer, set()))
