"""Time to first token of a long prompt under a budget, against stock mlx-lm, in one run. Prints
JSON.

The model has Qwen3-30B-A3B's layer shape (built once by `bench_decode.build_model`, random
weights). Stock mlx-lm is loaded (every weight read) and warmed up; its time to first token is
the median of --repeats prompts. Each budget is loaded fresh --repeats times, the model's files
dropped from the page cache first, so the prompt's experts are read cold from the disk while it
is processed: a prompt of --prompt-tokens routes to nearly every expert of every layer. The time
to first token is that of `mlx_lm.generate.generate_step` (prefill, then the first token).

    python scripts/bench_prompt.py --budgets 50,25
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import click
import mlx.core as mx
import mlx_lm
import numpy as np
from mlx_lm.generate import generate_step

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx_moestream  # noqa: E402
from bench_decode import build_model, drop_page_cache, model_files  # noqa: E402


def first_token(model, prompt: mx.array, forward: bool = False) -> tuple[int, float]:
    """The first greedy token after `prompt`, and the seconds it took: by `generate_step`, or,
    with `forward`, by one forward call over the whole prompt whose logits are all evaluated."""
    start = time.perf_counter()
    if forward:
        logits = model(prompt[None])
        mx.eval(logits)
        token = mx.argmax(logits[0, -1]).item()
    else:
        token, _ = next(generate_step(prompt, model, max_tokens=1))
    return int(token), time.perf_counter() - start


def counters(model) -> dict:
    s = mlx_moestream.stats(model)
    return {k: s[k] for k in ("hits", "misses", "loads", "bytes_read", "syncs")} | {
        "stall_s": round(sum(layer["stall_ms"] for layer in s["layers"]) / 1e3, 3)}


@click.command()
@click.option("--model-dir", default="/tmp/bench-work/qwen3-30b-layer", show_default=True,
              type=click.Path(path_type=Path))
@click.option("--layers", default=4, show_default=True)
@click.option("--prompt-tokens", default=512, show_default=True)
@click.option("--budgets", default="50,25", show_default=True, help="Percentages.")
@click.option("--repeats", default=3, show_default=True)
@click.option("--forward", is_flag=True,
              help="Time one forward call with every logit evaluated, not generate_step (which "
                   "evaluates only the KV cache of all but the last prompt token, so MLX skips "
                   "the last layer's MoE for them: see docs/benchmarks.md).")
def main(model_dir: Path, layers: int, prompt_tokens: int, budgets: str, repeats: int,
         forward: bool) -> None:
    shape = {"layers": layers, "hidden": 2048, "experts": 128, "top_k": 8,
             "moe_intermediate": 768, "bits": 4}
    path = build_model(model_dir, shape)
    prompt = mx.array(np.random.default_rng(0).integers(3, 500, prompt_tokens))
    load = os.getloadavg()[0]
    stock, _ = mlx_lm.load(str(path))
    first_token(stock, prompt[:64], forward)  # warm-up
    runs = [first_token(stock, prompt, forward) for _ in range(repeats)]
    expected, stock_s = runs[0][0], statistics.median(t for _, t in runs)
    del stock
    gc.collect()
    results = []
    for budget in (float(b) for b in budgets.split(",")):
        times, stats = [], None
        for _ in range(repeats):
            for file in model_files(path):
                drop_page_cache(file)
            model, _ = mlx_moestream.load(path, budget=f"{budget:g}%")
            token, seconds = first_token(model, prompt, forward)
            times.append(seconds)
            stats = counters(model)
            if token != expected:
                raise click.ClickException(f"{budget:g}%: first token {token}, stock {expected}")
            model.moestream.close()
            del model
            gc.collect()
        seconds = statistics.median(times)
        results.append({"budget_percent": budget, "seconds": [round(t, 3) for t in times],
                        "ratio": round(seconds / stock_s, 3), "first_prompt_stats": stats})
    click.echo(json.dumps({
        "model": shape, "prompt_tokens": prompt_tokens, "repeats": repeats,
        "timed": "forward" if forward else "generate_step",
        "load_average": [round(load, 2), round(os.getloadavg()[0], 2)],
        "stock_seconds": round(stock_s, 3), "budgets": results,
    }, indent=1))


if __name__ == "__main__":
    main()
