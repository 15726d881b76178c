"""Hit rates of every eviction policy on every routing trace in some folders. Prints JSON.

Each trace is replayed at 10%, 25% and 50% of all (layer, expert) slots, with every online
policy over one shared pool and split per layer (evenly; a split below one token's top-k in
every layer is left out), with Belady's offline optimum, and with `next-call` (the default's
rule told each layer's next call: what better prediction could win). For each trace and
capacity: `best_other`, the best of LRU, LFU and SLRU (global or per layer), and `gap_closed`
= (default - best_other) / (Belady - best_other), the share of the distance to the optimum
that the default policy covers (`gap_closed_by`: every candidate's, `next-call` included).
`accesses_per_second` is each replay's speed. `--first N` also replays each trace's first N
tokens alone (a short session from a cold cache), as `FILE first N`. `--windows N` replays up
to 64 N-token windows spread evenly over each trace, each from a cold cache, and reports under
`windows` how often each policy is more than half a point below the best of the baselines
other than itself: how often a short session could fault it by that yardstick, baselines
included.

    python scripts/record_embedded_traces.py traces-embedded
    python scripts/bench_replay.py ../shared/traces traces-embedded --markdown tables.md \
        --plot docs/caching.png
    python scripts/bench_replay.py ../shared/traces traces-embedded --first 64 --first 256 \
        --first 1024
    python scripts/bench_replay.py ../shared/traces traces-embedded --windows 64 --windows 256
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
import numpy as np

# Run from a plain checkout as well as from an installed package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlx_moestream.files import atomic_write_text  # noqa: E402
from mlx_moestream.policies import DEFAULT_POLICY  # noqa: E402
from mlx_moestream.replay import check_plot_target, fits, save_png, sweep  # noqa: E402
from mlx_moestream.trace import Trace  # noqa: E402

ONLINE = ["lru", "lfu", "slru", "wlfu", "markov", "age", DEFAULT_POLICY]
BASELINES = ["lru", "lfu", "slru"]  # what the default must beat, global or per layer
BOUNDS = ["next-call", "belady"]  # offline, one shared pool
CAPACITIES = [0.1, 0.25, 0.5]
WINDOWS_PER_TRACE = 64


def bench_trace(trace: Trace, capacities: list[float]) -> list[dict]:
    """One row per capacity: every policy's hit rate (`NAME` global, `NAME/layer` split),
    Belady's, the best baseline and the share of the gap the default closes."""
    rows = {c: {"capacity": c, "hit_rate": {}, "accesses_per_second": {}} for c in capacities}
    for per_layer in (False, True):
        usable = [c for c in capacities if fits(trace, c, per_layer)]
        for r in sweep(trace, ONLINE + ([] if per_layer else BOUNDS), usable, per_layer):
            row = rows[usable[[round(f * trace.layers * trace.num_experts) for f in usable]
                                .index(r["capacity"])]]
            name = r["policy"] + ("/layer" if per_layer else "")
            row["hit_rate"][name] = round(r["hit_rate"], 4)
            row["accesses_per_second"][name] = round(r["accesses_per_second"])
    for row in rows.values():
        rates = row["hit_rate"]
        best = max((n for n in rates if n.split("/")[0] in BASELINES), key=rates.get)
        row["best_other"] = best
        gap = rates["belady"] - rates[best]
        row["gap_closed"] = round((rates[DEFAULT_POLICY] - rates[best]) / gap, 3) if gap else None
        row["gap_closed_by"] = {  # every candidate's share, global or per layer
            n: round((rates[n] - rates[best]) / gap, 3) if gap else None
            for n in rates if n.split("/")[0] not in BASELINES + ["belady"]}
        row["vs_best_other_points"] = round(100 * (rates[DEFAULT_POLICY] - rates[best]), 2)
        row["vs_lru_points"] = round(100 * (rates[DEFAULT_POLICY] - rates["lru"]), 2)
    return list(rows.values())


def windows(trace: Trace, tokens: int) -> list[Trace]:
    """Up to WINDOWS_PER_TRACE cuts of `tokens` tokens, spread evenly, none overlapping."""
    count = min(WINDOWS_PER_TRACE, trace.tokens // tokens)
    starts = np.linspace(0, trace.tokens - tokens, count).astype(int) if count else []
    return [Trace(trace.experts[s:s + tokens], trace.num_experts) for s in starts]


def below_best_other(rows: list[dict]) -> dict:
    """Per online policy, over the `rows` (bench_trace's) that replayed it (a split per layer
    needs room for every layer's top-k): their number, the share where it is more than half a
    point below the best baseline other than itself, and its mean distance to it."""
    points: dict[str, list[float]] = {}
    for row in rows:
        rates = row["hit_rate"]
        for name in rates:
            if name not in BOUNDS:
                best = max(v for n, v in rates.items()
                           if n.split("/")[0] in BASELINES and n != name)
                points.setdefault(name, []).append(100 * (rates[name] - best))
    return {"rows": {n: len(p) for n, p in points.items()},
            "share_below_by_over_half_a_point": {
                n: round(float(np.mean(np.array(p) < -0.5)), 3) for n, p in points.items()},
            "mean_points": {n: round(float(np.mean(p)), 2) for n, p in points.items()}}


def markdown(results: dict[str, dict]) -> str:
    """One table per trace; hit rates in percent, the default's column in bold."""
    names = ONLINE + [f"{n}/layer" for n in ONLINE] + BOUNDS
    out = []
    for file, r in results.items():
        out += [f"### {file}: {r['tokens']} tokens x {r['layers']} layers, {r['num_experts']} "
                f"experts, top-{r['top_k']}", ""]
        out.append("| capacity | " + " | ".join(
            f"**{n}**" if n == DEFAULT_POLICY else n for n in names)
            + " | best other | gap closed |")
        out.append("|---" * (len(names) + 3) + "|")
        for row in r["rows"]:
            rates = row["hit_rate"]
            cells = [f"{100 * rates[n]:.1f}" if n in rates else "-" for n in names]
            cells[names.index(DEFAULT_POLICY)] = f"**{cells[names.index(DEFAULT_POLICY)]}**"
            gap = row["gap_closed"]  # a rounded int: -0.3% shows as 0%, not -0%
            gap = "-" if gap is None else f"{round(100 * gap)}%"
            out.append(f"| {round(100 * row['capacity'])}% | " + " | ".join(cells)
                       + f" | {row['best_other']} | {gap} |")
        out.append("")
    return "\n".join(out)


def plot(results: dict[str, dict], path: Path) -> bool:
    """Hit rate against capacity, one panel per trace; False when matplotlib is missing."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return False
    cols = min(3, len(results))
    rows = -(-len(results) // cols)
    fig = Figure(figsize=(5 * cols, 4 * rows), dpi=100)
    for i, (file, r) in enumerate(results.items()):
        ax = fig.add_subplot(rows, cols, i + 1)
        for name in ["lru", "lru/layer", "lfu", "slru/layer", DEFAULT_POLICY, "belady"]:
            points = [(row["capacity"], row["hit_rate"][name]) for row in r["rows"]
                      if name in row["hit_rate"]]
            if points:
                ax.plot(*zip(*points), marker="o", label=name,
                        linewidth=2.5 if name == DEFAULT_POLICY else 1.2)
        ax.set_title(file, fontsize=9)
        ax.set_xlabel("capacity (fraction of all experts)")
        ax.set_ylabel("hit rate")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, path)
    return True


@click.command()
@click.argument("folders", nargs=-1,
                type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--capacity", "capacities", type=float, multiple=True, default=CAPACITIES,
              show_default=True, help="Fractions of all (layer, expert) slots (repeatable).")
@click.option("--first", "firsts", type=click.IntRange(1), multiple=True,
              help="Also replay each trace's first N tokens alone (repeatable).")
@click.option("--windows", "window_sizes", type=click.IntRange(1), multiple=True,
              help=f"Also replay up to {WINDOWS_PER_TRACE} N-token windows of each trace, each "
                   "alone (repeatable).")
@click.option("--markdown", "markdown_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the tables as markdown here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write hit rate against capacity as a PNG here (needs matplotlib).")
def main(folders: tuple[Path, ...], capacities: tuple[float, ...], firsts: tuple[int, ...],
         window_sizes: tuple[int, ...], markdown_path: Path | None, plot_path: Path | None
         ) -> None:
    """Replay every .npz trace in FOLDERS (default: ../shared/traces beside the checkout)."""
    folders = folders or (Path(__file__).resolve().parents[2] / "shared" / "traces",)
    if plot_path:
        try:
            check_plot_target(plot_path)  # before minutes of replay, not after
        except ValueError as e:
            raise click.ClickException(str(e)) from None
    results, window_rows = {}, {n: {} for n in sorted(set(window_sizes))}
    for path in sorted(p for folder in folders for p in folder.glob("*.npz")):
        click.echo(f"replaying {path.name}", err=True)
        whole = Trace.load(path)
        cuts = [(f"{path.name} first {n}", Trace(whole.experts[:n], whole.num_experts))
                for n in sorted(set(firsts)) if n < whole.tokens]
        for name, trace in [(path.name, whole), *cuts]:
            results[name] = {"tokens": trace.tokens, "layers": trace.layers,
                             "num_experts": trace.num_experts, "top_k": trace.top_k,
                             "rows": bench_trace(trace, sorted(capacities))}
        for n, found in window_rows.items():
            found[path.name] = [row for cut in windows(whole, n)
                                for row in bench_trace(cut, sorted(capacities))]
    if not results:
        raise click.ClickException(f"no .npz trace in {', '.join(map(str, folders))}")
    rows = [row for r in results.values() for row in r["rows"]]
    gaps = [row["gap_closed"] for row in rows if row["gap_closed"] is not None]
    bound = [row["gap_closed_by"]["next-call"] for row in rows
             if row["gap_closed_by"].get("next-call") is not None]
    summary = {"default": DEFAULT_POLICY,
               "mean_gap_closed": round(sum(gaps) / len(gaps), 3) if gaps else None,
               "mean_gap_closed_by_next_call": round(sum(bound) / len(bound), 3) if bound else None,
               "worst_vs_best_other_points": min(row["vs_best_other_points"] for row in rows),
               "rows_below_best_other_by_over_half_a_point": sum(
                   row["vs_best_other_points"] < -0.5 for row in rows),
               "rows": len(rows)}
    out = {"summary": summary, "traces": results}
    if window_rows:
        out["windows"] = {
            str(n): {"all": below_best_other([row for cut in found.values() for row in cut]),
                     **{file: below_best_other(cut) for file, cut in found.items()}}
            for n, found in window_rows.items()}
    click.echo(json.dumps(out, indent=1))
    if markdown_path:
        atomic_write_text(markdown_path, markdown(results))
    if plot_path and not plot(results, plot_path):
        raise click.ClickException("--plot needs matplotlib (pip install matplotlib)")


if __name__ == "__main__":
    main()
