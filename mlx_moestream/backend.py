"""What a backend (MLX, torch) hands the runtime: slot pools and the operations of a layer call.

The runtime owns routing, caching and reads; a backend owns memory and compute. `Backend` is
the whole-model part (pools, waits, counts the backend holds back), `StreamedLayer` the part of
one expert layer that `Runtime.call` drives: route -> ensure resident -> compute.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Iterator, Protocol

import numpy as np

from .plan import ExpertLayer

Parts = Iterator[tuple[np.ndarray | None, np.ndarray]]  # (flat positions, their slots)


class SlotPool:
    """[num_slots, ...] buffers, one per expert tensor, shared by the layers of one expert shape.
    `views` are host (numpy) views of the memory the backend computes from: reads land there.

    A backend whose compute indexes experts by id (torch on the CPU) places an expert by
    (layer, expert) instead of by slot: it overrides `landing`, `layer_destination` and
    `release`; one whose slots are in device memory overrides `landing`."""

    def __init__(self, views: dict[str, np.ndarray]):
        self.views = views
        self.num_slots = len(next(iter(views.values())))

    def slot(self, slot: int) -> dict[str, np.ndarray]:
        return {name: view[slot] for name, view in self.views.items()}

    def landing(self, layer: int, expert: int, slot: int
                ) -> AbstractContextManager[dict[str, np.ndarray]]:
        """Where a read of `expert` of `layer` into `slot` lands, per tensor name, for the
        duration of the read: a pool whose slots the host cannot write (device memory) lends
        a host buffer instead and moves it to the slot once read."""
        return nullcontext(self.slot(slot))

    def layer_destination(self, layer: int, slots: list[int]) -> dict[str, np.ndarray] | None:
        """Where a read of every expert of `layer` (expert e into `slots[e]`) lands as one
        [experts, ...] block per tensor; None when the slots are not one run in order."""
        first = slots[0]
        if slots != list(range(first, first + len(slots))):
            return None
        return {name: view[first : first + len(slots)] for name, view in self.views.items()}

    releases = False  # whether `release` does anything (then the runtime calls it)

    def release(self, layer: int, expert: int, resident: np.ndarray) -> None:
        """`expert` of `layer` left (evicted, or its read failed): its memory may go back.
        `resident` says which of the layer's experts hold a slot now."""

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.views.values())


class Backend:
    """A framework's side of a streamed model. Subclasses make its slot pools; the waits and
    counts default to nothing."""

    def new_pool(self, like: ExpertLayer, num_slots: int) -> SlotPool:
        """A pool of `num_slots` experts for the layers shaped like `like`."""
        raise NotImplementedError

    def settle(self) -> None:
        """Wait until no computation issued may still read a slot: a read may overwrite it."""

    def count_deferred(self) -> None:
        """Count the routing of calls that did not wait for their ids (every expert resident)."""

    def begin_trace(self) -> None:
        """A trace starts: the routing held back so far is not its."""


class StreamedLayer(Protocol):
    """One streamed expert layer of a backend; `inputs` are its call's arguments, as given."""

    layer: int
    computes_parts: bool  # a call of many tokens computes in parts as its experts are read

    def predicts(self, *inputs: Any) -> bool:
        """Whether this call can predict the next layer's experts (one token, a router)."""

    def routed(self, predict: bool, *inputs: Any) -> tuple[np.ndarray, np.ndarray | None]:
        """The call's routed ids [..., k] on the host, and the next layer's predicted distinct
        experts when `predict`, in one host sync where the backend can."""

    def compute(self, ids: np.ndarray, slots: np.ndarray, *inputs: Any) -> Any:
        """The call's output, its experts resident in `slots` (shaped as `ids`)."""

    def compute_chunks(self, ids: np.ndarray, chunks: Parts, *inputs: Any) -> Any:
        """The call's output, computing each chunk while the next is read (called only where
        `computes_parts`)."""

    def compute_rounds(self, ids: np.ndarray, rounds: Parts, *inputs: Any) -> Any:
        """The call's output when its experts do not fit at once: each round is computed before
        the next is asked for, which may reuse its slots."""

    def issued(self, output: Any) -> None:
        """The output is scheduled: the backend's `settle` waits for it."""
