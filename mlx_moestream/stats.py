"""Cache statistics per MoE layer and in total. Plain numpy, no mlx."""

from __future__ import annotations

from bisect import bisect_left

import numpy as np

READ_SECONDS_BOUNDS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)
STALL_SECONDS_BOUNDS = (0.0, 1e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)


class Histogram:
    """Observations counted per bucket of upper bounds `bounds` (the last bucket has none),
    with their sum: what a Prometheus histogram reports."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += times
        self.sum += value * times

    def as_dict(self) -> dict:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.sum}


class Stats:
    """Counters the runtime updates on the hot path, as per-layer numpy arrays.

    One access is one distinct (layer, expert) that one forward call needs: a decode step makes
    top-k accesses per layer, a prefill call one per distinct routed expert.
    """

    def __init__(self, layer_names: list[str], num_experts: int, window_tokens: int = 32,
                 half_life_tokens: int = 256):
        n = len(layer_names)
        self.layer_names = layer_names
        self.num_experts = num_experts
        self.window_tokens = window_tokens
        self.hits = np.zeros(n, np.int64)
        self.misses = np.zeros(n, np.int64)
        self.loads = np.zeros(n, np.int64)
        # reads a call waited for because it missed; the others came at load, by pre-warm
        # or by prefetch, before any call asked for them
        self.demand_loads = np.zeros(n, np.int64)
        self.demand_bytes = np.zeros(n, np.int64)
        self.evictions = np.zeros(n, np.int64)
        self.bytes_read = np.zeros(n, np.int64)
        self.read_seconds = np.zeros(n, np.float64)
        self.stall_seconds = np.zeros(n, np.float64)  # the forward pass waiting for reads
        self.syncs = 0  # host waits: one per streamed call (its routed ids; a prediction shares it)
        # Prefetch: predicted experts vs. the routed ones, and prefetch loads that were used.
        self.predicted = np.zeros(n, np.int64)
        self.predicted_routed = np.zeros(n, np.int64)
        self.routed_scored = np.zeros(n, np.int64)
        self.prefetch_loads = np.zeros(n, np.int64)
        self.prefetch_used = np.zeros(n, np.int64)
        self.read_errors = 0  # expert reads that failed, each once (a call may fail several)
        self.read_latency = Histogram(READ_SECONDS_BOUNDS)  # seconds per read
        self.stall_per_token = Histogram(STALL_SECONDS_BOUNDS)  # each token's share of its call's
        self._stall_mark = (0.0, 0)  # stall seconds so far, tokens of the call since
        # Tokens routed to each expert, raw and halved every `half_life_tokens`: what a profile saves.
        self.activations = np.zeros((n, num_experts), np.int64)
        self.decayed = np.zeros((n, num_experts), np.float64)
        self.half_life_tokens = half_life_tokens
        self.tokens = 0
        self.windows: list[dict] = []
        self._window_mark = (0, 0, 0)  # tokens, hits, misses at the start of the open window
        self._window_activations = self.activations.copy()
        # written a few items per call, as memoryviews: half numpy's cost
        self._hits, self._misses = memoryview(self.hits), memoryview(self.misses)
        self._evictions = memoryview(self.evictions)
        self._activations = [memoryview(row) for row in self.activations]
        self._decayed = [memoryview(row) for row in self.decayed]

    def count_read(self, layer: int, nbytes: int, seconds: float, experts: int = 1) -> None:
        """Count a read of `experts` experts of `layer` (0: its experts are counted apart)."""
        self.read_seconds[layer] += seconds
        self.bytes_read[layer] += nbytes
        self.loads[layer] += experts
        self.read_latency.observe(seconds)

    def count_request(self, layer: int, hits: int, misses: int) -> None:
        """Count one call's accesses."""
        self._hits[layer] += hits
        self._misses[layer] += misses

    def count_evictions(self, keys: list[int]) -> None:
        """Each evicted key counts at its own layer (`key // num_experts`)."""
        evictions, num_experts = self._evictions, self.num_experts
        for key in keys:
            evictions[key // num_experts] += 1

    def route(self, layer: int, ids: list[int]) -> None:
        """Count the tokens routed to each expert by one call (`ids`: valid expert ids)."""
        if len(ids) > 64:  # many tokens: one numpy call
            routed = np.bincount(ids, minlength=self.num_experts)
            self.activations[layer] += routed
            self.decayed[layer] += routed
            return
        activations, decayed = self._activations[layer], self._decayed[layer]
        for i in ids:
            activations[i] += 1
            decayed[i] += 1.0

    def tick(self, tokens: int) -> None:
        """Called before `tokens` new tokens are processed: close a finished window, decay, count,
        and count the previous call's stall per token."""
        stalled, last_tokens = self._stall_mark
        if last_tokens:
            now = float(self.stall_seconds.sum())
            self.stall_per_token.observe((now - stalled) / last_tokens, last_tokens)
            stalled = now
        self._stall_mark = (stalled, tokens)
        window = self._full_window()
        if window is not None:
            self.windows.append(window)
            _, hits0, misses0 = self._window_mark
            self._window_mark = (self.tokens, hits0 + window["hits"], misses0 + window["misses"])
            self._window_activations = self.activations.copy()
        halvings = (self.tokens + tokens) // self.half_life_tokens - self.tokens // self.half_life_tokens
        if halvings:
            self.decayed *= 0.5**halvings
        self.tokens += tokens

    def _full_window(self) -> dict | None:
        """The open window once it holds `window_tokens` tokens: `tick` closes it before the
        next token, and statistics read before then show it too."""
        start, hits0, misses0 = self._window_mark
        if self.tokens - start < self.window_tokens:
            return None
        window = _window(start, self.tokens, int(self.hits.sum()) - hits0,
                         int(self.misses.sum()) - misses0)
        used = self.activations > self._window_activations
        window["unique_experts"] = used.sum(axis=1).tolist()
        return window

    def layer(self, i: int) -> dict:
        return {
            "name": self.layer_names[i],
            "hits": int(self.hits[i]),
            "misses": int(self.misses[i]),
            "loads": int(self.loads[i]),
            "demand_loads": int(self.demand_loads[i]),
            "evictions": int(self.evictions[i]),
            "bytes_read": int(self.bytes_read[i]),
            "demand_bytes_read": int(self.demand_bytes[i]),
            "read_ms": float(self.read_seconds[i] * 1e3),
            "unique_experts": int((self.activations[i] > 0).sum()),
            "hit_rate": hit_rate(self.hits[i], self.misses[i]),
            "stall_ms": float(self.stall_seconds[i] * 1e3),
            "prefetch_loads": int(self.prefetch_loads[i]),
            "prefetch_used": int(self.prefetch_used[i]),
            "prediction_precision": ratio(self.predicted_routed[i], self.predicted[i]),
            "prediction_recall": ratio(self.predicted_routed[i], self.routed_scored[i]),
        }

    def as_dict(self) -> dict:
        hits, misses = int(self.hits.sum()), int(self.misses.sum())
        full = self._full_window()
        return {
            "tokens": self.tokens,
            "hits": hits,
            "misses": misses,
            "hit_rate": hit_rate(hits, misses),
            "loads": int(self.loads.sum()),
            "demand_loads": int(self.demand_loads.sum()),
            "evictions": int(self.evictions.sum()),
            "bytes_read": int(self.bytes_read.sum()),
            "demand_bytes_read": int(self.demand_bytes.sum()),
            "read_ms": float(self.read_seconds.sum() * 1e3),
            "unique_experts": int((self.activations > 0).sum()),
            "stall_ms": float(self.stall_seconds.sum() * 1e3),
            "syncs": self.syncs,
            "syncs_per_token": self.syncs / self.tokens if self.tokens else 0.0,
            "prefetch_loads": int(self.prefetch_loads.sum()),
            "prefetch_used": int(self.prefetch_used.sum()),
            "prediction_precision": ratio(self.predicted_routed.sum(), self.predicted.sum()),
            "prediction_recall": ratio(self.predicted_routed.sum(), self.routed_scored.sum()),
            "read_errors": self.read_errors,
            "read_seconds_histogram": self.read_latency.as_dict(),
            "stall_seconds_per_token_histogram": self.stall_per_token.as_dict(),
            "hit_rate_windows": self.windows + ([full] if full else []),
            "layers": [self.layer(i) for i in range(len(self.layer_names))],
        }


def hit_rate(hits, misses) -> float:
    total = hits + misses
    return float(hits / total) if total else 0.0


def ratio(part, whole) -> float | None:
    return float(part / whole) if whole else None


def _window(start: int, end: int, hits: int, misses: int) -> dict:
    return {"start_token": start, "end_token": end, "hits": hits, "misses": misses,
            "hit_rate": hit_rate(hits, misses)}
