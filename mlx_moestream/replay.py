"""Replay a routing trace through `ExpertCache` to compare eviction policies offline.

The same cache and policy classes as the live runtime, driven the way the runtime drives them:
tokens in order; for each token `tick(1)`, then layers 0..L-1, one `request(layer, experts)` with
the token's distinct experts at that layer. Every policy claim should come with a replay.
"""

from __future__ import annotations

import math
import numbers
import time
from functools import partial
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from .cache import ExpertCache, split_slots
from .files import WRITER, atomic_write, check_replaceable, open_regular
from .policies import Future, Policy, make_policy, policy_class
from .prefetch import CoActivation, Prefetch
from .profiles import Profile
from .stats import Stats
from .trace import Trace

PolicySpec = str | Callable[[int], Policy]

RECOVERY_POINTS = 0.02  # hit rate within 2 points of the new steady state counts as recovered


def replay(
    trace: Trace,
    policy: PolicySpec,
    capacity: int | float,
    per_layer: bool | Sequence[float] = False,
    profile: Profile | None = None,
    window_tokens: int = 32,
    prefetch_reads: int | None = None,
    read_time: float | None = None,
) -> dict:
    """Replay `trace` with `policy` (a name, or a factory taking the capacity) and summarize.

    `capacity`: an int number of (layer, expert) slots, or a float fraction in (0, 1] of all
    layers * num_experts of them. With `per_layer` false the slots form one pool shared by all
    layers; true splits them evenly (`split_slots`), and a sequence of weights (one per layer, e.g.
    `trace.working_set()`) splits them by profile. `profile` pre-warms the cache as
    `load(profile=...)` does (`ExpertCache.prewarm_plan`: seeded counts, the hottest experts
    resident before the first token, none pinned).

    Returns a JSON-ready dict: `hits`, `misses`, `hit_rate`, `evictions`, `capacity` (slots),
    `accesses_per_second` (the replay's speed),
    `policy`, `lru_hit_rate` and `belady_hit_rate` (the same trace, capacity and pre-warmed
    start: a cold Belady could lose to a pre-warmed policy), and, when the
    trace has `segment_id`, `segments` (one per run of equal segment_id: `segment_id`,
    `start_token`, `tokens`, `hit_rate`, `steady_hit_rate`, `recovery_tokens`) and
    `recovery_tokens` (one per switch; the LRU figures as `lru_recovery_tokens`).

    Recovery: a segment [s, e) has steady-state hit rate H = the hit rate of its second half,
    tokens [s + (e - s) // 2, e). The trailing-window hit rate at token t >= s is the hit rate of
    tokens [max(s, t - window_tokens + 1), t] (the window never reaches back before the switch).
    `recovery_tokens` = t - s + 1 for the first t whose trailing-window hit rate is at least
    H - 0.02, the number of the new segment's tokens replayed until the cache has caught up;
    None if that never happens.

    `prefetch_reads`: read ahead, at most that many experts per layer call. After each layer's
    request the next layer's experts are predicted from this one's (`CoActivation`, learned
    from the tokens replayed so far) and read through `ExpertCache.prefetch`, gated by the live
    runtime's `Prefetch` (a layer whose predictions are poor stops reading); a read ahead is
    taken to land before the next layer's call. `misses` then counts the demand misses alone
    (reads a call waits for), and the result adds `prefetch_reads`, `reads_ahead`,
    `reads_ahead_used` (hit before their eviction), `reads_ahead_wasted` (the others),
    `prediction_precision`, `prediction_recall`, and the same replay without reading ahead:
    `misses_without_prefetch`, `hit_rate_without_prefetch` and `misses_saved` (the share of
    its misses that reading ahead saved). The LRU and Belady baselines never read ahead.

    `read_time` (with `prefetch_reads`): drop the assumption that reads ahead land in time. One
    disk serves every read in the order asked, each taking `read_time` layer computes; a call
    waits for its demand reads and for its reads ahead still in flight, then computes for one.
    The result adds `read_time`, `reads_ahead_late` (used before they landed),
    `time_per_token` and `stall_per_token` in layer computes, the same without reading ahead
    (`time_per_token_without_prefetch`, `stall_per_token_without_prefetch`: each call's demand
    reads alone) and `speedup`, the ratio of the two times.
    """
    slots = capacity_slots(trace, capacity, per_layer)
    _check_prefetch(policy, prefetch_reads, read_time)
    prepared = _Prepared(trace)
    plain = _summary(prepared, policy, slots, per_layer, profile, window_tokens)
    baselines = {name: plain for name in ("lru", "belady") if plain["policy"] == name}
    for name in ("lru", "belady"):
        if name not in baselines:
            baselines[name] = _summary(prepared, name, slots, per_layer, profile, window_tokens)
    if prefetch_reads is None:
        return _with_baselines(plain, baselines)
    result = _summary(prepared, policy, slots, per_layer, profile, window_tokens, prefetch_reads,
                      read_time)
    result.update({
        "misses_without_prefetch": plain["misses"],
        "hit_rate_without_prefetch": plain["hit_rate"],
        "misses_saved": 1 - result["misses"] / plain["misses"] if plain["misses"] else 0.0,
    })
    if read_time is not None:  # without reads ahead the disk is idle when each call starts
        stall = plain["misses"] * read_time / trace.tokens
        result["stall_per_token_without_prefetch"] = stall
        result["time_per_token_without_prefetch"] = prepared.calls / trace.tokens + stall
        result["speedup"] = (result["time_per_token_without_prefetch"]
                             / result["time_per_token"])
    return _with_baselines(result, baselines)


def _check_prefetch(policy: PolicySpec, prefetch_reads: int | None,
                    read_time: float | None) -> None:
    """ValueError unless `prefetch_reads` is None or a count of at least 1, read ahead for a
    live policy (an offline one is given the routing, not what was read ahead), and
    `read_time` is None or, with `prefetch_reads`, a finite time above 0."""
    if read_time is not None:
        if prefetch_reads is None:
            raise ValueError("a read time times the reads ahead: give prefetch reads too")
        if isinstance(read_time, bool) or not isinstance(read_time, numbers.Real) \
                or not 0 < read_time < math.inf:
            raise ValueError(f"the read time must be a finite number of layer computes above "
                             f"0, got {read_time!r}")
    if prefetch_reads is None:
        return
    if isinstance(prefetch_reads, bool) or not isinstance(prefetch_reads, numbers.Integral) \
            or prefetch_reads < 1:
        raise ValueError(f"prefetch reads per layer call must be an int of at least 1, "
                         f"got {prefetch_reads!r}")
    if isinstance(policy, str) and policy_class(policy).offline:
        raise ValueError(f"{policy} is offline: it cannot rank experts read ahead")


def sweep(
    trace: Trace,
    policies: Sequence[PolicySpec],
    capacities: Sequence[int | float],
    per_layer: bool | Sequence[float] = False,
    profile: Profile | None = None,
    window_tokens: int = 32,
) -> list[dict]:
    """`replay` of every policy at every capacity; LRU and Belady run once per capacity (each
    pre-warmed from `profile` too)."""
    slots_of = [capacity_slots(trace, capacity, per_layer) for capacity in capacities]
    prepared = _Prepared(trace)
    results = []
    for slots in slots_of:
        baselines = {
            name: _summary(prepared, name, slots, per_layer, profile, window_tokens)
            for name in ("lru", "belady")
        }
        for policy in policies:
            if isinstance(policy, str) and policy in baselines:
                result = baselines[policy]
            else:
                result = _summary(prepared, policy, slots, per_layer, profile, window_tokens)
            results.append(_with_baselines(result, baselines))
    return results


def capacity_slots(trace: Trace, capacity: int | float, per_layer: bool | Sequence[float] = False
                   ) -> int:
    """Slots for `capacity` (an int count, or a float fraction in (0, 1] of all of them);
    ValueError when it is not a number, out of range, or too small for one token's top-k
    (in every layer, when the slots are split per layer)."""
    total = trace.layers * trace.num_experts
    if isinstance(capacity, bool) or not isinstance(capacity, numbers.Real):
        raise ValueError(
            f"capacity must be an int number of slots or a float fraction in (0, 1], "
            f"got {capacity!r}"
        )
    if isinstance(capacity, numbers.Integral):
        slots = int(capacity)
        if not 0 < slots <= total:
            raise ValueError(f"capacity must be in [1, {total}] slots (layers * experts), "
                             f"got {slots}")
    else:
        if not math.isfinite(capacity) or not 0.0 < capacity <= 1.0:
            raise ValueError(f"a fractional capacity must be in (0, 1], got {capacity}")
        slots = round(capacity * total)
    layers = trace.layers if _splits(per_layer) else 1
    need = layers * trace.top_k
    if slots < need:
        raise ValueError(
            f"capacity of {slots} slots is below the top-{trace.top_k} of one token "
            + (f"in each of {layers} layers ({need} slots)" if layers > 1 else "at one layer")
        )
    return slots


def token_hits(trace: Trace, policy: PolicySpec, capacity: int | float,
               profile: Profile | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Hits and accesses of each token of one replay over a shared pool (see `replay`)."""
    prepared = _Prepared(trace)
    _, hits, _ = _run(prepared, policy, capacity_slots(trace, capacity), False, profile)
    return hits, prepared.accesses


def trace_profile(trace: Trace, tokens: np.ndarray, workload: str) -> Profile:
    """The profile a session that routed `tokens` (indices into `trace`, in order) would save."""
    names = [f"layer{i}" for i in range(trace.layers)]
    stats = Stats(names, trace.num_experts)
    for t in np.asarray(tokens).tolist():
        stats.tick(1)
        for layer, ids in enumerate(trace.experts[t].tolist()):
            stats.route(layer, [i for i in ids if i >= 0])
    model = {"model_type": "trace", "moe_layers": trace.layers, "experts": trace.num_experts,
             "top_k": trace.top_k, "fingerprint": "trace"}
    return Profile.of(stats, workload, model)


def fits(trace: Trace, capacity: int | float, per_layer: bool | Sequence[float] = False) -> bool:
    """Whether `capacity` holds one token's experts (see `capacity_slots`)."""
    try:
        capacity_slots(trace, capacity, per_layer)
    except ValueError:
        return False
    return True


PNG = b"\x89PNG\r\n\x1a\n"  # the first bytes of every PNG file
PNG_MARK = f"Software\0{WRITER}".encode()  # the text chunk of the plots this tool writes


def check_plot_target(path: str | Path) -> None:
    """A plot is a .png in an existing folder; an existing file is replaced only if this tool
    wrote it (`save_png` marks its PNGs; any other image is not this tool's to replace)."""
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ValueError(f"{path}: plots are written as PNG: give a .png path")
    if not path.parent.is_dir():
        raise ValueError(f"cannot write {path}: no folder {path.parent}")
    check_replaceable(path, _read_png_mark, "a plot mlx-moestream wrote")


def _read_png_mark(path: Path) -> None:
    """Raise unless the PNG's text chunks (before its image data) carry `PNG_MARK`."""
    with open_regular(path, "not a PNG") as f:
        if f.read(len(PNG)) != PNG:
            raise ValueError("not a PNG")
        while header := f.read(8):
            if len(header) < 8:
                break
            length, kind = int.from_bytes(header[:4], "big"), header[4:]
            if kind == b"IDAT" or length > 1 << 20:
                break
            data = f.read(length + 4)[:length]  # and its CRC
            if kind == b"tEXt" and data == PNG_MARK:
                return
    raise ValueError("a PNG this tool did not write")


def save_png(fig, path: str | Path) -> None:
    """Write a matplotlib figure atomically, marked as this tool's (see `check_plot_target`)."""
    check_plot_target(path)
    atomic_write(path, lambda f: fig.savefig(f, format="png", metadata={"Software": WRITER}))


def plot_sweep(results: list[dict], path: str | Path) -> bool:
    """Write hit rate against capacity, one line per policy, as a PNG at `path`.

    Returns False, writing nothing, when matplotlib is not installed."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return False
    fig = Figure(figsize=(6, 4), dpi=120)
    ax = fig.add_subplot()
    for name in dict.fromkeys(r["policy"] for r in results):
        rows = sorted((r["capacity_fraction"], r["hit_rate"]) for r in results
                      if r["policy"] == name)
        ax.plot(*zip(*rows), marker="o", label=name)
    ax.set_xlabel("capacity (fraction of all experts)")
    ax.set_ylabel("hit rate")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_png(fig, path)
    return True


def _splits(per_layer) -> bool:
    return not isinstance(per_layer, bool) or per_layer


class _Prepared:
    """A trace as the replay loop consumes it, computed once for all runs over it."""

    def __init__(self, trace: Trace):
        ids = np.sort(trace.experts.astype(np.int64), axis=2)
        valid = ids >= 0
        valid[..., 1:] &= ids[..., 1:] != ids[..., :-1]  # distinct experts of each (token, layer)
        sizes = valid.sum(axis=2)
        self.trace = trace
        flat, ends = ids[valid].tolist(), np.cumsum(sizes.ravel()).tolist()
        self.requests = [flat[a:b] for a, b in zip([0] + ends, ends)]  # token-major lists
        self.accesses = sizes.sum(axis=1)  # per token
        self.calls = int((sizes > 0).sum())  # layer calls that route to an expert
        layer = np.arange(trace.layers)[None, :, None]
        self.future = Future((layer * trace.num_experts + ids)[valid],
                             trace.layers * trace.num_experts, self.accesses)


def _cache(prepared: _Prepared, policy: PolicySpec, slots: int, per_layer, profile
           ) -> tuple[Stats, ExpertCache, str]:
    """The statistics and the (pre-warmed) cache of one replay, and the policy's name."""
    trace = prepared.trace
    layers, num_experts = trace.layers, trace.num_experts
    name = policy if isinstance(policy, str) else getattr(policy, "__name__", repr(policy))
    if isinstance(policy, str) and policy_class(policy).offline:  # it is given the trace ahead
        policy = partial(make_policy, policy, num_keys=layers * num_experts,
                         num_experts=num_experts, future=prepared.future)
    layer_slots = None
    if _splits(per_layer):
        weights = np.ones(layers) if isinstance(per_layer, bool) else per_layer
        layer_slots = split_slots(slots, weights, trace.top_k, num_experts)
    stats = Stats([f"layer{i}" for i in range(layers)], num_experts)
    cache = ExpertCache(slots, list(range(layers)), num_experts, layers, policy, layer_slots)
    if profile is not None:
        picks, _ = cache.prewarm_plan(profile, 1.0, 0.0, trace.top_k)
        for layer, expert in picks:
            cache.admit(layer, expert)
    return stats, cache, name


def _run(prepared: _Prepared, policy: PolicySpec, slots: int, per_layer, profile) -> tuple:
    """Replay once: (stats, hits per token, name of the policy)."""
    stats, cache, name = _cache(prepared, policy, slots, per_layer, profile)
    trace, layers = prepared.trace, prepared.trace.layers
    hits = np.zeros(trace.tokens, np.int64)
    request, tick, requests = cache.request, cache.tick, prepared.requests
    count, count_evictions = stats.count_request, stats.count_evictions
    for t in range(trace.tokens):
        tick(1)
        token_hits = 0
        for layer, experts in enumerate(requests[t * layers : (t + 1) * layers]):
            if len(experts):
                loads, hit, evicted = request(layer, experts)
                count(layer, hit, len(loads))
                if evicted:
                    count_evictions(evicted)
                token_hits += hit
        hits[t] = token_hits
    return stats, hits, name


def _run_ahead(prepared: _Prepared, policy: PolicySpec, slots: int, per_layer, profile,
               reads: int, read_time: float | None) -> tuple:
    """Replay once reading ahead (see `replay`): (stats, hits per token, name of the policy,
    reads ahead that a call used before their eviction, the `_Disk` or None)."""
    stats, cache, name = _cache(prepared, policy, slots, per_layer, profile)
    disk = None if read_time is None else _Disk(read_time)
    trace, layers, num_experts = prepared.trace, prepared.trace.layers, prepared.trace.num_experts
    hits = np.zeros(trace.tokens, np.int64)
    predictor = CoActivation(layers, num_experts)
    gate = Prefetch([cache] * layers, stats)
    unused: dict[int, float] = {}  # keys read ahead, resident, no call used yet: when they land
    used = 0
    requests = prepared.requests
    for t in range(trace.tokens):
        cache.tick(1)
        stats.tick(1)
        predictor.tick(1)
        token_hits = 0
        before: list[int] = []  # the experts of the latest layer this token routed to
        for layer, experts in enumerate(requests[t * layers : (t + 1) * layers]):
            gate.score(layer, experts)
            if not experts:
                before = []
                continue
            misses, hit, evicted = cache.request(layer, experts)
            stats.count_request(layer, hit, len(misses))
            stats.count_evictions(evicted)
            for key in evicted:
                unused.pop(key, None)
            token_hits += hit
            base = layer * num_experts
            landing = [unused.pop(base + e) for e in experts if base + e in unused] if unused \
                else []
            used += len(landing)
            if disk is not None:
                disk.call(landing, len(misses))
            if before:
                predictor.learn(layer - 1, before, experts)
            before = experts
            if not gate.wanted(layer):
                continue
            predicted = predictor.predict(layer, experts, reads)
            gate.reading = {base + e for e in experts}
            if gate.worth_reading(layer, predicted):
                ahead, evicted = cache.prefetch(layer + 1, predicted, gate.reading)
                stats.count_evictions(evicted)
                for key in evicted:
                    unused.pop(key, None)
                gate.ahead[layer + 1] = {e for e, _ in ahead}
                stats.prefetch_loads[layer + 1] += len(ahead)
                for e, _ in ahead:
                    unused[(layer + 1) * num_experts + e] = (0.0 if disk is None
                                                             else disk.read_ahead())
        hits[t] = token_hits
    return stats, hits, name, used, disk


class _Disk:
    """Time in layer computes on one disk that serves reads in the order asked, each taking
    `read_time`; a call waits for its reads, then computes for one, while the reads ahead it
    asks for are served."""

    def __init__(self, read_time: float):
        self.read_time = read_time
        self.clock = 0.0  # when the latest call's compute ends
        self.free = 0.0  # when the disk has served every read asked so far
        self.late = 0  # reads ahead a call waited for

    def call(self, landing: list[float], demand: int) -> None:
        """A layer call that uses reads ahead landing at `landing` and reads `demand` experts
        now: wait until all are resident, then compute."""
        ready = self.clock
        for lands in landing:
            if lands > self.clock:
                self.late += 1
                ready = max(ready, lands)
        if demand:
            self.free = max(self.free, self.clock) + demand * self.read_time
            ready = max(ready, self.free)
        self.clock = ready + 1.0

    def read_ahead(self) -> float:
        """A read asked for as the latest call's compute starts: when it lands."""
        self.free = max(self.free, self.clock - 1.0) + self.read_time
        return self.free


def _summary(prepared: _Prepared, policy, slots, per_layer, profile, window_tokens,
             prefetch_reads: int | None = None, read_time: float | None = None) -> dict:
    trace = prepared.trace
    start = time.perf_counter()
    if prefetch_reads is None:
        stats, hits, name = _run(prepared, policy, slots, per_layer, profile)
    else:
        stats, hits, name, used, disk = _run_ahead(prepared, policy, slots, per_layer,
                                                   profile, prefetch_reads, read_time)
    seconds = time.perf_counter() - start
    total = stats.as_dict()
    out = {
        "policy": name,
        "capacity": slots,
        "capacity_fraction": slots / (trace.layers * trace.num_experts),
        "per_layer": _splits(per_layer),
        "tokens": trace.tokens,
        "layers": trace.layers,
        "num_experts": trace.num_experts,
        "top_k": trace.top_k,
        "hits": total["hits"],
        "misses": total["misses"],
        "evictions": total["evictions"],
        "hit_rate": total["hit_rate"],
        "accesses_per_second": (total["hits"] + total["misses"]) / seconds,
    }
    if prefetch_reads is not None:
        loaded = int(stats.prefetch_loads.sum())
        out.update({
            "prefetch_reads": prefetch_reads,
            "reads_ahead": loaded,
            "reads_ahead_used": used,
            "reads_ahead_wasted": loaded - used,
            "prediction_precision": total["prediction_precision"],
            "prediction_recall": total["prediction_recall"],
        })
        if disk is not None:
            out.update({
                "read_time": read_time,
                "reads_ahead_late": disk.late,
                "time_per_token": disk.clock / trace.tokens,
                "stall_per_token": (disk.clock - prepared.calls) / trace.tokens,
            })
    if trace.segment_id is not None:
        out["segments"] = _segments(hits, prepared.accesses, trace.segment_id, window_tokens)
        out["recovery_tokens"] = [s["recovery_tokens"] for s in out["segments"][1:]]
    return out


def _with_baselines(result: dict, baselines: dict[str, dict]) -> dict:
    out = dict(result)
    out["lru_hit_rate"] = baselines["lru"]["hit_rate"]
    out["belady_hit_rate"] = baselines["belady"]["hit_rate"]
    if "recovery_tokens" in result:
        out["lru_recovery_tokens"] = baselines["lru"]["recovery_tokens"]
    return out


def _segments(hits: np.ndarray, accesses: np.ndarray, segment_id: np.ndarray,
              window_tokens: int) -> list[dict]:
    """Hit rate, steady state and recovery of each run of equal segment_id (see `replay`)."""
    starts = [0] + (np.flatnonzero(np.diff(segment_id)) + 1).tolist()
    ends = starts[1:] + [len(segment_id)]
    cum_hits = np.concatenate([[0], np.cumsum(hits)])
    cum_accesses = np.concatenate([[0], np.cumsum(accesses)])

    def rate(lo, hi):  # tokens [lo, hi), elementwise
        n = cum_accesses[hi] - cum_accesses[lo]
        return np.where(n > 0, (cum_hits[hi] - cum_hits[lo]) / np.maximum(n, 1), np.nan)

    segments = []
    for i, (s, e) in enumerate(zip(starts, ends)):
        steady = float(rate(s + (e - s) // 2, e))
        recovery = None
        if i > 0 and not math.isnan(steady):
            t = np.arange(s, e)
            trailing = rate(np.maximum(s, t - window_tokens + 1), t + 1)
            caught_up = np.flatnonzero(trailing >= steady - RECOVERY_POINTS)
            recovery = int(caught_up[0]) + 1 if len(caught_up) else None
        segments.append({
            "segment_id": int(segment_id[s]),
            "start_token": s,
            "tokens": e - s,
            "hit_rate": _number(rate(s, e)),
            "steady_hit_rate": _number(steady),
            "recovery_tokens": recovery,
        })
    return segments


def _number(x) -> float | None:
    """A float for JSON: None where no access made a rate."""
    return None if math.isnan(x) else float(x)
