"""The `top` command: a live view of a running server's expert cache, from its stats endpoint."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections import deque

import click

from ..budget import format_bytes
from .app import fail

STATS_PATH = "/v1/moestream/stats"
SPARK = " ▁▂▃▄▅▆▇█"


def fetch(url: str) -> dict:
    """The server's statistics (`metrics.cache_view` of its model), or a one-line error."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + STATS_PATH, timeout=10) as reply:
            return json.loads(reply.read())
    except urllib.error.HTTPError as e:
        raise ValueError(f"{url}: HTTP {e.code} ({e.read().decode(errors='replace')})") from None
    except (urllib.error.URLError, OSError) as e:
        raise ValueError(f"{url}: no mlx-moestream server answers: "
                         f"{getattr(e, 'reason', e)}") from None


class Rates:
    """Hit rate, read MB/s and stall per token between two polls, and the hit rates so far."""

    def __init__(self, history: int = 60):
        self.previous: tuple[float, dict] | None = None
        self.hit_rates: deque[float] = deque(maxlen=history)

    def update(self, stats: dict) -> dict:
        now, rates = time.monotonic(), {"hit_rate": None, "read_mb_s": None, "stall_ms": None}
        if self.previous is not None:
            then, before = self.previous
            accesses = stats["hits"] + stats["misses"] - before["hits"] - before["misses"]
            tokens = stats["tokens"] - before["tokens"]
            if accesses:
                rates["hit_rate"] = (stats["hits"] - before["hits"]) / accesses
                self.hit_rates.append(rates["hit_rate"])
            rates["read_mb_s"] = (stats["bytes_read"] - before["bytes_read"]) / 1e6 / (now - then)
            if tokens:
                rates["stall_ms"] = (stats["stall_ms"] - before["stall_ms"]) / tokens
        self.previous = (now, stats)
        return rates


def frame(stats: dict, rates: dict, hit_rates: list[float]):
    """One screen: totals and rates, hit rate over time, per-layer table, residency heat map."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    def percent(rate):
        return "-" if rate is None else f"{rate:.1%}"

    head = Text(
        f"hit rate {stats['hit_rate']:.1%} overall, {percent(rates['hit_rate'])} now | "
        f"{stats['tokens']} tokens, {stats['loads']} loads, {stats['evictions']} evictions | "
        f"read {format_bytes(stats['bytes_read'])}"
        + ("" if rates["read_mb_s"] is None else f", {rates['read_mb_s']:.1f} MB/s")
        + " | stall per token "
        + (f"{stats['stall_ms'] / stats['tokens']:.2f} ms" if stats["tokens"] else "-")
        + ("" if rates["stall_ms"] is None else f" ({rates['stall_ms']:.2f} ms now)")
        + f"\nresident {format_bytes(stats['resident_bytes'])} of "
          f"{format_bytes(stats['budget_bytes'])} ({stats['policy']})")
    windows = [w["hit_rate"] for w in stats["hit_rate_windows"]] + hit_rates
    spark = "".join(SPARK[round(r * (len(SPARK) - 1))] for r in windows[-60:])
    prewarm = stats["prewarm"]
    lines = [head, Text(f"hit rate over time: {spark or '-'}")]
    if prewarm:
        lines.append(Text(f"pre-warmed {prewarm['experts']} experts from "
                          f"'{prewarm['profile']}', {prewarm['pinned']} pinned"))
    last = stats["hit_rate_windows"][-1] if stats["hit_rate_windows"] else None
    table = Table("layer", "hits", "misses", "hit rate", "evictions",
                  f"unique/{last['end_token'] - last['start_token']} tok" if last else "unique",
                  "warm", "pinned", "resident experts", box=None)
    for i, layer in enumerate(stats["layers"]):
        resident, pinned = set(layer["resident_experts"]), set(layer["pinned_experts"])
        cells = Text()
        for e in range(layer["num_experts"]):
            if e in resident:
                cells.append("█", style="yellow" if e in pinned else "green")
            else:
                cells.append("·", style="dim")
        table.add_row(str(i), str(layer["hits"]), str(layer["misses"]),
                      f"{layer['hit_rate']:.1%}", str(layer["evictions"]),
                      str(last["unique_experts"][i] if last else layer["unique_experts"]),
                      str(layer["warm"]), str(layer["pinned"]), cells)
    return Group(*lines, table)


@click.command()
@click.argument("url", default="http://127.0.0.1:8080")
@click.option("--interval", type=click.FloatRange(min=0.1), default=1.0, show_default=True,
              help="Seconds between polls.")
@click.option("--once", is_flag=True, help="Print one frame and exit.")
def top(url, interval, once):
    """Watch a running `serve`'s expert cache: hit rate over time, per-layer hits and unique
    experts, the experts resident in each layer, reads and stalls."""
    from rich.console import Console
    from rich.live import Live

    rates = Rates()
    try:
        stats = fetch(url)
        if once:
            Console().print(frame(stats, rates.update(stats), []))
            return
        with Live(frame(stats, rates.update(stats), []), auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                stats = fetch(url)
                live.update(frame(stats, rates.update(stats), list(rates.hit_rates)),
                            refresh=True)
    except ValueError as e:
        fail(e)
