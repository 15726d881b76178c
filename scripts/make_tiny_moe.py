"""Write a tiny random-weight MoE model directory for tests and benchmarks, without downloads.

    python scripts/make_tiny_moe.py OUT --arch qwen3_moe --bits 4 --set num_experts=64
"""

import json
import sys
from pathlib import Path

import click

# Run from a plain checkout as well as from an installed package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlx_moestream.testing import ARCHITECTURES, make_tiny_moe  # noqa: E402


def _parse_override(text: str) -> tuple[str, object]:
    """`key=value`, with the value read as JSON so numbers, booleans and lists keep their type."""
    key, sep, value = text.partition("=")
    if not sep:
        raise click.BadParameter(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


@click.command()
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--arch", type=click.Choice(ARCHITECTURES), default="qwen3_moe", show_default=True)
@click.option(
    "--layout", type=click.Choice(["stacked", "per_expert"]), default="stacked", show_default=True
)
@click.option("--bits", type=click.Choice(["4", "8"]), default=None, help="Quantize the weights.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--shards", type=int, default=1, show_default=True)
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Config override, e.g. num_experts=64, top_k=4, num_layers=4 (repeatable).",
)
def main(out, arch, layout, bits, seed, shards, overrides):
    try:
        path = make_tiny_moe(
            out,
            arch,
            layout=layout,
            bits=None if bits is None else int(bits),
            seed=seed,
            shards=shards,
            **dict(_parse_override(o) for o in overrides),
        )
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    size_bytes = sum(f.stat().st_size for f in path.iterdir())
    click.echo(f"{path}\t{size_bytes} bytes")


if __name__ == "__main__":
    main()
