"""Experts resident for good: ids map to slots on the device, and routing is counted late.

No host sync, so the graph stays lazy as in stock mlx-lm; each call's routed ids are counted
once they have been computed anyway (`DeferredRouting`).
"""

from __future__ import annotations

import threading

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..interrupts import CRITICAL
from ..runtime import Runtime
from .guards import PooledExperts


class ResidentExperts(PooledExperts):
    """Every expert resident for good: ids map to slots on the device, no host sync, as in
    stock mlx-lm. Routing is counted later (`DeferredRouting`)."""

    def __init__(self, inner: nn.Module, layer: int, slot_map: mx.array,
                 deferred: DeferredRouting):
        super().__init__(inner, deferred.runtime.plan.layers[layer].path)
        object.__setattr__(self, "layer", layer)
        object.__setattr__(self, "slot_map", slot_map)  # one entry past the experts: masked ids
        object.__setattr__(self, "deferred", deferred)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        changed = self.check_unconverted()
        self.deferred.add(self.layer, indices)
        valid = mx.minimum(indices.astype(mx.uint32), self.slot_map.size - 1)
        y = self.inner(x, self.slot_map[valid])
        return _untrained(y, self.expert_dtype) if changed else y


@mx.custom_function
def _untrained(y: mx.array, marker: mx.array) -> mx.array:
    """`y` as it is, giving the experts' marker a NaN gradient. Training the whole model would
    leave the experts, which are not its parameters, as they are (stock trains them): the step
    that applies the gradient turns the marker NaN, and the next call refuses. A marker that is
    frozen (LoRA) or not differentiated takes no gradient. Applied where the marker is new, as a
    gradient's inputs are, so that inference pays nothing."""
    return y


@_untrained.vjp
def _untrained_vjp(primals, cotangent, output):
    marker = primals[1]
    return cotangent, mx.full(marker.shape, mx.nan, marker.dtype)


class DeferredRouting:
    """The routed ids of calls that did not sync, per thread (only the thread that built them
    can evaluate them: mlx streams are per thread, or any once it has ended), counted through
    the runtime two forward calls late or whenever statistics are read. A forward call is a
    run of calls in layer order: one cut short (an exception, Ctrl-C) ends where it stopped."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self.forwards: dict[threading.Thread, list[list[tuple[int, mx.array]]]] = {}
        self.untraced: set[int] = set()  # (the ids of) forward calls begun before a trace

    def begin_trace(self) -> None:
        """A trace starts: the forward calls begun so far, still to count, are not its."""
        with self.runtime.lock:
            self.untraced = {id(calls) for forwards in self.forwards.values()
                             for calls in forwards}

    def add(self, layer: int, indices: mx.array) -> None:
        forwards = self.forwards.setdefault(threading.current_thread(), [])
        if forwards and layer > forwards[-1][-1][0]:
            forwards[-1].append((layer, indices))
        else:  # a forward call begins
            forwards.append([(layer, indices)])
            if len(forwards) > 2:  # a third: count the first
                self.count(keep=2)

    def count(self, keep: int = 0) -> None:
        """Route this thread's deferred calls (all but its last `keep` forward calls) and those
        of threads that have ended, in call order. Ids that cannot be computed are routing
        that never was, and go uncounted: a thread that ended before its last layer's ids were
        needed (a prefill evaluating only the KV cache, as stock skips that layer), or a trace
        of `mx.compile`."""
        runtime, me = self.runtime, threading.current_thread()
        with runtime.lock, CRITICAL:  # the calls taken off the lists are counted, every one
            threads = list(self.forwards)  # one step: other threads may add theirs meanwhile
            for thread in [t for t in threads if t is me or not t.is_alive()]:
                forwards = self.forwards.pop(thread)
                cut = max(len(forwards) - keep, 0) if thread is me else len(forwards)
                if cut < len(forwards):
                    self.forwards[thread] = forwards[cut:]
                for calls in forwards[:cut]:
                    traced = id(calls) not in self.untraced
                    self.untraced.discard(id(calls))
                    for layer, indices in calls:
                        try:
                            ids = np.array(indices)
                        except (ValueError, RuntimeError):  # never computed: uncounted
                            continue
                        runtime.route(layer, ids, compute=False, record=traced)
