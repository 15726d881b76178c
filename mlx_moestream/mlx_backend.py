"""The MLX backend: mlx-lm models whose expert modules compute from slot pools.

Each SwitchGLU / SwitchMLP of an mlx-lm model is wrapped by `StreamingExperts`. The wrapped
module keeps its own code (activation, biases, quantization, sorting) but its expert tensors
are replaced by a pool of slots shared by every MoE layer with the same expert shapes; the
routed expert ids are remapped to slot ids before the original module runs.

Slots are filled by reading from the files straight into the pool's memory, so no computation
that reads a slot may still be pending when a later call overwrites it: every call schedules its
expert output (`mx.async_eval`) before it returns, and the next call waits for it before it
decides anything (`MLXBackend.settle`). That wait is normally free, as the next call's read of its routed
ids has computed the output already (the residual stream depends on it), so a layer costs one
host sync, not two; and the output computes while Python builds the next layer's graph. Only
scheduled work is waited for, which works from any thread (an unscheduled graph can be evaluated
only by the thread that built it). When the budget gives every expert a slot of its own, no slot
is ever overwritten: `ResidentExperts` maps ids to slots on the device and the graph stays lazy
as in stock mlx-lm. Prefetch reads run while the output computes and never touch its slots.
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import sys
import threading
import time
from contextlib import nullcontext

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

from .errors import ModelError, NotCopyableError, StoreError
from .interrupts import CRITICAL
from .plan import ExpertLayer, ModelPlan, config_hash, path_key, top_k_of
from .backend import Backend, SlotPool
from .runtime import Runtime

EXPERT_MODULES = (SwitchGLU, SwitchMLP)
SORTED_IDS = 64  # SwitchGLU and SwitchMLP sort a call of this many ids or more (`do_sort`)


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of each SwitchGLU / SwitchMLP, in call order."""
    found = [(p, m) for p, m in model.named_modules() if isinstance(m, EXPERT_MODULES)]
    return sorted(found, key=lambda item: path_key(item[0]))


def plan_model(model: nn.Module, config: dict) -> ModelPlan:
    """Find the expert modules of an mlx-lm model and measure experts vs. dense weights."""
    model_type = config.get("model_type", "?")
    layers = []
    for path, module in expert_modules(model):
        proj = module.gate_proj if isinstance(module, SwitchGLU) else module.fc1
        num_experts = proj.num_experts
        specs = {
            n: (a.shape[1:], _dtype_name(a.dtype), a.nbytes // num_experts)
            for n, a in tree_flatten(module.parameters())
            if a.ndim and a.shape[0] == num_experts
        }
        layers.append(ExpertLayer(path, num_experts, specs))
    if not layers:
        raise ValueError(
            f"model_type '{model_type}' has no SwitchGLU/SwitchMLP expert layers: "
            "not a Mixture-of-Experts model"
        )
    total = sum(a.nbytes for _, a in tree_flatten(model.parameters()))
    dense = total - sum(l.expert_bytes * l.num_experts for l in layers)
    return ModelPlan(model_type, top_k_of(config), layers, dense, config_hash(config))


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]  # mlx.core.bfloat16 -> bfloat16


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


class PooledExperts(nn.Module):
    """What every module computing an expert module from slot pools shares. Its experts live in
    the pools, outside the model's parameters (plain attributes, not children), where conversions
    of the model after load (`set_dtype`, `nn.quantize`) cannot reach them, though stock
    mlx-lm would convert them with the rest. Rather than compute with experts stock would not
    have, a converted model is refused: `expert_dtype`, a parameter in the experts' floating
    dtype, is converted (or changed, by `model.apply`, `update`) exactly when they would be,
    and every call checks it. It holds the least value above 1 and the least normal one, which
    a conversion through a dtype of less precision or range changes even when it converts back
    (stock's experts would be rounded then). Quantizing experts that are not quantized yet is
    refused at once."""

    def __init__(self, inner: nn.Module, path: str):
        super().__init__()
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "path", path)
        floats = [a.dtype for _, a in tree_flatten(inner.parameters())
                  if mx.issubdtype(a.dtype, mx.floating)]
        dtype = floats[0] if floats else mx.uint8  # none: nothing a conversion converts
        info = mx.finfo(dtype) if floats else None
        self.expert_dtype = (mx.array([1 + info.eps, info.smallest_normal], dtype) if floats
                             else mx.ones((2,), dtype))
        object.__setattr__(self, "stored_dtype", dtype)
        object.__setattr__(self, "stored_marker", self.expert_dtype.tolist())
        object.__setattr__(self, "checked", self.expert_dtype)  # the marker found unchanged

    def __reduce__(self):
        """Pickling the model reaches its experts modules before the runtime: they refuse as
        it does (their experts are in its slot pools)."""
        raise NotCopyableError()

    def start_routing(self, indices: mx.array) -> None:
        """Start computing a call's routed ids, which its host sync then waits for. MLX refuses
        to inside a function transformation (`mx.compile`, `mx.grad`, `mx.vmap`), where a
        streamed call cannot be right: later calls overwrite the slots its experts are read
        into, under the gradient that reads them again and the compiled graph that replays
        them."""
        try:
            mx.async_eval(indices)
        except ValueError:
            raise ModelError(
                f"{self.path}: a model streaming its experts cannot run under mx.compile, "
                f"mx.grad, mx.vmap or another function transformation (later calls overwrite "
                f"the slots its experts are read into); to compile or differentiate it, load it "
                f"with a budget that holds every expert") from None

    def check_unconverted(self) -> bool:
        """Refuse a converted model; whether the marker is new since the last check (changed
        by `update`, or a gradient's input: see `ResidentExperts`)."""
        marker = self.expert_dtype
        if marker is self.checked:
            return False
        if marker.dtype != self.stored_dtype:
            converted = _dtype_name(marker.dtype)
            raise ModelError(
                f"{self.path}: the model was converted to {converted} after load (set_dtype), "
                f"which its experts cannot follow: they are read into the runtime's slots as "
                f"stored ({_dtype_name(self.stored_dtype)}); convert the checkpoint instead "
                f"(mlx_lm.convert --dtype {converted}) and load that")
        try:
            values = marker.tolist()
        except ValueError:  # an input of `mx.compile` (as mlx-lm's trainer compiles its step):
            return True  # only its dtype is known now; the next call outside checks the values
        if any(math.isnan(v) for v in values):
            raise ModelError(
                f"{self.path}: an optimizer step reached the experts (training the whole model), "
                f"which are not the model's parameters and cannot be trained: they are read "
                f"into the runtime's slots as stored; freeze them (model.freeze(), then "
                f"unfreeze what you train, as LoRA does) or train a model loaded by mlx_lm.load")
        if values != self.stored_marker:
            raise ModelError(
                f"{self.path}: the model's weights were changed after load (model.apply, "
                f"update, or set_dtype there and back), which cannot reach its experts: they "
                f"are read into the runtime's slots as stored; change the checkpoint instead "
                f"and load that")
        object.__setattr__(self, "checked", marker)
        return True

    def to_lora(self, **kwargs) -> nn.Module:
        """`linear_to_lora_layers` without keys: stock would put LoRA on the experts."""
        raise ModelError(f"{self.path}: LoRA cannot reach the experts (linear_to_lora_layers "
                         "takes them when given no keys), which are read into the runtime's "
                         "slots as stored; give keys that leave them out (attention, the "
                         "router), or train a model loaded by mlx_lm.load")

    @property
    def weight(self) -> mx.array:
        """What a predicate of `nn.quantize` or `mlx_lm.utils.quantize_model` reads of the
        layers it converts: stock's experts have one."""
        raise ModelError(f"{self.path}: the experts' weights are not the model's parameters "
                         "(they are read into the runtime's slots as stored), so a conversion "
                         "cannot reach them; convert the checkpoint instead (mlx_lm.convert) "
                         "and load that")

    def to_quantized(self, **kwargs) -> nn.Module:
        """`nn.quantize` of the model: stock would quantize the experts unless they are."""
        if not any(hasattr(m, "to_quantized") for _, m in self.inner.named_modules()):
            return self
        raise ModelError(f"{self.path}: quantizing the model after load cannot reach its "
                         "experts, which are read into the runtime's slots as stored; quantize "
                         "the checkpoint instead (mlx_lm.convert -q) and load that")


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
        return self.inner(x, _slot_ids(slots))

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
                return self.inner(x, _slot_ids(slots))
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
        return self.inner(x_rows, _slot_ids(slots[:, None]))[:n, 0]


def _slot_ids(slots: np.ndarray) -> mx.array:
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


class ResidentExperts(PooledExperts):
    """Every expert resident for good: ids map to slots on the device, no host sync, as in
    stock mlx-lm. Routing is counted later (`DeferredRouting`)."""

    def __init__(self, inner: nn.Module, layer: int, slot_map: mx.array, deferred: "DeferredRouting"):
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


class HostExperts(nn.Module):
    """Expert parallelism: this host computes the positions routed to its own experts and
    zeros elsewhere, and an `all_sum` over the hosts gives every host every position's output,
    exactly the single host's (x + 0 is x). Selecting, not multiplying, keeps whatever a
    position of another host's expert computed here (from any slot) out of the sum.

    The first MoE layer also compares the hosts' inputs first (`checks_inputs`): hosts fed
    other tokens (a script that reads its prompt on each host, or seeds its sampling apart)
    would sum the outputs of other tokens' experts, and hosts fed other lengths would exchange
    outputs of other shapes: every host raises instead, at the same point, before any expert
    of that call is read. Hosts of different chips may compute the same tokens' hidden states
    a few roundings apart: each position is compared within `INPUT_TOLERANCE` of its norm."""

    def __init__(self, local: nn.Module, first: int, count: int, group, runtime: Runtime,
                 checks_inputs: bool = False):
        super().__init__()
        self.local = local  # StreamingExperts or ResidentExperts: a child, see `PooledExperts`
        object.__setattr__(self, "first", first)
        object.__setattr__(self, "count", count)
        object.__setattr__(self, "group", group)
        object.__setattr__(self, "runtime", runtime)
        object.__setattr__(self, "checks_inputs", checks_inputs)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        if self.checks_inputs:
            self._check_inputs(x)
        try:
            y, owned = self._own_part(x, indices)
        except StoreError as e:
            # A read error is this host's alone: raised here, it would skip the exchange the
            # others wait in, and pair each later one with another layer's (wrong outputs on
            # every host). It ends this host instead, and the others as a lost host does.
            end_host(f"host {self.runtime.host[0]}: {e} (the other hosts wait for its part of "
                     f"this layer: every host ends)")
        y = mx.where(owned[..., None], y, 0)
        y = mx.distributed.all_sum(y, group=self.group)
        with self.runtime.backend.watchdog:
            mx.eval(y)
        self.runtime.count_sync()
        return y

    def _check_inputs(self, x: mx.array) -> None:
        """Raise on every host where one was given other inputs than host 0: first the number
        of positions (the prints' shape), then each position's print."""
        positions = x.size // x.shape[-1]
        counts = self._gathered(mx.array([positions], mx.int32))[:, 0]
        apart = counts != counts[0]  # every host sees the same counts, and takes the same way
        if not apart.any():
            prints = self._gathered(_input_prints(x))  # [hosts, positions, 4 + norm]
            scale = np.maximum(prints[:, :, -1:], prints[:1, :, -1:]) * INPUT_TOLERANCE
            apart = (np.abs(prints[:, :, :-1] - prints[:1, :, :-1]) > scale).any(axis=(1, 2))
        if apart.any():
            raise ValueError(f"host {int(apart.argmax())} was given other input tokens than "
                             "host 0: every host must make the same calls with the same inputs "
                             "(and sample alike: do not seed hosts apart)")

    def _gathered(self, value: mx.array) -> np.ndarray:
        """Every host's `value` (of one shape on every host), in host order: each sums its
        own in its row, zeros elsewhere (x + 0 is x)."""
        host, hosts = self.runtime.host
        rows = mx.where(mx.arange(hosts).reshape(-1, *[1] * value.ndim) == host, value, 0)
        rows = mx.distributed.all_sum(rows, group=self.group)
        with self.runtime.backend.watchdog:
            mx.eval(rows)
        self.runtime.count_sync()
        return np.array(rows)

    def _own_part(self, x: mx.array, indices: mx.array) -> tuple[mx.array, mx.array]:
        """The outputs of the positions routed to this host's experts, and where those are."""
        if isinstance(self.local, StreamingExperts):  # it syncs for the ids anyway: once here
            self.local.start_routing(indices)
            ids = np.array(indices).astype(np.int32) - self.first
            owned = (ids >= 0) & (ids < self.count)
            ids[~owned] = -1  # another host's: masked, never read here
            if owned.any():
                y = self.local(x, mx.array(ids))
            else:  # none of this call is ours: its tokens count, and zeros of the output's
                runtime = self.runtime  # shape and dtype go out (the probe's graph is never
                runtime.count_sync()  # evaluated); the ids' read was a wait, as the local's is
                with runtime.lock:
                    runtime.route(self.local.layer, ids, compute=False)
                probe = self.local.inner(x, mx.zeros(indices.shape, mx.uint32))
                y = mx.zeros(probe.shape, probe.dtype)
            owned = mx.array(owned)
        else:
            ids = indices.astype(mx.int32) - self.first
            owned = (ids >= 0) & (ids < self.count)
            y = self.local(x, mx.where(owned, ids, -1))
        return y, owned


# how far two hosts' prints of one position may be apart, as a share of its hidden state's
# norm: roundings of bfloat16 (2**-8 of each element) move a print by about 0.004 of it, other
# tokens by about 1.4 of it (four prints: all four under 0.05 has a chance below 1e-6)
INPUT_TOLERANCE = 0.05


def _input_prints(x: mx.array) -> mx.array:
    """[positions, 5]: four projections of each position's hidden state on fixed random signs
    (one sign pattern on every host), and its norm."""
    rows = x.reshape(-1, x.shape[-1]).astype(mx.float32)
    norms = mx.sqrt(mx.sum(rows * rows, axis=-1, keepdims=True))
    return mx.concatenate([rows @ _signs(x.shape[-1]), norms], axis=-1)


@functools.cache
def _signs(width: int) -> mx.array:
    return mx.array(np.random.default_rng(0).choice([-1.0, 1.0], (width, 4)), mx.float32)


def end_host(message: str) -> None:
    """End this host's process at once with a one-line error: the other hosts, left waiting
    in an exchange, then end as on a lost host. (No cleanup runs: a thread may be blocked in
    the exchange, which nothing else can end.)"""
    print(f"Error: {message}", file=sys.stderr, flush=True)
    os._exit(1)


class Watchdog:
    """Ends the process with a clear error when a step that waits on the other hosts takes
    longer than `seconds`: a host that hangs or cannot be reached must not hang the others
    (one that exits closes its connections, and the ring backend raises at once)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.deadline: float | None = None
        threading.Thread(target=self._watch, daemon=True, name="moestream-watchdog").start()

    def __enter__(self) -> None:
        self.deadline = time.monotonic() + self.seconds

    def __exit__(self, *exc) -> None:
        self.deadline = None

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.seconds / 4))
            deadline = self.deadline
            if deadline is not None and time.monotonic() > deadline:
                end_host(f"no answer from the other hosts for {self.seconds:g} s: a host has "
                         "stopped or cannot be reached")


def attach(runtime: Runtime, model: nn.Module, prefetch: bool = False, progress=None,
           group=None) -> None:
    """Swap every expert module of `model` for one that computes from the runtime's slot pools
    (its lazy experts drop out of the model). When every expert has a slot, read them all now,
    as stock mlx-lm reads its weights, and compute without host syncs (`ResidentExperts`);
    else stream (`StreamingExperts`), predicting each next layer's experts with that layer's
    router when `prefetch`. `progress(items, label)` may wrap the reads. With a distributed
    `group`, the runtime serves this host's experts (`ModelPlan.host_share`) and each module is
    wrapped in `HostExperts`, whose exchanges the backend's watchdog times."""
    found = [(layer.path, _get_path(model, layer.path)) for layer in runtime.plan.layers]
    for i, (path, module) in enumerate(found):
        for name, array in runtime.layer_pool[i].arrays.items():
            _set_path(module, name, array)
    if runtime.holds_all:
        runtime.read_all(progress)
        deferred = runtime.backend.deferred = DeferredRouting(runtime)
    streamed = []
    for i, (path, module) in enumerate(found):
        parent_path, attr = path.rsplit(".", 1)
        parent = _get_path(model, parent_path)
        if runtime.holds_all:
            row = runtime.slot_map(i)
            slot_map = _slot_ids(np.append(row, row[0]))  # masked ids: expert 0's slot
            experts = ResidentExperts(module, i, slot_map, deferred)
        else:
            experts = StreamingExperts(module, i, runtime)
            streamed.append((experts, _router(parent, runtime.plan.layers[i].num_experts)))
        if group is not None:
            layer = runtime.plan.layers[i]
            experts = HostExperts(experts, layer.first_expert, layer.num_experts, group, runtime,
                                  checks_inputs=i == 0)
        setattr(parent, attr, experts)
    model.moestream = runtime
    if prefetch:
        for (experts, _), (_, router) in zip(streamed, streamed[1:]):
            object.__setattr__(experts, "next_router", router)  # None where none was found


def _router(block: nn.Module, num_experts: int):
    """The routing logits of a MoE block (its Linear with one output per expert: a child, or a
    child's, as Hunyuan's `gate.wg`) and the width of the input it takes, or None."""
    children = list(block.children().values())
    grandchildren = [c for child in children if isinstance(child, nn.Module)
                     for c in child.children().values()]
    for child in children + grandchildren:
        if isinstance(child, (nn.Linear, nn.QuantizedLinear)):
            out, width = child.weight.shape
            if out == num_experts:
                return child, width * 32 // getattr(child, "bits", 32)  # packed when quantized
        weight = getattr(child, "weight", None) if isinstance(child, nn.Module) else None
        if isinstance(weight, mx.array) and weight.ndim == 2 and weight.shape[0] == num_experts:
            return (lambda x, w=weight: x @ w.T), weight.shape[1]
    return None


def _get_path(root: nn.Module, path: str):
    obj = root
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def _set_path(root: nn.Module, path: str, value) -> None:
    parent, attr = path.rsplit(".", 1)
    setattr(_get_path(root, parent), attr, value)
