"""The cache's statistics as Prometheus metrics, read from the runtime at each scrape.

Nothing is counted twice: `CacheCollector` turns `session.stats` into metric families when
`/metrics` is scraped, so the hot path keeps only the runtime's own counters.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily, Metric)

from .session import runtime_of, stats

# (metric name without _total, the per-layer key of `session.stats`, help)
LAYER_COUNTERS = (
    ("moestream_hits", "hits", "Expert accesses served by a resident expert."),
    ("moestream_misses", "misses", "Expert accesses that had to read the expert."),
    ("moestream_loads", "loads", "Experts read into a slot."),
    ("moestream_demand_loads", "demand_loads", "Experts read because a call missed them."),
    ("moestream_evictions", "evictions", "Resident experts evicted to make room."),
    ("moestream_bytes_read", "bytes_read", "Bytes of experts read from disk."),
)


def cache_view(model: Any) -> dict:
    """`session.stats(model)` with each layer's experts, resident and pinned experts (from
    `Runtime.state`): what `/v1/moestream/stats` serves and `top` draws."""
    runtime = runtime_of(model)
    out, state = stats(model), runtime.state()
    for i, layer in enumerate(out["layers"]):
        layer["num_experts"] = runtime.plan.layers[i].num_experts
        layer["resident_experts"] = sorted(state.resident[i])
        layer["pinned_experts"] = sorted(state.pinned[i])
    return out


class CacheCollector:
    """Metric families of the served model's cache, or none while it loads.

    Args:
        model: Returns the model once loaded, else None.
    """

    def __init__(self, model: Callable[[], Any]):
        self.model = model

    def collect(self) -> Iterator[Metric]:
        model = self.model()
        if model is None:
            return
        s = stats(model)
        for name, key, text in LAYER_COUNTERS:
            family = CounterMetricFamily(name, text, labels=["layer"])
            for i, layer in enumerate(s["layers"]):
                family.add_metric([str(i)], layer[key])
            yield family
        yield CounterMetricFamily("moestream_tokens", "Tokens the model processed (prompt and "
                                  "generated).", value=s["tokens"])
        yield CounterMetricFamily("moestream_read_errors", "Expert reads that failed.",
                                  value=s["read_errors"])
        yield GaugeMetricFamily("moestream_resident_bytes", "Bytes of resident experts.",
                                value=s["resident_bytes"])
        yield GaugeMetricFamily("moestream_budget_bytes", "The budget for resident experts.",
                                value=s["budget_bytes"])
        yield _histogram("moestream_expert_read_seconds", "Seconds one expert read took.",
                         s["read_seconds_histogram"])
        yield _histogram("moestream_stall_seconds_per_token",
                         "Seconds each token's forward pass waited for expert reads.",
                         s["stall_seconds_per_token_histogram"])


def _histogram(name: str, text: str, h: dict) -> HistogramMetricFamily:
    """A histogram family of `Histogram.as_dict`'s per-bucket counts, made cumulative."""
    buckets, total = [], 0
    for bound, count in zip([*h["bounds"], float("inf")], h["counts"]):
        total += count
        buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), total))
    return HistogramMetricFamily(name, text, buckets=buckets, sum_value=h["sum"])
