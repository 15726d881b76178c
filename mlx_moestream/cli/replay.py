"""The `replay` command: a recorded routing trace through the cache policies, offline."""

from __future__ import annotations

import json

import click

from ..policies import DEFAULT_POLICY
from .app import fail, finite
from .profile import load_profile


def _capacity(text: str) -> int | float:
    """A slot count (`512`) or a fraction of all slots (`0.25`)."""
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            raise click.BadParameter(f"'{text}' is neither a slot count nor a fraction") from None


@click.command()
@click.argument("trace_path", metavar="TRACE", type=click.Path(exists=True, dir_okay=False))
@click.option("--policy", "-p", default=DEFAULT_POLICY, show_default=True,
              help="A policy, with options as NAME:OPTION=VALUE,... (cyclic:half_life=128).")
@click.option("--capacity", "-c", default="0.25", show_default=True,
              help="(layer, expert) slots, or a fraction of all of them (0.25).")
@click.option("--per-layer", is_flag=True, help="Split the slots evenly per layer.")
@click.option("--profile", "profile_name", help="Seed the policy with this profile's counts.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--sweep", is_flag=True, help="Every policy over a range of capacities.")
@click.option("--plot", type=click.Path(dir_okay=False), help="With --sweep: write a PNG plot.")
@click.option("--prefetch", is_flag=True,
              help="Read each next layer's predicted experts ahead; count what it saves.")
@click.option("--prefetch-reads", type=click.IntRange(1), metavar="N",
              help="With --prefetch: most reads ahead per layer call.  [default: top-k]")
@click.option("--read-time", type=click.FloatRange(0, min_open=True), callback=finite,
              metavar="R", help="With --prefetch: time one expert's read as R layer computes "
                                "on one disk; report the time per token with and without.")
def replay(trace_path, policy, capacity, per_layer, profile_name, as_json, sweep, plot, prefetch,
           prefetch_reads, read_time):
    """Replay a routing trace through the runtime's cache policies; compare with LRU and Belady."""
    from .. import replay as rp
    from ..policies import POLICIES
    from ..trace import Trace

    if plot and not sweep:
        raise click.UsageError("--plot draws the --sweep: give both")
    if prefetch_reads is not None and not prefetch:
        raise click.UsageError("--prefetch-reads limits --prefetch: give both")
    if read_time is not None and not prefetch:
        raise click.UsageError("--read-time times --prefetch: give both")
    if prefetch and sweep:
        raise click.UsageError("--prefetch replays one policy at one capacity: not with --sweep")
    try:
        if plot:  # checked before the sweep, not found unwritable after it
            rp.check_plot_target(plot)
        trace = Trace.load(trace_path)
        profile = None
        if profile_name:
            profile = load_profile(profile_name)
            profile.check_shape({"moe_layers": trace.layers, "experts": trace.num_experts},
                                target="the trace")
        if sweep:  # the capacities that hold one token's experts
            capacities = [c for c in (0.05, 0.1, 0.25, 0.5, 0.75, 1.0)
                          if rp.fits(trace, c, per_layer)]
            results = rp.sweep(trace, sorted(POLICIES), capacities or [1.0], per_layer, profile)
        else:
            reads = (prefetch_reads or trace.top_k) if prefetch else None
            results = [rp.replay(trace, policy, _capacity(capacity), per_layer, profile,
                                 prefetch_reads=reads, read_time=read_time)]
    except ValueError as e:
        fail(e)
    if plot and not rp.plot_sweep(results, plot):
        fail(RuntimeError("--plot needs matplotlib (pip install matplotlib): no plot written"))
    if as_json:
        click.echo(json.dumps(results if sweep else results[0], indent=2))
        return
    click.echo(f"{'policy':>8} {'slots':>7} {'hit rate':>9} {'lru':>7} {'belady':>7} "
               f"{'evictions':>10}")
    for r in results:
        click.echo(f"{r['policy']:>8} {r['capacity']:>7} {r['hit_rate']:>9.2%} "
                   f"{r['lru_hit_rate']:>7.2%} {r['belady_hit_rate']:>7.2%} {r['evictions']:>10}")
    if prefetch:
        r = results[0]
        click.echo(f"prefetch: up to {r['prefetch_reads']} reads ahead per layer call; hit rate "
                   f"{r['hit_rate_without_prefetch']:.2%} without; demand misses "
                   f"{r['misses_without_prefetch']} -> {r['misses']} ({r['misses_saved']:.1%} "
                   f"saved); {r['reads_ahead']} reads ahead, {r['reads_ahead_used']} used, "
                   f"{r['reads_ahead_wasted']} wasted")
        if read_time is not None:
            click.echo(f"time per token at {read_time:g} layer computes per read: "
                       f"{r['time_per_token_without_prefetch']:.2f} without, "
                       f"{r['time_per_token']:.2f} with ({r['speedup']:.3f}x); "
                       f"{r['reads_ahead_late']} reads ahead landed late")
