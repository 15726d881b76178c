"""The streaming runtime, backend neutral: route -> ensure resident -> compute.

A backend (`mlx`, `torch`) builds the `ModelPlan`, hands the runtime a `Backend` whose
pools hold the experts of each group of layers with one expert shape, and calls `call` from
each expert layer with a `StreamedLayer`; everything else happens here, the same for every
backend. Slots are filled in place, so a backend's `settle` must wait for a call's compute
before a later call may reuse its slots (`Residency.holds_all`: when no slot is reused).
What a model does outside its calls lives apart: `preload` reads every expert at load,
`prewarming` pre-warms from a profile, `report` assembles the statistics, `forks` follows forks.
"""

from __future__ import annotations

import numbers
import threading
from typing import Any, Callable, Iterator

import numpy as np

from . import preload
from .backend import Backend, Parts, StreamedLayer
from .cache import check_shares, make_held
from .errors import ClosedError, NotCopyableError
from .forks import follow_forks
from .interrupts import CRITICAL, install_handler
from .plan import ModelPlan
from .policies import DEFAULT_POLICY, make_policy
from .pools import check_budget
from .prefetch import Prefetch
from .prewarming import Prewarmer
from .profiles import Profile
from .reads import Group, Reads
from .residency import Residency
from .report import RuntimeState, runtime_state, stats_report
from .stats import Stats
from .store import ExpertStore
from .trace import TraceRecorder

# A call of many tokens reads its misses in at most this many groups (of at least top-k
# experts), computing each group once read while the next ones are read (`route_chunks`).
PIPELINE_CHUNKS = 16


def check_options(policy: str, prewarm_share: float, pin_share: float, window_tokens: int
                  ) -> None:
    """A load's options, checked before anything is read (a profile or not): the policy's name,
    options and values, the shares, the statistics' window."""
    make_policy(policy, capacity=1, num_keys=1)
    check_shares(prewarm_share, pin_share)
    check_tokens(window_tokens, "window_tokens")


def check_tokens(value: int, name: str) -> None:
    """A number of tokens: whole, at least 1 (NaN and 1.5 pass a comparison)."""
    if not (isinstance(value, numbers.Integral) and value >= 1):
        raise ValueError(f"{name} must be a whole number of tokens, at least 1, got {value!r}")


class Runtime:
    """The store, the slot pools and their caches, and the statistics of one streamed model."""

    def __init__(self, plan: ModelPlan, store: ExpertStore, budget_bytes: int, backend: Backend,
                 policy: str = DEFAULT_POLICY, window_tokens: int = 32, per_layer: bool = False,
                 layer_weights: np.ndarray | None = None, io_threads: int = 4,
                 whole_calls: bool = False, host: tuple[int, int] = (0, 1)):
        """
        Args:
            backend: makes the slot pools, and waits for compute that reads them.
            per_layer: give each layer its own share of a pool (`layer_weights`, e.g. from a
                profile, or uniform) instead of one budget shared by all layers.
            whole_calls: the backend cannot compute a call in `rounds`, so every expert of a
                layer must fit.
            host: (this host, hosts) under expert parallelism.
        """
        check_budget(plan, budget_bytes, whole_calls, per_layer)
        self.plan = plan
        self.store = store
        self.backend = backend
        self.budget_bytes = budget_bytes
        # the most distinct experts one call of a layer must be able to hold at once
        self.call_experts = plan.num_experts if whole_calls else plan.top_k
        self.policy = policy
        self.recorder: TraceRecorder | None = None  # while recording routing (`start_trace`)
        self.stats = Stats([l.path for l in plan.layers], plan.num_experts, window_tokens)
        self.residency = residency = Residency(plan, store, budget_bytes, backend, policy,
                                               self.call_experts, per_layer, layer_weights)
        self.reads = Reads(io_threads, residency.read, residency.forget, self.stats)
        self.lock = threading.RLock()  # one thread's layer call at a time
        self.prefetch: Prefetch | None = None  # see `enable_prefetch`
        self.closed = False  # see `close`
        self.held: list[tuple] = []  # the statistics of calls routed since the latest `tally`
        self.host = host
        store.open()  # before any reader thread
        install_handler()  # Ctrl-C waits for a step in progress (see interrupts)
        self.prewarmer = Prewarmer(residency.caches, residency.layer_cache, self.reads,
                                   self.call_experts, lambda: self.closed)
        follow_forks(self)

    def enable_prefetch(self) -> None:
        """Read each next layer's predicted experts ahead (see `prefetch`). Not when every
        expert has a slot: each misses once a session, and predicting on every token would
        cost more than reading ahead saves."""
        if not self.residency.holds_all:
            self.prefetch = Prefetch(self.residency.layer_cache, self.stats)

    def count_sync(self) -> None:
        """The backend waited for the device (to read routed ids or a prediction)."""
        self.stats.syncs += 1

    def call(self, experts: StreamedLayer, *inputs: Any) -> Any:
        """One call of a streamed expert layer: route -> ensure resident -> compute. Under the
        lock: threads sharing the model interleave whole layer calls, each computed before a
        later one may reuse its slots."""
        layer = experts.layer
        with self.lock:
            predict = (self.prefetch is not None and experts.predicts(*inputs)
                       and self.prefetch.wanted(layer))
            ids, predicted = experts.routed(predict, *inputs)
            self.backend.settle()  # the previous call's compute, which may read the slots
            if experts.computes_parts and ids.size != ids.shape[-1]:
                chunks = self.route_chunks(layer, ids)  # computed while the misses are read
                if chunks is None:
                    return experts.compute_rounds(ids, self.rounds(layer, ids), *inputs)
                output = experts.compute_chunks(ids, chunks, *inputs)
            else:
                slots = self.route(layer, ids)
                if slots is None:
                    return experts.compute_rounds(ids, self.rounds(layer, ids), *inputs)
                if predicted is not None:
                    self.read_ahead(layer, predicted)  # read while this call computes
                output = experts.compute(ids, slots, *inputs)
            experts.issued(output)
            self.tally()  # while the device computes
            return output

    def route(self, layer: int, ids: np.ndarray, compute: bool = True, record: bool = True
              ) -> np.ndarray | None:
        """The slots of a call's routed `ids` [..., k], once its misses are read.

        Args:
            compute: False when the caller computes nothing from the slots (it only counts).
            record: whether a trace in progress records the call.

        Returns:
            The slots, shaped as `ids`; None when the call routes to more experts than the
            layer holds at once: compute it by `rounds`.
        """
        with CRITICAL:
            admitted = self._admit(layer, ids, compute, record)
            if admitted is None:
                return None
            experts, ids = admitted
            slots = self._request(layer, experts, ids)
            self._reading(layer, experts)
            return slots

    def _admit(self, layer: int, ids: np.ndarray, compute: bool, record: bool
               ) -> tuple[list[int], np.ndarray] | None:
        """Start a call: finish the reads in flight, count and record its routing, mask ids.

        Ids outside [0, experts) read and count nothing and take a routed expert's slot (the
        model discards their outputs); a call whose every id is masked uses expert 0.

        Returns:
            (distinct experts in order, ids), or None when the call computes by `rounds` or
            computes nothing.
        """
        if self.closed and compute:
            raise ClosedError()
        if self.held:  # the backend did not tally the previous call
            self.tally()
        if self.reads.pending:
            self.reads.finish(layer)
        if layer == 0:
            tokens = ids.size // ids.shape[-1]
            self.held.append((self.stats.tick, (tokens,)))
            for cache in self.residency.caches:
                cache.tick(tokens)
        num = self.plan.layers[layer].num_experts
        if self.recorder is not None and record:
            self.recorder.record(layer, np.where((ids >= 0) & (ids < num), ids, -1))
        routed, ids = unmasked(ids, num)
        if not routed and not compute:
            return None
        experts = sorted(set(routed)) if routed else [0]  # expert 0 where every id is masked
        if self.prefetch:
            self.prefetch.score(layer, experts)
        fits = len(experts) <= self.residency.capacity(layer)
        if fits or not compute:  # else `rounds` counts each round's routing with its accesses
            self.held.append((self.stats.route, (layer, routed)))
        return (experts, ids) if fits else None

    def _request(self, layer: int, experts: list[int], ids: np.ndarray) -> np.ndarray:
        """Make distinct `experts` resident; returns the slots of `ids` (each one of `experts`).
        Callers hold CRITICAL: no decision without its load."""
        loads = self._decide(layer, experts)
        if loads:
            self.reads.load(layer, loads)
        return self.residency.layer_cache[layer].slots(layer, ids)

    def _decide(self, layer: int, experts: list[int]) -> list[tuple[int, int]]:
        """The cache's decision for a call's distinct `experts`, counted, its victims released:
        returns the (expert, slot) reads it needs."""
        loads, hits, evicted = self.residency.layer_cache[layer].request(layer, experts)
        self.held.append((self.stats.count_request, (layer, hits, len(loads))))
        if evicted:
            self.evicted(evicted, layer, loads)
        return loads

    def _reading(self, layer: int, experts: list[int]) -> None:
        """A prefetch must not evict the experts of the call about to compute."""
        if self.prefetch:
            base = layer * self.plan.num_experts
            self.prefetch.reading = {base + e for e in experts}

    def evicted(self, keys: list[int], layer: int, loads: list[tuple[int, int]]) -> None:
        """Release the cache's victims `keys` (`layer * num_experts + expert`), counted at the
        call's tally.

        Args:
            loads: `layer`'s (expert, slot) reads decided with the eviction. When the release
                fails (madvise) or is interrupted no read follows, so these leave their slots.
        """
        self.held.append((self.stats.count_evictions, (keys,)))
        try:
            self.residency.release(keys)
        except BaseException:
            self.residency.forget(layer, *(expert for expert, _ in loads))
            raise

    def route_chunks(self, layer: int, ids: np.ndarray) -> Parts | None:
        """`route` for a call of many tokens: its chunks, each as soon as its experts land.

        The resident experts' chunk comes first, then the misses in file order, in at most
        `PIPELINE_CHUNKS` groups read at once: the caller computes a chunk while the next
        ones are read.

        Returns:
            None when the call does not fit (compute it by `rounds`), else an iterator of
            (positions in the flat ids, their slots); positions None for the whole call,
            slots then shaped as `ids`.
        """
        with CRITICAL:
            admitted = self._admit(layer, ids, True, True)
            if admitted is None:
                return None
            experts, ids = admitted
            loads = self._decide(layer, experts)
            self._reading(layer, experts)
            size = max(self.plan.top_k, -(-len(loads) // PIPELINE_CHUNKS))
            groups = self.reads.start(layer, loads, size)
            slots = self.residency.layer_cache[layer].slots(layer, ids)
        return chunks(self.reads, layer, ids, slots, groups)

    def rounds(self, layer: int, ids: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """A call too large for the layer's slots, a pool's worth of experts at a time.

        Yields (positions in the flat ids, their slots); the caller computes each round before
        asking for the next, which may reuse its slots.
        """
        num, capacity = self.plan.layers[layer].num_experts, self.residency.capacity(layer)
        for experts, positions, routed, counted in split_rounds(ids, num, capacity):
            with CRITICAL:  # a read error ends the call: its later rounds count nothing
                self.held.append((self.stats.route, (layer, counted)))
                slots = self._request(layer, experts, routed)
            yield positions, slots

    def read_ahead(self, layer: int, predicted: np.ndarray) -> None:
        """Start reading the next layer's `predicted` experts (distinct ids) that are not
        resident, while this call computes; the call's own experts are never the victims."""
        nxt = layer + 1
        if not self.prefetch.worth_reading(layer, predicted):
            return
        with CRITICAL:
            cache = self.residency.layer_cache[nxt]
            loads, evicted = cache.prefetch(nxt, predicted, self.prefetch.reading)
            self.evicted(evicted, nxt, loads)
            self.prefetch.ahead[nxt] = landed = set()
            self.reads.start(nxt, loads, landed=landed)

    def tally(self) -> None:
        """Count the calls routed since the last tally and make the policy updates they held.

        No compute depends on these: a backend tallies once a call's compute is issued, while
        the device works (else the next call does).
        """
        with CRITICAL:  # a policy must learn of every key that became resident
            for cache in self.residency.caches:
                cache.catch_up()
            make_held(self.held)

    def count_all(self) -> None:
        """Count everything routed so far (before statistics or a profile are read)."""
        with self.lock:
            self.backend.count_deferred()
            self.tally()

    def _settle_counts(self) -> None:
        """Outside a layer call, finish the reads in flight and count all routing held back:
        residency and counts are then whole. Callers hold the lock."""
        self.reads.drain()
        self.count_all()

    def read_all(self, progress: Callable | None = None) -> None:
        """Read every expert now, when each has a slot of its own (see `preload`)."""
        preload.read_all(self.residency, self.reads, progress)

    def prewarm(self, profile: Profile, share: float = 1.0, pin_share: float = 0.0,
                progress: Callable | None = None) -> dict:
        """Pre-warm from `profile` (see `Prewarmer.run`) under the lock, as a layer call:
        another thread's call is never in between."""
        profile.check_model(self.plan.identity)
        if self.closed:
            raise ClosedError()
        with self.lock:
            self._settle_counts()  # a pin must not take an expert whose read may yet fail
            return self.prewarmer.run(profile, share, pin_share, progress)

    def stats_dict(self) -> dict:
        """What `stats(model)` reports (see `report`)."""
        with self.lock:
            self._settle_counts()  # every resident expert with its load counted
            counted = self.stats.as_dict()
        return stats_report(counted, self.plan, self.residency.pools, self.residency.caches,
                            self.prewarmer, self.budget_bytes, self.policy,
                            self.prefetch is not None, self.host)

    def state(self) -> RuntimeState:
        """What the model holds now (resident, pinned, reads in flight, free slots), between
        layer calls: a snapshot that later calls do not change."""
        with self.lock:
            return runtime_state(self.residency, self.reads)

    def forked(self) -> None:
        """In a child forked while the model was loaded (see `forks`): the I/O threads did not
        come along, so it starts its own (a read queued for them would wait for ever), and the
        reads in flight at the fork, which never land here, leave their slots."""
        self.store.forked()
        self.reads.forked()
        if self.prefetch:
            self.prefetch.ahead.clear()

    def __reduce__(self):
        """`copy.deepcopy` and pickling of a model reach its runtime: its open files, threads
        and slot pools cannot be copied."""
        raise NotCopyableError()

    def close(self) -> None:
        """Finish the reads in flight and close the files; the model cannot stream after.

        Another thread's pre-warm or layer call stops at its next read, and its step ends
        before the files close, so none of its reads opens them again.
        """
        self.closed = True
        with self.lock:
            self.reads.close()
            self.store.close()


def unmasked(ids: np.ndarray, num: int) -> tuple[list[int], np.ndarray]:
    """(the routed ids alone, a flat list, `ids` with masked ones (-1, or `num` and past)
    pointing at a routed expert). A list: a decode call names a handful of ids, and Python's
    min and max cost less than numpy's there."""
    flat = ids.reshape(-1).tolist()
    if min(flat) >= 0 and max(flat) < num:
        return flat, ids
    routed = [i for i in flat if 0 <= i < num]
    return routed, np.where((ids >= 0) & (ids < num), ids, routed[0] if routed else 0)


def split_rounds(ids: np.ndarray, num: int, capacity: int
                 ) -> Iterator[tuple[list[int], np.ndarray, np.ndarray, list[int]]]:
    """`Runtime.rounds`' rounds: (at most `capacity` distinct experts, their positions in the
    flat ids, the ids there with masked ones unmasked, the routed ids there to count)."""
    given = ids.reshape(-1)
    routed, flat = unmasked(given, num)
    order = np.argsort(flat, kind="stable")
    valid = None  # masked ids (pointing at a routed expert) count nothing
    if len(routed) < len(flat):
        valid = (given >= 0) & (given < num)
    sorted_ids = flat[order]
    experts, done = np.unique(sorted_ids), 0
    for start in range(0, len(experts), capacity):
        chunk = experts[start : start + capacity]
        end = done + int(np.searchsorted(sorted_ids[done:], chunk[-1], side="right"))
        positions = order[done:end]
        counted = positions if valid is None else positions[valid[positions]]
        yield chunk.tolist(), positions, flat[positions], flat[counted].tolist()
        done = end


def chunks(reads: Reads, layer: int, ids: np.ndarray, slots: np.ndarray, groups: list[Group]
           ) -> Parts:
    """`Runtime.route_chunks`' chunks: the resident experts', then each group's once read."""
    if not groups:
        yield None, slots
        return
    flat, flat_slots = ids.reshape(-1), slots.reshape(-1)
    read = np.isin(flat, [e for group in groups for e, _ in group.reads])
    if not read.all():
        positions = np.flatnonzero(~read)
        yield positions, flat_slots[positions]
    for group in groups:
        experts = [e for e, _ in group.reads]  # before finishing, which empties the group
        reads.finish(layer, until=group)
        positions = np.flatnonzero(np.isin(flat, experts))
        yield positions, flat_slots[positions]
