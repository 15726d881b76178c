"""The streaming MoE forward pass: experts live in slot pools filled from the store on demand.

Each SwitchGLU / SwitchMLP of an mlx-lm model is wrapped by `StreamingExperts`. The wrapped
module keeps its own code (activation, biases, quantization, sorting) but its expert tensors
are replaced by a pool of `num_slots` slots shared by every MoE layer with the same expert
shapes; the routed expert ids are remapped to slot ids before the original module runs.

Slots are filled by reading from the files straight into the pool's memory, so no computation
that reads a slot may still be pending when a later call overwrites it: every call evaluates its
expert output before it returns (teacher-forced scoring, for one, never needs a token's last
layers before the next token's loads), unless the budget gives every expert a slot of its own,
when no slot is ever overwritten and the graph stays lazy as in stock mlx-lm. Prefetch reads run
during that evaluation and never touch the slots it reads.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from functools import partial
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

from .budget import BudgetError, format_bytes
from .cache import ExpertCache, split_slots
from .interrupts import CRITICAL, install_handler
from .policies import DEFAULT_POLICY
from .profiles import Profile
from .stats import Stats, ratio
from .store import ExpertStore, StoreError

EXPERT_MODULES = (SwitchGLU, SwitchMLP)
TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token", "num_experts_per_token", "moe_topk", "top_k")


@dataclass
class MoELayer:
    path: str  # module path, e.g. model.layers.3.mlp.switch_mlp
    module: nn.Module
    num_experts: int
    # Per-expert parameter name (`gate_proj.weight`, ...) -> (shape, dtype, bytes) of one expert.
    specs: dict[str, tuple[tuple[int, ...], mx.Dtype, int]]

    @property
    def signature(self) -> tuple:
        return tuple((n, shape, str(dtype)) for n, (shape, dtype, _) in sorted(self.specs.items()))

    @property
    def expert_bytes(self) -> int:
        return sum(nbytes for _, _, nbytes in self.specs.values())


@dataclass
class ModelPlan:
    """What streaming a model involves, read from the lazily loaded model without any I/O."""

    model_type: str
    top_k: int
    layers: list[MoELayer]
    dense_bytes: int
    config_hash: str
    num_layers: int = field(init=False)

    def __post_init__(self):
        self.num_layers = len(self.layers)

    @property
    def num_experts(self) -> int:
        return max(l.num_experts for l in self.layers)

    @property
    def expert_bytes(self) -> int:
        """Bytes of all experts of all layers."""
        return sum(l.expert_bytes * l.num_experts for l in self.layers)

    def pools(self) -> list[list[int]]:
        """Layer indices grouped by identical expert shapes: each group shares one slot pool."""
        groups: dict[tuple, list[int]] = {}
        for i, layer in enumerate(self.layers):
            groups.setdefault(layer.signature, []).append(i)
        return list(groups.values())

    def pool_slots(self, budget_bytes: int) -> list[int]:
        """Slots per pool: the budget is split in proportion to each pool's expert bytes."""
        total = self.expert_bytes
        slots = []
        for group in self.pools():
            layer = self.layers[group[0]]
            share = layer.expert_bytes * layer.num_experts * len(group) / total
            n = int(budget_bytes * share) // layer.expert_bytes
            slots.append(min(n, layer.num_experts * len(group)))
        return slots

    @property
    def min_budget_bytes(self) -> int:
        """The smallest budget that gives every pool room for one token's top-k experts."""
        total = self.expert_bytes
        need = 0
        for group in self.pools():
            layer = self.layers[group[0]]
            share = layer.expert_bytes * layer.num_experts * len(group) / total
            need = max(need, int(np.ceil(self.top_k * layer.expert_bytes / share)))
        return need

    @property
    def identity(self) -> dict:
        """What a profile records to refuse being applied to another model."""
        shapes = [(l.path, l.num_experts) for l in self.layers]
        digest = hashlib.sha256(json.dumps([self.config_hash, shapes]).encode()).hexdigest()
        return {"model_type": self.model_type, "moe_layers": self.num_layers,
                "experts": self.num_experts, "top_k": self.top_k, "fingerprint": digest[:16]}

    def describe(self) -> dict:
        first = self.layers[0]
        return {
            "model_type": self.model_type,
            "moe_layers": self.num_layers,
            "experts": self.num_experts,
            "top_k": self.top_k,
            "expert_bytes": first.expert_bytes,
            "all_expert_bytes": self.expert_bytes,
            "dense_bytes": self.dense_bytes,
            "min_budget_bytes": self.min_budget_bytes,
        }


def plan_model(model: nn.Module, config: dict) -> ModelPlan:
    """Find the expert modules of an mlx-lm model and measure experts vs. dense weights."""
    model_type = config.get("model_type", "?")
    layers = []
    for path, module in model.named_modules():
        if isinstance(module, EXPERT_MODULES):
            proj = module.gate_proj if isinstance(module, SwitchGLU) else module.fc1
            num_experts = proj.num_experts
            specs = {
                n: (a.shape[1:], a.dtype, a.nbytes // num_experts)
                for n, a in tree_flatten(module.parameters())
                if a.ndim and a.shape[0] == num_experts
            }
            layers.append(MoELayer(path, module, num_experts, specs))
    if not layers:
        raise ValueError(
            f"model_type '{model_type}' has no SwitchGLU/SwitchMLP expert layers: "
            "not a Mixture-of-Experts model"
        )
    layers.sort(key=lambda l: _path_key(l.path))
    total = sum(a.nbytes for _, a in tree_flatten(model.parameters()))
    dense = total - sum(l.expert_bytes * l.num_experts for l in layers)
    return ModelPlan(model_type, _top_k(config, model_type), layers, dense, _config_hash(config))


# Settings that change how weights are stored, not which experts a token routes to: a profile
# recorded on the float model applies to its quantized versions.
STORAGE_KEYS = {"quantization", "quantization_config", "torch_dtype", "dtype", "_name_or_path",
                "transformers_version"}


def _config_hash(config: dict) -> str:
    kept = {k: v for k, v in config.items() if k not in STORAGE_KEYS}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()


def _path_key(path: str) -> list:
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.split(".")]


def _top_k(config: dict, model_type: str) -> int:
    for source in (config, config.get("text_config", {})):
        for key in TOP_K_KEYS:
            value = source.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                if value < 1:
                    raise ValueError(f"model_type '{model_type}': config.json has {key} = "
                                     f"{value}: a token must use at least one expert")
                return value
    raise ValueError(f"model_type '{model_type}': config.json names no experts-per-token (top-k)")


class SlotPool:
    """Persistent per-tensor buffers [num_slots, ...] that layers with one expert shape share."""

    def __init__(self, like: MoELayer, num_slots: int):
        self.num_slots = num_slots
        self.arrays: dict[str, mx.array] = {}
        self.views: dict[str, np.ndarray] = {}
        for name, (shape, dtype, _) in like.specs.items():
            array = _page_aligned_zeros((num_slots, *shape), dtype)
            raw = array.view(mx.uint16) if array.dtype == mx.bfloat16 else array
            mx.eval(array, raw)
            self.arrays[name] = array
            self.views[name] = np.array(raw, copy=False)  # writes land in `array`'s memory

    def slot(self, slot: int) -> dict[str, np.ndarray]:
        return {name: view[slot] for name, view in self.views.items()}

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


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


class StreamingExperts(nn.Module):
    """Drop-in replacement for a SwitchGLU / SwitchMLP whose experts are streamed."""

    def __init__(self, inner: nn.Module, layer: int, runtime: "Runtime"):
        super().__init__()
        # Plain attributes, not children: the pool must not appear among the model's parameters.
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "layer", layer)
        object.__setattr__(self, "runtime", runtime)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        runtime = self.runtime
        if runtime.slot_maps:  # every expert resident for good: no host sync, as in stock mlx-lm
            runtime.defer(self.layer, indices)
            slot_map = runtime.slot_maps[self.layer]
            valid = mx.minimum(indices.astype(mx.uint32), slot_map.size - 1)
            return self.inner(x, slot_map[valid])
        # One thread's call at a time, computed before the next may reuse its slots: threads
        # sharing the model interleave whole layer calls.
        with runtime.lock:
            ids = np.array(indices)  # host sync: the routing decides what must be read
            runtime.stats.syncs += 1
            slots = runtime.route(self.layer, ids)
            if slots is None:
                return self._rounds(x, ids)
            y = self.inner(x, mx.array(slots))
            if runtime.prefetch:
                runtime.prefetch_next(self.layer, x)
            if runtime.reuses_slots:
                mx.eval(y)  # see the module docstring: no pending reads of a slot
                runtime.stats.syncs += 1
            return y

    def _rounds(self, x: mx.array, ids: np.ndarray) -> mx.array:
        """More distinct experts than the layer may hold: compute them a slot-pool at a time."""
        k, dims = ids.shape[-1], x.shape[-1]
        flat = self.runtime.masked(self.layer, ids.reshape(-1))[2]
        order = np.argsort(flat, kind="stable")
        sorted_ids = flat[order]
        experts = np.unique(sorted_ids)
        cap = self.runtime.capacity(self.layer)
        rows = x.reshape(-1, dims)
        outs, done = [], 0
        for start in range(0, len(experts), cap):
            chunk = experts[start : start + cap]
            end = done + int(np.searchsorted(sorted_ids[done:], chunk[-1], side="right"))
            pos = order[done:end]
            with CRITICAL:
                slots = self.runtime.request(self.layer, chunk, flat[pos])
            y = self.inner(rows[mx.array(pos // k)], mx.array(slots[:, None]))[:, 0]
            mx.eval(y)  # the next chunk may overwrite these slots
            outs.append(y)
            done = end
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
        y = mx.concatenate(outs)[mx.array(inverse)]
        return y.reshape(*ids.shape, y.shape[-1])


# Prefetch reads ahead for a layer only while at least this share of its predicted misses (the
# predicted experts that were not resident: what a prefetch reads) turn out routed, once this
# many have been scored; the tally halves past 16x that, so it follows a changing workload. Only
# one-token calls are tallied: a prompt's prediction names the experts of many tokens at once,
# routed far more often than a decode step's, and would keep reading ahead where it never pays.
PREFETCH_MIN_USEFUL = 0.25
PREFETCH_WARMUP = 16
PREFETCH_PROBE = 8  # while it does not pay, a layer is predicted on one token in this many


class Runtime:
    """Owns the store, the slot pools, their caches and the statistics of one model."""

    def __init__(self, plan: ModelPlan, store: ExpertStore, budget_bytes: int,
                 policy: str = DEFAULT_POLICY, window_tokens: int = 32, per_layer: bool = False,
                 layer_weights: np.ndarray | None = None, prefetch: bool = False,
                 io_threads: int = 4):
        """`per_layer` gives each layer its own share of a pool (`layer_weights`, e.g. from a
        profile, or uniform) instead of one budget shared by all layers. `prefetch` predicts
        each next layer's experts with its router and reads the misses in the background (not
        when the budget holds every expert)."""
        if budget_bytes < plan.min_budget_bytes:
            raise BudgetError(
                f"budget {format_bytes(budget_bytes)} ({budget_bytes} bytes) is below the minimum "
                f"{format_bytes(plan.min_budget_bytes)} ({plan.min_budget_bytes} bytes): one "
                f"token's top-{plan.top_k} experts must fit"
            )
        self.plan = plan
        self.store = store
        self.budget_bytes = budget_bytes
        self.policy = policy
        self.recorder = None  # a trace.TraceRecorder while recording routing
        self.io = ThreadPoolExecutor(io_threads, thread_name_prefix="moestream-read")
        self.lock = threading.RLock()  # one thread's layer call at a time
        self.routers: list = [None] * plan.num_layers  # each layer's router, set by attach()
        self.inflight: list[tuple[int, int, Future]] = []  # (layer, expert, read) of prefetches
        self.predicted: dict[int, np.ndarray] = {}  # layer -> experts predicted for its next call
        self.predicted_misses: dict[int, set[int]] = {}  # of those, the ones not resident
        self.misses_predicted = np.zeros(plan.num_layers)  # tally of predicted misses per layer,
        self.misses_routed = np.zeros(plan.num_layers)  # and of those then routed
        self.prefetched: dict[int, set[int]] = {}  # layer -> experts prefetched for its next call
        self._current: set[int] = set()  # keys the pending computation of the last call reads
        self.prewarm_info: dict | None = None
        self.warm = np.zeros(plan.num_layers, np.int64)  # experts pre-warmed per layer
        self.stats = Stats([l.path for l in plan.layers], plan.num_experts, window_tokens)
        self.store_layer = [
            store.add_layer(l.path, {n: (shape, nbytes) for n, (shape, _, nbytes) in l.specs.items()},
                            l.num_experts)
            for l in plan.layers
        ]
        store.open()  # before any reader thread
        install_handler()  # Ctrl-C waits for a step in progress (see interrupts)
        self.pools: list[SlotPool] = []
        self.caches: list[ExpertCache] = []
        self.pool_of: list[int] = [0] * plan.num_layers
        for group, slots in zip(plan.pools(), plan.pool_slots(budget_bytes)):
            layer_slots = None
            if per_layer:
                if slots < len(group) * plan.top_k:
                    raise BudgetError(
                        f"budget {format_bytes(budget_bytes)} gives {slots} slots: a per-layer "
                        f"split needs top-{plan.top_k} for each of {len(group)} layers "
                        f"({len(group) * plan.top_k} slots)"
                    )
                weights = np.ones(len(group)) if layer_weights is None else layer_weights[group]
                layer_slots = split_slots(slots, weights, plan.top_k)
            self.pools.append(SlotPool(plan.layers[group[0]], slots))
            self.caches.append(ExpertCache(slots, group, plan.num_experts, self.stats, policy,
                                           layer_slots))
            for i in group:
                self.pool_of[i] = len(self.pools) - 1
        self.reuses_slots = not all(cache.holds_all for cache in self.caches)
        self.slot_maps: list[mx.array] = []  # per layer, once every expert is resident for good
        # per thread, (layer, ids) of its calls still to count: only the thread that built them
        # can evaluate them (mlx streams are per thread), or any once it has ended
        self.deferred: dict[threading.Thread, list[tuple[int, mx.array]]] = {}
        # With a slot for every expert, each expert misses once per session: a prediction's host
        # sync on every token would cost more than reading ahead saves.
        self.prefetch = prefetch and self.reuses_slots

    def attach(self, model: nn.Module) -> None:
        """Swap every expert module of `model` for its streaming version (drops lazy experts)."""
        for i, layer in enumerate(self.plan.layers):
            pool = self.pools[self.pool_of[i]]
            for name, array in pool.arrays.items():
                _set_path(layer.module, name, array)
            parent_path, attr = layer.path.rsplit(".", 1)
            parent = _get_path(model, parent_path)
            setattr(parent, attr, StreamingExperts(layer.module, i, self))
            self.routers[i] = _router(parent, layer.num_experts)
        model.moestream = self

    def capacity(self, layer: int) -> int:
        return self.caches[self.pool_of[layer]].capacity(layer)

    def masked(self, layer: int, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Masked ids (-1, or beyond the expert count) must cause no load: returns (ids with -1
        for masked ones, the routed ids alone, ids with masked ones pointing at a routed expert)."""
        num = self.plan.layers[layer].num_experts
        if ids.min() >= 0 and ids.max() < num:
            return ids, ids, ids
        valid = (ids >= 0) & (ids < num)
        routed = ids[valid]
        fill = routed[0] if routed.size else 0
        return np.where(valid, ids, -1), routed, np.where(valid, ids, fill)

    def route(self, layer: int, ids: np.ndarray) -> np.ndarray | None:
        """Slots for routed `ids`, loading misses; None when the call needs more than fit."""
        with CRITICAL:
            return self._route(layer, ids)

    def _route(self, layer: int, ids: np.ndarray) -> np.ndarray | None:
        if self.inflight:
            self._settle(layer)
        if layer == 0:
            tokens = ids.size // ids.shape[-1]
            self.stats.tick(tokens)
            for cache in self.caches:
                cache.tick(tokens)
        masked, routed, ids = self.masked(layer, ids)
        self.stats.route(layer, routed)
        if self.recorder is not None:
            self.recorder.record(layer, masked.reshape(-1, masked.shape[-1]))
        experts = np.unique(ids)
        if layer in self.predicted:
            self._score_prediction(layer, experts, tally=ids.size == ids.shape[-1])
        if len(experts) > self.capacity(layer):
            return None
        slots = self.request(layer, experts, ids)
        if self.prefetch:
            self._current = set((layer * self.plan.num_experts + experts).tolist())
        return slots

    def read_all(self, progress=None) -> None:
        """When the budget holds every expert, read them all now, as stock mlx-lm reads its
        weights at load: no slot is ever reused, so ids map to slots on the device from the
        first token, with no host sync, and each call's routing is counted two tokens later.
        Ids outside [0, experts) (masked) map to expert 0's slot. `progress(items, label)` may
        wrap the reads, issued in file order on the I/O threads."""
        reads, layers = [], []
        for layer in range(self.plan.num_layers):
            slots = self.caches[self.pool_of[layer]].admit_layer(layer)
            reads.append(self.io.submit(self._read_layer, layer, slots))
            layers.append(layer)
        context = progress(reads, "read experts") if progress else nullcontext(reads)
        try:
            with context as items:
                for read, layer in zip(items, layers):  # items first: the bar ends at 100%
                    for nbytes, seconds, experts in read.result():
                        self._count_read(layer, nbytes, seconds, experts)
        except BaseException:
            for read in reads:
                read.cancel()
            raise
        self.slot_maps = []
        for layer in range(self.plan.num_layers):
            row = self.caches[self.pool_of[layer]].slot_of[layer]
            self.slot_maps.append(mx.array(np.append(row, row[0])))

    def defer(self, layer: int, indices: mx.array) -> None:
        calls = self.deferred.setdefault(threading.current_thread(), [])
        calls.append((layer, indices))
        if len(calls) > 3 * self.plan.num_layers:
            self.settle_deferred(keep=2 * self.plan.num_layers)

    def settle_deferred(self, keep: int = 0) -> None:
        """Count the routing of this thread's deferred calls (whole forward calls, all but the
        last `keep` layer calls) and of threads that have ended, in call order."""
        if not self.slot_maps:
            return
        layers, me = self.plan.num_layers, threading.current_thread()
        with self.lock:
            threads = list(self.deferred)  # one step: other threads may add theirs meanwhile
            for thread in [t for t in threads if t is me or not t.is_alive()]:
                calls = self.deferred.pop(thread)
                cut = (len(calls) - keep) // layers * layers if thread is me else len(calls)
                if cut < len(calls) and thread is me:
                    self.deferred[thread] = calls[cut:]
                for layer, indices in calls[:cut]:
                    self.route(layer, np.array(indices))

    def request(self, layer: int, experts: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Make distinct `experts` resident; returns the slots of `ids` (each one of `experts`)."""
        cache = self.caches[self.pool_of[layer]]
        loads = cache.request(layer, experts)  # callers hold CRITICAL: no half-made load
        if loads:
            self._load(layer, cache, loads)
        return cache.slot_of[layer][ids]

    def _read(self, layer: int, expert: int, slot: int) -> tuple[int, float]:
        start = time.perf_counter()
        pool = self.pools[self.pool_of[layer]]
        nbytes = self.store.read_expert(self.store_layer[layer], expert, pool.slot(slot))
        return nbytes, time.perf_counter() - start

    def _read_layer(self, layer: int, slots: list[int]) -> list[tuple[int, float, int]]:
        """Every expert of a layer into `slots`: one read per tensor when the slots follow the
        experts in order and the file holds them so, else one read per expert. Returns
        (bytes, seconds, experts) per read."""
        start, pool = time.perf_counter(), self.pools[self.pool_of[layer]]
        first = slots[0]
        if slots == list(range(first, first + len(slots))):
            dest = {name: view[first : first + len(slots)] for name, view in pool.views.items()}
            nbytes = self.store.read_layer(self.store_layer[layer], dest)
            if nbytes is not None:
                return [(nbytes, time.perf_counter() - start, len(slots))]
        return [(*self._read(layer, e, s), 1) for e, s in enumerate(slots)]

    def _count_read(self, layer: int, nbytes: int, seconds: float, experts: int = 1) -> None:
        self.stats.read_seconds[layer] += seconds
        self.stats.bytes_read[layer] += nbytes
        self.stats.loads[layer] += experts

    def _load(self, layer: int, cache: ExpertCache, loads: list[tuple[int, int]]) -> None:
        """Read the missing experts of a call, concurrently when there are several."""
        start = time.perf_counter()
        reads = [partial(self._read, layer, e, s) for e, s in loads]
        if len(reads) > 1:
            reads = [self.io.submit(read).result for read in reads]
        failed = None
        for (expert, _), read in zip(loads, reads):
            try:
                self._count_read(layer, *read())
            except StoreError as e:
                cache.discard(layer, expert)
                failed = failed or e
        self.stats.stall_seconds[layer] += time.perf_counter() - start
        if failed:
            self.stats.read_errors += 1
            raise failed

    def prefetch_next(self, layer: int, x: mx.array) -> None:
        """Predict the next layer's experts with its own router applied to this layer's input,
        and start reading the predicted misses; the pending computation's experts stay."""
        nxt = layer + 1
        if nxt >= self.plan.num_layers or self.routers[nxt] is None:
            return
        cache = self.caches[self.pool_of[nxt]]
        if (cache.slot_of[nxt] >= 0).all():  # nothing to read: skip the prediction's sync
            return
        if not self._pays(nxt) and self.stats.tokens % PREFETCH_PROBE:
            return  # reading ahead does not pay here: predict now and then, to see if it does
        k = self.plan.top_k
        logits = self.routers[nxt](x)
        top = np.array(mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k])  # host sync
        self.stats.syncs += 1
        predicted = np.unique(top)
        self.predicted[nxt] = predicted
        self.predicted_misses[nxt] = set(predicted[cache.slot_of[nxt][predicted] < 0].tolist())
        if len(predicted) + len(self._current) > cache.capacity(nxt) or not self._pays(nxt):
            return
        with CRITICAL:
            loads = cache.prefetch(nxt, predicted, self._current)
            self.prefetched[nxt] = {e for e, _ in loads}
            self.inflight += [(nxt, e, self.io.submit(self._read, nxt, e, s)) for e, s in loads]

    def _pays(self, layer: int) -> bool:
        """Whether reading `layer`'s predicted misses ahead is right often enough: a wrong read
        costs bandwidth and a slot. The tally counts predicted misses whether or not they were
        read, so a layer whose predictions improve gets its prefetch back."""
        predicted = self.misses_predicted[layer]
        return (predicted < PREFETCH_WARMUP
                or self.misses_routed[layer] >= PREFETCH_MIN_USEFUL * predicted)

    def _settle(self, layer: int) -> None:
        """Wait for in-flight prefetches before any slot may be reused; a failed one is
        forgotten, so a real need reads it again and reports the error."""
        start = time.perf_counter()
        for owner, expert, read in self.inflight:
            try:
                self._count_read(owner, *read.result())
                self.stats.prefetch_loads[owner] += 1
            except StoreError:
                self.caches[self.pool_of[owner]].discard(owner, expert)
                self.prefetched.get(owner, set()).discard(expert)
                self.stats.read_errors += 1
        self.inflight = []
        self.stats.stall_seconds[layer] += time.perf_counter() - start

    def _score_prediction(self, layer: int, experts: np.ndarray, tally: bool) -> None:
        """Count how the prediction for this call did; `tally` (one-token calls) also feeds the
        gate of `_pays`."""
        predicted = self.predicted.pop(layer)
        routed = set(experts.tolist())
        misses = self.predicted_misses.pop(layer, set())  # unset if Ctrl-C fell in between
        if tally:
            self.misses_predicted[layer] += len(misses)
            self.misses_routed[layer] += len(misses & routed)
            if self.misses_predicted[layer] > 16 * PREFETCH_WARMUP:
                self.misses_predicted[layer] /= 2
                self.misses_routed[layer] /= 2
        stats = self.stats
        stats.predicted[layer] += len(predicted)
        stats.routed_scored[layer] += len(routed)
        stats.predicted_routed[layer] += len(routed.intersection(predicted.tolist()))
        stats.prefetch_used[layer] += len(routed & self.prefetched.pop(layer, set()))

    @property
    def resident_bytes(self) -> int:
        return sum(c.resident * self.plan.layers[g[0]].expert_bytes
                   for c, g in zip(self.caches, self.plan.pools()))

    @property
    def slot_bytes(self) -> int:
        return sum(p.nbytes for p in self.pools)

    def prewarm(self, profile: Profile, share: float = 1.0, pin_share: float = 0.0,
                progress=None) -> dict:
        """Read a profile's hottest experts into free slots (up to `share` of each pool), in
        file order, and seed the policies with its decayed counts: these pins are soft, the
        seeded counts decay like live ones. The hottest `pin_share` of each pool is pinned for
        good (leaving every layer room for one token's top-k). `progress(items, label)` is a
        context manager wrapping the reads."""
        profile.check_model(self.plan.identity)
        self.settle_deferred()
        picks, pins = [], []
        for cache in self.caches:
            hot, pinned = cache.prewarm_plan(profile, share, pin_share, self.plan.top_k)
            picks += hot
            pins += pinned
        picks.sort()  # layer by layer, expert by expert: the order of the stacked tensors
        start, nbytes, loaded = time.perf_counter(), 0, 0
        context = progress(picks, f"pre-warm {profile.workload}") if progress else nullcontext(picks)
        with context as items:
            for layer, expert in items:
                cache = self.caches[self.pool_of[layer]]
                with CRITICAL:
                    slot = cache.admit(layer, expert)
                    if slot is None:
                        continue
                    try:
                        read = self._read(layer, expert, slot)
                    except StoreError:
                        cache.discard(layer, expert)
                        self.stats.read_errors += 1
                        raise
                    self._count_read(layer, *read)  # in `loads` and `bytes_read`, as any read
                    nbytes += read[0]
                self.warm[layer] += 1
                loaded += 1
        for layer, expert in pins:
            self.caches[self.pool_of[layer]].pin(layer, expert)
        self.prewarm_info = {"profile": profile.workload, "experts": loaded, "pinned": len(pins),
                             "bytes": nbytes,
                             "read_ms": (time.perf_counter() - start) * 1e3,
                             "at_token": self.stats.tokens,
                             "hits_before": int(self.stats.hits.sum()),
                             "misses_before": int(self.stats.misses.sum())}
        return self.prewarm_info

    def profile(self, workload: str) -> Profile:
        """This session's routing so far, to pre-warm later sessions of the same workload."""
        self.settle_deferred()
        return Profile.of(self.stats, workload, self.plan.identity)

    def _prewarm_effect(self, hits: int, misses: int) -> dict:
        """The pre-warm's record with the hit rate of the accesses before it and since."""
        info = self.prewarm_info
        h0, m0 = info["hits_before"], info["misses_before"]
        return {**info, "hit_rate_before": ratio(h0, h0 + m0),
                "hit_rate_after": ratio(hits - h0, hits - h0 + misses - m0)}

    def stats_dict(self) -> dict:
        self.settle_deferred()
        out = self.stats.as_dict()
        out.update(
            budget_bytes=self.budget_bytes,
            resident_bytes=self.resident_bytes,
            slot_bytes=self.slot_bytes,
            slots=sum(p.num_slots for p in self.pools),
            policy=self.policy,
            prefetch=self.prefetch,
            prewarm=self.prewarm_info and self._prewarm_effect(out["hits"], out["misses"]),
        )
        pinned = sum(c.pinned_count for c in self.caches)
        for layer, warm, pins in zip(out["layers"], self.warm.tolist(), pinned.tolist()):
            layer["warm"] = warm
            layer["pinned"] = pins
        return out


def _router(block: nn.Module, num_experts: int):
    """The routing logits of a MoE block (its Linear with one output per expert), or None."""
    for name, child in block.children().items():
        if isinstance(child, (nn.Linear, nn.QuantizedLinear)):
            out = child.weight.shape[0]
            if out == num_experts:
                return child
        weight = getattr(child, "weight", None) if isinstance(child, nn.Module) else None
        if isinstance(weight, mx.array) and weight.ndim == 2 and weight.shape[0] == num_experts:
            return lambda x, w=weight: x @ w.T
    return None


def _get_path(root: nn.Module, path: str):
    obj = root
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def _set_path(root: nn.Module, path: str, value) -> None:
    parent, attr = path.rsplit(".", 1)
    setattr(_get_path(root, parent), attr, value)
