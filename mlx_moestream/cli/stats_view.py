"""The statistics `chat` prints after each answer, as text."""

from __future__ import annotations

from typing import Any

from ..budget import format_bytes


def format_stats(s: dict, response: Any = None, host: int | None = None) -> str:
    """A short table of a session's statistics: totals, then one line per MoE layer.

    Args:
        s: The session's statistics (`session.stats`).
        response: The answer's timing: mlx-lm's last response, or a torch answer's `Timing`.
        host: The host whose experts these are, under expert parallelism.
    """
    lines = []
    if response is not None:
        # mlx-lm times the prompt up to the first generated token
        first_ms = response.prompt_tokens / max(response.prompt_tps, 1e-9) * 1e3
        lines.append(
            f"[{response.prompt_tokens} prompt tokens at {response.prompt_tps:.1f} tok/s, "
            f"first token after {first_ms:.0f} ms, "
            f"{response.generation_tokens} generated at {response.generation_tps:.1f} tok/s]"
        )
    whose = "experts" if host is None else f"host {host} experts"
    lines.append(
        f"{whose}, session so far: hit rate {s['hit_rate']:.1%} ({s['hits']} hits, "
        f"{s['misses']} misses), {s['evictions']} evictions; "
        f"read {format_bytes(s['demand_bytes_read'])} on demand ({s['demand_loads']} experts)"
        + (f", {format_bytes(s['bytes_read'] - s['demand_bytes_read'])} ahead of use "
           f"({ahead})" if (ahead := s['loads'] - s['demand_loads']) else "")
        + f" in {s['read_ms']:.0f} ms; resident {format_bytes(s['resident_bytes'])} of budget "
        f"{format_bytes(s['budget_bytes'])} ({s['policy']})"
    )
    if s["prewarm"]:
        w = s["prewarm"]
        read = (f"{format_bytes(w['bytes'])} in {w['read_ms']:.0f} ms" if w["experts"]
                else w["why_none"])
        lines.append(f"pre-warmed {w['experts']} experts from profile '{w['profile']}' "
                     f"({read}), "
                     f"{w['pinned']} pinned; hit rate since {_percent(w['hit_rate_after'])}"
                     + ("" if w["hit_rate_before"] is None
                        else f", before it {_percent(w['hit_rate_before'])}"))
    if s["prefetch"]:
        lines.append(f"prefetch: {s['prefetch_loads']} reads, {s['prefetch_used']} used; "
                     f"prediction precision {_percent(s['prediction_precision'])}, recall "
                     f"{_percent(s['prediction_recall'])}; stalled {s['stall_ms']:.0f} ms")
    windows = s["hit_rate_windows"][-8:]
    if windows:
        lines.append("hit rate per window: " + " ".join(f"{w['hit_rate']:.0%}" for w in windows))
    lines.append(f"{'layer':>5} {'hits':>7} {'misses':>7} {'hit%':>6} {'evict':>7} {'unique':>6} "
                 f"{'warm':>5} {'pinned':>6}")
    for i, layer in enumerate(s["layers"]):
        lines.append(
            f"{i:>5} {layer['hits']:>7} {layer['misses']:>7} {layer['hit_rate']:>6.1%} "
            f"{layer['evictions']:>7} {layer['unique_experts']:>6} {layer['warm']:>5} "
            f"{layer['pinned']:>6}"
        )
    return "\n".join(lines)


def format_hosts(stats: dict) -> str:
    """One line of `mlx.host_stats`: the hosts' hit rate and reads together, then each's."""
    total = stats["combined"]
    hosts = ", ".join(f"host {i}: {h['hit_rate']:.1%} hits, "
                      f"{format_bytes(int(h['bytes_read']))} read"
                      for i, h in enumerate(stats["hosts"]))
    return (f"all {len(stats['hosts'])} hosts: hit rate {total['hit_rate']:.1%}, "
            f"{int(total['loads'])} loads, read {format_bytes(int(total['bytes_read']))} ({hosts})")


def _percent(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.1%}"
