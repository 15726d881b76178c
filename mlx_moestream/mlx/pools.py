"""Slot pools in MLX memory, and the backend that keeps a slot from being overwritten in use.

Slots are filled by reading from the files straight into the pool's memory, so no computation
that reads a slot may still be pending when a later call overwrites it (`MLXBackend.settle`).
Prefetch reads run while the output computes and never touch its slots.
"""

from __future__ import annotations

import math
import mmap
from contextlib import nullcontext

import mlx.core as mx
import numpy as np

from ..backend import Backend, SlotPool
from ..plan import ExpertLayer
from .hosts import Watchdog
from .resident import DeferredRouting


class MLXSlotPool(SlotPool):
    """A slot pool in MLX arrays (`arrays`, what the expert modules compute from), written
    through numpy views of the same memory."""

    def __init__(self, like: ExpertLayer, num_slots: int):
        self.arrays: dict[str, mx.array] = {}
        views = {}
        for name, (shape, dtype_name, _) in like.specs.items():
            array = _page_aligned_zeros((num_slots, *shape), getattr(mx, dtype_name))
            raw = array.view(mx.uint16) if array.dtype == mx.bfloat16 else array
            mx.eval(array, raw)
            self.arrays[name] = array
            views[name] = np.array(raw, copy=False)  # writes land in `array`'s memory
        super().__init__(views)


def _page_aligned_zeros(shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    """Zeros whose data starts on a page boundary (a view into a slightly larger buffer), so
    direct I/O can read experts straight into their slots."""
    size, itemsize = math.prod(shape), dtype.size
    pad = mmap.PAGESIZE // itemsize
    buffer = mx.zeros((size + pad,), dtype)
    mx.eval(buffer)
    raw = buffer.view(mx.uint16) if dtype == mx.bfloat16 else buffer
    skip = (-np.array(raw, copy=False).ctypes.data % mmap.PAGESIZE) // itemsize
    return buffer[skip : skip + size].reshape(shape)


class MLXBackend(Backend):
    """MLX's side of a streamed model: pools in unified memory, the latest call's output in
    flight, and the routing of calls with every expert resident, counted late.

    The latest output is scheduled but perhaps not computed yet: it reads slots, so nothing may
    be read into a slot until it is done (`settle`, which every call makes before `issue`).
    `watchdog` wraps a wait on the other hosts: it ends the process when they stop answering.
    """

    def __init__(self, timeout_seconds: float | None = None):
        self.output: mx.array | None = None
        self.deferred: DeferredRouting | None = None  # set by `attach` when every expert fits
        self.watchdog = nullcontext() if timeout_seconds is None else Watchdog(timeout_seconds)

    def new_pool(self, like: ExpertLayer, num_slots: int) -> MLXSlotPool:
        return MLXSlotPool(like, num_slots)

    def issue(self, y: mx.array) -> None:
        mx.async_eval(y)
        self.output = y

    def settle(self) -> None:
        if self.output is not None:
            mx.eval(self.output)
            self.output = None

    def count_deferred(self) -> None:
        if self.deferred is not None:
            self.deferred.count()

    def begin_trace(self) -> None:
        if self.deferred is not None:
            self.deferred.begin_trace()
