"""Experts streamed into slots: the routed ids are remapped to slots before the module runs.

The wrapped module keeps its own code (activation, biases, quantization, sorting). Every call
schedules its output (`mx.async_eval`) before it returns, and the next call waits for it before
it decides anything: that wait is normally free, as the next call's routed ids depend on it (the
residual stream does), so a layer costs one host sync and the output computes while Python
builds the next layer's graph. Only scheduled work is waited for, which works from any thread
(an unscheduled graph can be evaluated only by the thread that built it).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..runtime import Runtime
from .guards import PooledExperts

SORTED_IDS = 64  # SwitchGLU and SwitchMLP sort a call of this many ids or more (`do_sort`)


class StreamingExperts(PooledExperts):
    """Drop-in replacement for a SwitchGLU / SwitchMLP whose experts are streamed."""

    def __init__(self, inner: nn.Module, layer: int, runtime: Runtime):
        super().__init__(inner, runtime.plan.layers[layer].path)
        object.__setattr__(self, "layer", layer)
        object.__setattr__(self, "runtime", runtime)
        # the next layer's routing logits and the width of the input they take, to predict with
        object.__setattr__(self, "next_router", None)

    computes_parts = True

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        self.check_unconverted()
        self.start_routing(indices)
        return self.runtime.call(self, x, indices)

    def predicts(self, x: mx.array, indices: mx.array) -> bool:
        """One-token calls predict, where the next layer's router takes this input (a latent
        MoE's experts take less)."""
        return (indices.size == indices.shape[-1] and self.next_router is not None
                and x.shape[-1] == self.next_router[1])

    def routed(self, predict: bool, x: mx.array, indices: mx.array
               ) -> tuple[np.ndarray, np.ndarray | None]:
        """The routed ids and the prediction, in one host sync."""
        predicted = None
        if predict:
            k = self.runtime.plan.top_k
            picks = mx.argpartition(-self.next_router[0](x), kth=k - 1, axis=-1)[..., :k]
            mx.eval(indices, picks)
            predicted = np.unique(np.array(picks))
        ids = np.array(indices)
        self.runtime.count_sync()
        return ids, predicted

    def compute(self, ids: np.ndarray, slots: np.ndarray, x: mx.array, indices: mx.array
                ) -> mx.array:
        return self.inner(x, slot_ids(slots))

    def compute_rounds(self, ids: np.ndarray, rounds, x: mx.array, indices: mx.array
                       ) -> mx.array:
        outs = []
        for pos, slots in rounds:
            outs.append((pos, self._rows(x, ids, pos, slots)))
            mx.eval(outs[-1][1])  # the next round may overwrite these slots
            self.runtime.count_sync()
        return _gathered(outs, ids.shape)

    def compute_chunks(self, ids: np.ndarray, chunks, x: mx.array, indices: mx.array
                       ) -> mx.array:
        outs = []
        for pos, slots in chunks:
            if pos is None:  # the whole call at once
                return self.inner(x, slot_ids(slots))
            outs.append((pos, self._rows(x, ids, pos, slots)))
            mx.async_eval(outs[-1][1])
        return _gathered(outs, ids.shape)

    def issued(self, y: mx.array) -> None:
        self.runtime.backend.issue(y)

    def _rows(self, x: mx.array, ids: np.ndarray, pos: np.ndarray, slots: np.ndarray) -> mx.array:
        """The outputs of the flat (token, k) positions `pos`, whose experts are in `slots`.
        mlx-lm sorts a call of `SORTED_IDS` ids or more by expert, and on Metal a sorted call
        runs another kernel (`gather_mm_rhs`, not `gather_mv`): a smaller part of such a call
        is padded with copies of its first row to be sorted too, so that it computes as the
        whole call does in stock."""
        rows, n = pos // ids.shape[-1], len(pos)
        if ids.size >= SORTED_IDS > n:
            rows = np.concatenate([rows, np.repeat(rows[:1], SORTED_IDS - n)])
            slots = np.concatenate([slots, np.repeat(slots[:1], SORTED_IDS - n)])
        x_rows = x.reshape(-1, x.shape[-1])[mx.array(rows)]
        return self.inner(x_rows, slot_ids(slots[:, None]))[:n, 0]


def slot_ids(slots: np.ndarray) -> mx.array:
    """Slots (all resident) as the experts module's ids: uint32, as stock's routed ids are
    (`gather_qmm` converts any other dtype: a node more per expert matmul in every call)."""
    return mx.array(slots, mx.uint32)


def _gathered(outs: list[tuple[np.ndarray, mx.array]], shape: tuple[int, ...]) -> mx.array:
    """One call's output [..., k, hidden] from the outputs of its parts: (flat positions, rows)."""
    order = np.concatenate([pos for pos, _ in outs])
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    y = mx.concatenate([y for _, y in outs])[mx.array(inverse)]
    return y.reshape(*shape, y.shape[-1])
