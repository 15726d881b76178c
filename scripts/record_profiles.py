"""Record the embedded model's workload profiles and measure what they do to the hit rate.

Each held-out text (mlx_moestream/assets/embedded/heldout/) is split: the first two thirds are
run through the model to record `profiles/{italian-chat,english-chat,python-code}.json`, the
last third is the evaluation prompt. Evaluation feeds the prompt one token at a time (as decode
does) at a budget of 30% of expert bytes, once with no profile and once with each profile, and
reports the hit rate over the first 64 tokens, over all `--tokens`, and how many tokens it
takes a run to recover: the first token t at which the hit rate of the trailing 32 tokens
reaches the no-profile run's steady state (its hit rate over the second half) minus 2 points.
It also measures a workload switch (Italian, then Python, in one session). Prints JSON; `--markdown FILE` also rewrites the profiles section of that file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import click
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

import mlx_moestream
from mlx_moestream.hub import EMBEDDED_MODEL
from mlx_moestream.files import atomic_write_text
from mlx_moestream.policies import DEFAULT_POLICY

PROFILES = {"italian-chat": "italian", "english-chat": "english", "python-code": "python"}
WINDOW = 32


def split(workload: str) -> tuple[str, str]:
    """(text to record the profile from, held-out prompt to evaluate on)."""
    text = (EMBEDDED_MODEL / "heldout" / f"{workload}.txt").read_text(encoding="utf-8")
    cut = 2 * len(text) // 3
    return text[:cut], text[cut:]


def record(out_dir: Path) -> None:
    for name, workload in PROFILES.items():
        model, tokenizer = mlx_moestream.load(budget="100%")
        mlx_moestream.run_text(model, tokenizer, split(workload)[0])
        mlx_moestream.save_profile(model, out_dir / f"{name}.json", workload=name)


def hits_per_token(profile: str | None, ids: list[int], budget: str,
                   policy: str = DEFAULT_POLICY) -> np.ndarray:
    """Hit rate of each decoded token (over all layers' accesses of that token)."""
    model, _ = mlx_moestream.load(budget=budget, profile=profile, policy=policy)
    cache = make_prompt_cache(model)
    rates = []
    for token in ids:
        before = mlx_moestream.stats(model)
        mx.eval(model(mx.array([[token]]), cache=cache))
        after = mlx_moestream.stats(model)
        hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
        rates.append(hits / (hits + misses))
    return np.array(rates)


def recovery(rates: np.ndarray, steady: float) -> int | None:
    for t in range(len(rates)):
        if rates[max(0, t - WINDOW + 1) : t + 1].mean() >= steady - 0.02 and t + 1 >= WINDOW:
            return t + 1
    return None


def evaluate(profile_dir: Path, tokens: int, budget: str) -> list[dict]:
    _, tokenizer = mlx_moestream.load(budget="100%")
    rows = []
    for workload in PROFILES.values():
        ids = tokenizer.encode(split(workload)[1])[:tokens]
        base = hits_per_token(None, ids, budget)
        steady = float(base[len(base) // 2 :].mean())
        for name in (None, *PROFILES):
            rates = base if name is None else hits_per_token(profile_dir / f"{name}.json", ids,
                                                             budget)
            rows.append({
                "prompt": workload, "profile": name or "none", "tokens": len(ids),
                "hit_rate_first_64": float(rates[:64].mean()),
                "hit_rate": float(rates.mean()),
                "steady_hit_rate": steady,
                "recovery_tokens": recovery(rates, steady),
            })
    return rows


def switch(tokens: int, budget: str) -> list[dict]:
    """One session reads the Italian prompt, then the Python one: tokens until the hit rate
    after the switch reaches the steady state of a session that read only Python."""
    _, tokenizer = mlx_moestream.load(budget="100%")
    italian = tokenizer.encode(split("italian")[1])[:tokens]
    python = tokenizer.encode(split("python")[1])[:tokens]
    rows = []
    for policy in (DEFAULT_POLICY, "wlfu", "lru"):
        alone = hits_per_token(None, python, budget, policy)
        steady = float(alone[len(alone) // 2 :].mean())
        after = hits_per_token(None, italian + python, budget, policy)[len(italian) :]
        rows.append({"policy": policy, "steady_hit_rate": steady,
                     "hit_rate_after_switch": float(after.mean()),
                     "recovery_tokens": recovery(after, steady)})
    return rows


def markdown(rows: list[dict], switches: list[dict], budget: str) -> str:
    lines = [
        f"Budget {budget} of expert bytes, policy {DEFAULT_POLICY} (the default); prompts are "
        "the last third of each held-out text, "
        "decoded one token at a time; profiles are recorded from the first two thirds "
        "(`python scripts/record_profiles.py --markdown docs/embedded-model.md`). Recovery: "
        f"tokens until the trailing-{WINDOW}-token hit rate reaches the no-profile steady state "
        "minus 2 points.",
        "",
        "| prompt | profile | hit rate, first 64 tokens | hit rate, all | recovery tokens |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['prompt']} | {r['profile']} | {r['hit_rate_first_64']:.1%} | "
                     f"{r['hit_rate']:.1%} | {r['recovery_tokens']} |")
    lines += [
        "",
        "Workload switch: one session decodes the Italian prompt, then the Python one, with no "
        "profile. Recovery counts the Python tokens until the trailing hit rate reaches the "
        "steady state of a session that decoded only Python.",
        "",
        "| policy | steady hit rate (Python alone) | hit rate after the switch | recovery tokens |",
        "|---|---|---|---|",
    ]
    for r in switches:
        lines.append(f"| {r['policy']} | {r['steady_hit_rate']:.1%} | "
                     f"{r['hit_rate_after_switch']:.1%} | {r['recovery_tokens']} |")
    return "\n".join(lines)


@click.command()
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("profiles"), show_default=True)
@click.option("--tokens", default=256, show_default=True, help="Prompt tokens evaluated.")
@click.option("--budget", default="30%", show_default=True)
@click.option("--markdown", "markdown_path", type=click.Path(dir_okay=False, path_type=Path))
def main(out_dir: Path, tokens: int, budget: str, markdown_path: Path | None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    record(out_dir)
    rows = evaluate(out_dir, tokens, budget)
    switches = switch(tokens, budget)
    click.echo(json.dumps({"profiles": rows, "switch": switches}, indent=2))
    if markdown_path:
        doc = markdown_path.read_text(encoding="utf-8") if markdown_path.exists() else ""
        section = (f"<!-- profiles:start -->\n{markdown(rows, switches, budget)}\n"
                   "<!-- profiles:end -->")
        if "<!-- profiles:start -->" in doc:
            doc = re.sub(r"<!-- profiles:start -->.*<!-- profiles:end -->", lambda _: section,
                         doc, flags=re.S)
        else:
            doc += f"\n## Profiles\n\n{section}\n"
        atomic_write_text(markdown_path, doc)


if __name__ == "__main__":
    main()
