"""Where the experts' bytes live: rows by expert id, or slot pools in device memory.

On the CPU `ExpertRows` keeps every layer's `[E, ...]` rows over anonymous memory maps, at the
loaded model's alignment; on a GPU memory for every expert would not fit, so `DeviceSlots`
shares slot pools filled through pinned host buffers.
"""

from __future__ import annotations

import mmap
import queue
from contextlib import AbstractContextManager, contextmanager, nullcontext

import numpy as np
import torch

from ..backend import Backend, SlotPool
from ..plan import ExpertLayer
from ..runtime import Runtime
from ..store import ExpertStore
from .layout import _Experts, _expert_params, _row_offset


def _landing(rows: dict[str, np.ndarray], targets: dict[str, tuple[str, slice]]
             ) -> dict[str, np.ndarray]:
    """Per stored tensor, the byte view its read lands in: `rows` are byte views of a module's
    expert parameters (all experts' `[E, ...]` rows, or one expert's row), `targets` says which
    part of a row each stored tensor fills."""
    return {stored: rows[target][..., part, :] if part != slice(None) else rows[target]
            for stored, (target, part) in targets.items()}


def _bytes(tensor: torch.Tensor) -> np.ndarray:
    """A tensor's bytes as a numpy array shaped as the tensor (the last axis in bytes)."""
    return tensor.view(torch.uint8).numpy()


def _mapped(shape: torch.Size, dtype: torch.dtype, offset: int) -> tuple[torch.Tensor, mmap.mmap]:
    """A zero tensor over an anonymous map, starting `offset` bytes into its first page (CPU
    kernels round by alignment: it must be the loaded model's); pages are backed once written.
    Private: a shared anonymous map (mmap's default) lives in shmem, which keeps pages that
    MADV_DONTNEED hands back, so evicted experts would hold their memory for good. Without
    huge pages (Linux's transparent ones, on by default in some kernels): a read into one row
    would back the 2 MiB page around it, other experts' rows too, which no MADV_DONTNEED of
    an evicted row gives back."""
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    buffer = mmap.mmap(-1, offset + max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux
        buffer.madvise(mmap.MADV_NOHUGEPAGE)
    raw = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offset)
    return raw.view(dtype).view(shape), buffer


class ExpertRows(Backend):
    """The expert tensors of every layer, indexed by expert id: a read of (layer, expert) lands
    in that expert's row, wherever the cache put its slot; the cache's slots only count."""

    def __init__(self, layers: list[tuple[torch.nn.Module, _Experts, dict]], store: ExpertStore):
        """Give each module's expert parameters anonymous `[E, ...]` memory maps."""
        self.views, self.maps = [], []  # maps: (memory map, offset of row 0, bytes of a row)
        for module, experts, targets in layers:
            rows, maps = {}, []
            for name, param in _expert_params(module):
                offset = _row_offset(store, experts, name)
                tensor, buffer = _mapped(param.shape, param.dtype, offset)
                maps.append((buffer, offset, tensor.nbytes // param.shape[0]))
                setattr(module, name, torch.nn.Parameter(tensor))
                rows[name] = _bytes(tensor)
            self.views.append(_landing(rows, targets))
            self.maps.append(maps)

    def new_pool(self, like: ExpertLayer, num_slots: int) -> SlotPool:
        return _RowPool(self, like, num_slots)


class _RowPool(SlotPool):
    """The slots of one group of layers as the cache counts them; the bytes live in the
    layers' rows (`ExpertRows`), placed by expert id, and a slot costs `slot_bytes`."""

    releases = True

    def __init__(self, rows: ExpertRows, like: ExpertLayer, num_slots: int):
        self.rows, self.num_slots = rows, num_slots
        self.views = {}  # no slot memory of its own
        self._nbytes = num_slots * like.slot_bytes

    def landing(self, layer: int, expert: int, slot: int
                ) -> AbstractContextManager[dict[str, np.ndarray]]:
        """The expert's own rows, whatever its slot."""
        return nullcontext({name: view[expert] for name, view in self.rows.views[layer].items()})

    def layer_destination(self, layer: int, slots: list[int]) -> dict[str, np.ndarray] | None:
        """Every row of the layer, whatever the slots (they only count)."""
        views = self.rows.views[layer]
        return views if all(v.flags.c_contiguous for v in views.values()) else None

    def release(self, layer: int, expert: int, resident: np.ndarray) -> None:
        """Hand back the expert's pages: those inside its rows, and a page it shares with a
        neighbour once no expert on that page is `resident`."""
        page = mmap.PAGESIZE
        for buffer, offset, size in self.rows.maps[layer]:
            start = offset + expert * size
            first, last = start // page, (start + size - 1) // page

            def alone(p: int) -> bool:  # no resident expert has bytes on page p
                lo = max(0, (p * page - offset) // size)
                return not resident[lo : ((p + 1) * page - 1 - offset) // size + 1].any()

            first += not alone(first)
            last -= last >= first and not alone(last)
            if last >= first:
                end = min((last + 1) * page, len(buffer))
                buffer.madvise(mmap.MADV_DONTNEED, first * page, end - first * page)

    @property
    def nbytes(self) -> int:
        return self._nbytes


class DeviceSlots(Backend):
    """Slot pools in device memory, one per group of layers with one expert shape, each shared
    by the group's experts modules as their expert parameters (`attach`). A read lands in one
    of a few pinned host buffers (`STAGING`) and is copied to its slot on a side stream; a call
    computes once the copies issued so far are done (`ready`), and a copy starts once the
    computations queued before it are done, so it never overwrites a slot one of them reads."""

    # host buffers: one per read in flight (the runtime's 4 reader threads and the caller's
    # own), and a few more, so that a read rarely waits for an earlier copy to end
    STAGING = 8

    def __init__(self, layers: list[tuple[torch.nn.Module, _Experts, dict]],
                 device: torch.device):
        self.device = device
        self.layers = {e.path: (module, targets) for module, e, targets in layers}
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.free: queue.SimpleQueue = queue.SimpleQueue()
        largest = max(sum(p[0].nbytes for _, p in _expert_params(module))
                      for module, _, _ in layers)
        for _ in range(self.STAGING):
            staged = torch.empty(largest, dtype=torch.uint8, pin_memory=cuda)
            self.free.put((staged, torch.cuda.Event() if cuda else None))
        self.pending = False  # copies issued since the compute last waited for them
        self.compute = torch.cuda.current_stream(device) if cuda else None  # the calls' stream

    def new_pool(self, like: ExpertLayer, num_slots: int) -> SlotPool:
        module, targets = self.layers[like.path]
        return _DevicePool(self, module, targets, num_slots)

    def attach(self, runtime: Runtime) -> None:
        """Make each layer's pool its module's expert parameters, numbered by slot."""
        for i, layer in enumerate(runtime.plan.layers):
            module, _ = self.layers[layer.path]
            pool = runtime.residency.layer_pool[i]
            for name, param in pool.params.items():
                setattr(module, name, param)
            module.num_experts = pool.num_slots

    @contextmanager
    def landing(self, pool: "_DevicePool", slot: int):
        """A staging buffer's views to read one expert into; once read, it is copied to
        `slot` of `pool`. A buffer is written again only once its last copy is done."""
        staged, copied = self.free.get()
        try:
            if copied is not None:
                copied.synchronize()
            rows, start = {}, 0
            for name, (shape, dtype, nbytes) in pool.rows.items():
                rows[name] = staged[start : start + nbytes].view(dtype).view(shape)
                start += nbytes
            yield _landing({name: _bytes(row) for name, row in rows.items()}, pool.targets)
            if self.stream is None:  # on the CPU (tests): plain copies
                for name, row in rows.items():
                    pool.params[name].data[slot].copy_(row)
            else:
                with torch.cuda.stream(self.stream):
                    self.stream.wait_stream(self.compute)
                    try:
                        for name, row in rows.items():
                            pool.params[name].data[slot].copy_(row, non_blocking=True)
                    finally:  # a copy cut short still reads the buffer
                        copied.record(self.stream)
            self.pending = True  # after the copies were issued: a `ready` seeing it covers them
        finally:
            self.free.put((staged, copied))

    def ready(self) -> None:
        """The compute stream waits for the copies issued so far."""
        if self.stream is not None:
            current = torch.cuda.current_stream(self.device)
            if current != self.compute:  # calls moved streams: later copies wait for both
                current.wait_stream(self.compute)
                self.compute = current
        if self.pending:
            self.pending = False  # first: a copy issued meanwhile sets it again
            if self.stream is not None:
                self.compute.wait_stream(self.stream)


class _DevicePool(SlotPool):
    """One group's `[num_slots, ...]` expert parameters in device memory (see `DeviceSlots`)."""

    def __init__(self, slots: DeviceSlots, module: torch.nn.Module, targets: dict,
                 num_slots: int):
        self.slots, self.targets, self.num_slots = slots, targets, num_slots
        # per parameter, one expert's row: (shape, dtype, bytes)
        self.rows = {name: (param.shape[1:], param.dtype, param[0].nbytes)
                     for name, param in _expert_params(module)}
        self.params = {name: torch.nn.Parameter(torch.zeros((num_slots, *shape), dtype=dtype,
                                                            device=slots.device))
                       for name, (shape, dtype, _) in self.rows.items()}
        self.views = {}  # no host views: reads land in staging buffers
        self._nbytes = sum(p.nbytes for p in self.params.values())

    def landing(self, layer: int, expert: int, slot: int):
        return self.slots.landing(self, slot)

    def layer_destination(self, layer: int, slots: list[int]) -> None:
        return None  # every read goes through a staging buffer

    @property
    def nbytes(self) -> int:
        return self._nbytes
