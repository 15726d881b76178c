"""Record decode routing traces of the embedded model, one per held-out text, for replay.

Each trace decodes 48 greedy tokens after each of the first 40 lines (of 20+ characters) of a
held-out text (Italian, English, Python), as a chat session of many short prompts would: the
prompt tokens and the generated ones, in order (`start_trace` / `save_trace`). 16-41 s on
a 2-core CPU.

    python scripts/record_embedded_traces.py traces-embedded
"""

from __future__ import annotations

import sys
from pathlib import Path

import click
import mlx_lm

# Run from a plain checkout as well as from an installed package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx_moestream  # noqa: E402

HELDOUT = Path(mlx_moestream.__file__).parent / "assets" / "embedded" / "heldout"


@click.command()
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--prompts", type=int, default=40, show_default=True)
@click.option("--max-tokens", type=int, default=48, show_default=True)
def main(out: Path, prompts: int, max_tokens: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = mlx_moestream.load(None, budget="100%")
    for text in sorted(HELDOUT.glob("*.txt")):
        lines = [line for line in text.read_text().splitlines() if len(line) > 20][:prompts]
        mlx_moestream.start_trace(model)
        for line in lines:
            mlx_lm.generate(model, tokenizer, line[:60], max_tokens=max_tokens)
        trace = mlx_moestream.save_trace(model, out / f"embedded-{text.stem}.npz")
        click.echo(f"{out / f'embedded-{text.stem}.npz'}: {trace.tokens} tokens")


if __name__ == "__main__":
    main()
