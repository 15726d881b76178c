"""Pre-warm from a profile: its hottest experts read into free slots, the hottest pinned.

The profile's decayed counts seed the policies, so these experts are pinned softly: their
seeded counts decay like live ones. Pins (`pin_share`) leave their policies for good. The
caches choose what to read and pin (`ExpertCache.prewarm_plan`), as trace replay does; this
module reads them and keeps the record that `stats()["prewarm"]` shows.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Callable, Iterable

import numpy as np

from .cache import ExpertCache
from .errors import ClosedError
from .interrupts import CRITICAL
from .profiles import Profile
from .reads import Reads
from .stats import ratio


class Prewarmer:
    """The pre-warms of one model: the experts each layer got from them, and the latest's record.

    Args:
        caches: the model's caches, one per slot pool.
        layer_cache: each layer's cache.
        reads: reads an expert now, counted, into the slot its cache gave.
        call_experts: the most distinct experts one call of a layer must hold: pins leave
            room for them.
        closed: whether the model was closed (by another thread): the reads stop there.
    """

    def __init__(self, caches: list[ExpertCache], layer_cache: list[ExpertCache], reads: Reads,
                 call_experts: int, closed: Callable[[], bool]):
        self.caches = caches
        self.layer_cache = layer_cache
        self.reads = reads
        self.call_experts = call_experts
        self.closed = closed
        self.warm = np.zeros(len(layer_cache), np.int64)  # experts pre-warmed per layer
        self.record: dict | None = None  # the latest pre-warm's

    def run(self, profile: Profile, share: float, pin_share: float,
            progress: Callable | None = None) -> dict:
        """Read `profile`'s hottest experts into free slots (up to `share` of each pool) in
        file order, and pin the hottest `pin_share` of each pool once resident.

        Callers hold the model's lock, with no read in flight: a pin must not take an expert
        whose read may yet fail. `progress(items, label)` is a context manager wrapping the
        reads. Returns the pre-warm's record.
        """
        picks, pins = [], []
        for cache in self.caches:
            hot, pinned = cache.prewarm_plan(profile, share, pin_share, self.call_experts)
            picks += hot
            pins += pinned
        picks.sort()  # layer by layer, expert by expert: the order of the stacked tensors
        start = time.perf_counter()
        context = progress(picks, f"pre-warm {profile.workload}") if progress else nullcontext(picks)
        with context as items:
            loaded, nbytes = self._read(items)
        pins = [(l, e) for l, e in pins if self.layer_cache[l].slot_of[l, e] >= 0]  # got a slot
        with CRITICAL:  # a pin cut short would leave its expert out of its policy, unpinned
            for layer, expert in pins:
                self.layer_cache[layer].pin(layer, expert)
        stats = self.reads.stats
        self.record = {"profile": profile.workload, "experts": loaded,
                       "why_none": None if loaded else self._why_none(share, picks),
                       "pinned": len(pins),
                       "bytes": nbytes, "read_ms": (time.perf_counter() - start) * 1e3,
                       "at_token": stats.tokens, "hits_before": int(stats.hits.sum()),
                       "misses_before": int(stats.misses.sum())}
        return self.record

    def _read(self, picks: Iterable[tuple[int, int]]) -> tuple[int, int]:
        """Read each (layer, expert) that still gets a free slot; returns (experts, bytes)."""
        loaded = nbytes = 0
        for layer, expert in picks:
            if self.closed():  # by another thread, meanwhile: the store must stay closed
                raise ClosedError()
            cache = self.layer_cache[layer]
            with CRITICAL:  # a read counted as a load is counted as warm in the same step
                slot = cache.admit(layer, expert)
                if slot is None:
                    continue
                nbytes += self.reads.read_now(layer, expert, slot)
                self.warm[layer] += 1
                loaded += 1
        return loaded, nbytes

    def _why_none(self, share: float, picks: list) -> str:
        """Why a pre-warm read no expert, for a user who expected it to."""
        if all(cache.holds_all for cache in self.caches):
            return "every expert is resident at this budget, read at load"
        if picks:
            return "no slot was free for its experts"
        if share <= 0:
            return "its share of the budget is 0"
        if not any(cache.free for cache in self.caches):
            return "no free slot: the session's experts fill the budget"
        return "its hottest experts are resident already"

    def effect(self, hits: int, misses: int) -> dict | None:
        """The latest record with the hit rates of the accesses before it and since, given
        the accesses so far; None before any pre-warm."""
        if self.record is None:
            return None
        h0, m0 = self.record["hits_before"], self.record["misses_before"]
        return {**self.record, "hit_rate_before": ratio(h0, h0 + m0),
                "hit_rate_after": ratio(hits - h0, hits - h0 + misses - m0)}
