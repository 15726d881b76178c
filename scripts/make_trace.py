"""Write a synthetic routing trace (.npz): skewed expert popularity, temporal locality and a
mid-trace switch of workload. See `mlx_moestream.trace.synthetic_trace` for how it is built.

    python scripts/make_trace.py drift.npz --tokens 4096 --layers 48 --skew 1.0 --repeat 0.1
"""

import json
import sys
from pathlib import Path

import click

# Run from a plain checkout as well as from an installed package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlx_moestream.trace import check_save_target, synthetic_trace  # noqa: E402


@click.command()
@click.argument("out", type=click.Path(dir_okay=False, writable=True))
@click.option("--tokens", type=click.IntRange(min=1), default=4096, show_default=True)
@click.option("--layers", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--experts", "num_experts", type=click.IntRange(1, 32767), default=128,
              show_default=True)
@click.option("--top-k", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--skew", type=click.FloatRange(min=0), default=1.0, show_default=True,
              help="Zipf exponent of expert popularity; 0 is uniform.")
@click.option("--repeat", type=click.FloatRange(0, 1), default=0.1, show_default=True,
              help="Chance that each of the previous token's experts is used again.")
@click.option("--switch-at", type=click.FloatRange(0, 1, min_open=True, max_open=True),
              default=0.5, show_default=True, help="Where the second workload starts.")
@click.option("--no-switch", is_flag=True, help="One workload for the whole trace.")
@click.option("--seed", type=int, default=0, show_default=True, help="Draws the workloads.")
@click.option("--sample-seed", type=int, default=None, help="Draws the tokens (default: --seed).")
def main(out, tokens, layers, num_experts, top_k, skew, repeat, switch_at, no_switch, seed,
         sample_seed):
    if top_k > num_experts:
        raise click.BadParameter(f"top-k {top_k} exceeds {num_experts} experts",
                                 param_hint="--top-k")
    try:
        check_save_target(out)  # before the trace is built, not after
        trace = synthetic_trace(tokens, layers, num_experts, top_k, skew, repeat,
                                None if no_switch else switch_at, seed, sample_seed)
        trace.save(out)
    except (ValueError, OSError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(json.dumps({
        "path": str(out),
        "tokens": trace.tokens,
        "layers": trace.layers,
        "num_experts": trace.num_experts,
        "top_k": trace.top_k,
        "switch_token": int(trace.segment_id.argmax()) if trace.segment_id.any() else None,
    }))


if __name__ == "__main__":
    main()
