"""`mlx-moestream`: chat with and inspect MoE models whose experts stream from disk."""

from __future__ import annotations

import json
import sys

import click

from .budget import BudgetError, format_bytes, resolve_budget


class BudgetType(click.ParamType):
    """`8GB`, `512MiB`, `35%`, `auto` or plain bytes; checked before any model is read."""

    name = "budget"

    def convert(self, value, param, ctx):
        if value is None or isinstance(value, int):
            return value
        text = str(value).strip()
        try:
            resolve_budget(text, expert_bytes=2**62, dense_bytes=0, memory_bytes=2**62)
        except BudgetError as e:
            self.fail(str(e), param, ctx)
        return int(text) if text.isdigit() else text


def _fail(e: Exception) -> None:
    raise click.ClickException(str(e))


MODEL_REQUIRED = "--model is required: give a local model directory or a Hugging Face repo id"
model_option = click.option("--model", "-m", help="Model directory or Hugging Face repo id.")


@click.group()
def main() -> None:
    """Run Mixture-of-Experts models whose experts exceed memory."""


@main.command()
@model_option
@click.option("--budget", "-b", type=BudgetType(), default="auto", show_default=True,
              help="Memory for resident experts: bytes, 8GB, 512MiB, 35% of experts, auto.")
@click.option("--policy", "-p", default="lru", show_default=True, help="Expert cache policy.")
@click.option("--prompt", help="Answer this one prompt and exit (non-interactive).")
@click.option("--max-tokens", "-n", type=click.IntRange(1), default=256, show_default=True)
@click.option("--temp", type=click.FloatRange(0), default=0.0, show_default=True,
              help="Sampling temperature; 0 is greedy.")
def chat(model, budget, policy, prompt, max_tokens, temp):
    """Chat with a model; tokens stream as generated, cache statistics follow each answer."""
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from .loader import load, stats

    if model is None:
        raise click.UsageError(MODEL_REQUIRED)
    try:
        lm, tokenizer = load(model, budget=budget, policy=policy)
    except (ValueError, FileNotFoundError) as e:
        _fail(e)
    sampler = make_sampler(temp=temp)
    history: list[dict] = []

    def answer(text: str) -> None:
        history.append({"role": "user", "content": text})
        tokens = tokenizer.apply_chat_template(history, add_generation_prompt=True)
        reply = []
        for response in stream_generate(lm, tokenizer, tokens, max_tokens=max_tokens, sampler=sampler):
            click.echo(response.text, nl=False)
            reply.append(response.text)
        click.echo()
        history.append({"role": "assistant", "content": "".join(reply)})
        click.echo(format_stats(stats(lm), response), err=False)

    if prompt is not None:
        answer(prompt)
        return
    click.echo("Type a message; an empty line or Ctrl-D ends the chat.")
    while True:
        try:
            text = input(">>> ")
        except (EOFError, KeyboardInterrupt):
            click.echo()
            break
        if not text.strip():
            break
        try:
            answer(text)
        except KeyboardInterrupt:
            click.echo("\n[interrupted]")


def format_stats(s: dict, response=None) -> str:
    """A short table: totals, then one line per MoE layer."""
    lines = []
    if response is not None:
        lines.append(
            f"[{response.prompt_tokens} prompt tokens at {response.prompt_tps:.1f} tok/s, "
            f"{response.generation_tokens} generated at {response.generation_tps:.1f} tok/s]"
        )
    lines.append(
        f"experts: hit rate {s['hit_rate']:.1%} ({s['hits']} hits, {s['misses']} misses), "
        f"{s['loads']} loads, {s['evictions']} evictions, read {format_bytes(s['bytes_read'])} "
        f"in {s['read_ms']:.0f} ms; resident {format_bytes(s['resident_bytes'])} of budget "
        f"{format_bytes(s['budget_bytes'])} ({s['policy']})"
    )
    lines.append(f"{'layer':>5} {'hits':>7} {'misses':>7} {'hit%':>6} {'evict':>7} {'unique':>6}")
    for i, layer in enumerate(s["layers"]):
        lines.append(
            f"{i:>5} {layer['hits']:>7} {layer['misses']:>7} {layer['hit_rate']:>6.1%} "
            f"{layer['evictions']:>7} {layer['unique_experts']:>6}"
        )
    return "\n".join(lines)


@main.command()
@model_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def inspect(model, as_json):
    """Architecture, experts, bytes per expert, dense bytes and the minimum budget."""
    from .loader import load_lazy, resolve_model_path

    if model is None:
        raise click.UsageError(MODEL_REQUIRED)
    try:
        plan = load_lazy(resolve_model_path(model))[-1]
    except (ValueError, FileNotFoundError) as e:
        _fail(e)
    info = plan.describe()
    if as_json:
        json.dump(info, sys.stdout, indent=2)
        click.echo()
        return
    names = {"moe_layers": "MoE layers", "top_k": "top-k", "expert_bytes": "bytes per expert",
             "all_expert_bytes": "all experts", "dense_bytes": "dense weights",
             "min_budget_bytes": "minimum budget"}
    for key, value in info.items():
        label = names.get(key, key.replace("_", " "))
        shown = f"{format_bytes(value)} ({value} bytes)" if key.endswith("bytes") else value
        click.echo(f"{label:>17}: {shown}")


if __name__ == "__main__":
    main()
