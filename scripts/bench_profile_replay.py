"""Profiles on a real workload: pre-warming from a profile of the same workload, of another, or
not at all. Prints JSON.

The gpt-oss-20b trace has one segment per prompt, named `dataset/subject`. A profile is recorded
(`replay.trace_profile`, what a session routing those tokens saves) from every other prompt of
the workload (MMLU) and of another one (GPQA). Each held-out MMLU prompt is then replayed alone
from a cold cache, pre-warmed as `load(profile=...)` pre-warms (`ExpertCache.prewarm_plan`):
with no profile, the right one, and the wrong one. Reported per capacity and policy: the hit
rate over each prompt's first 16, 64 and 256 tokens (all prompts pooled), and
`wrong_costs_until`: the first token from which the wrong profile's hits since the start are
never fewer than the cold cache's again (0: it never cost a hit).

    python scripts/bench_profile_replay.py ../shared/traces/gptoss20b-mmlu-gpqa.npz
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
import numpy as np

# Run from a plain checkout as well as from an installed package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlx_moestream.policies import DEFAULT_POLICY  # noqa: E402
from mlx_moestream.replay import token_hits, trace_profile  # noqa: E402
from mlx_moestream.trace import Trace  # noqa: E402

HORIZON = 256


def prompts(trace: Trace, dataset: str) -> list[np.ndarray]:
    """Token indices of each prompt (segment) whose name starts with `dataset`."""
    names = trace.extras["segment_names"]
    seg = trace.segment_id
    return [np.flatnonzero(seg == i) for i, name in enumerate(names)
            if str(name).startswith(dataset) and (seg == i).any()]


def held_out_hits(trace: Trace, tests: list[np.ndarray], policy: str, capacity: float,
                  profile) -> tuple[np.ndarray, np.ndarray]:
    """Hits and accesses at each token position (0..HORIZON-1), summed over the test prompts."""
    hits, accesses = np.zeros(HORIZON), np.zeros(HORIZON)
    for tokens in tests:
        prompt = Trace(trace.experts[tokens], trace.num_experts)
        h, a = token_hits(prompt, policy, capacity, profile)
        n = min(HORIZON, len(h))
        hits[:n] += h[:n]
        accesses[:n] += a[:n]
    return hits, accesses


@click.command()
@click.argument("trace_path", type=click.Path(exists=True, dir_okay=False))
@click.option("--workload", default="mmlu", show_default=True)
@click.option("--other", default="gpqa", show_default=True)
@click.option("--capacity", "capacities", type=float, multiple=True, default=(0.1, 0.25),
              show_default=True)
@click.option("--policy", "policies", multiple=True, default=(DEFAULT_POLICY, "lru"),
              show_default=True)
def main(trace_path: str, workload: str, other: str, capacities: tuple[float, ...],
         policies: tuple[str, ...]) -> None:
    trace = Trace.load(trace_path)
    mine, theirs = prompts(trace, workload), prompts(trace, other)
    record, tests = mine[0::2], mine[1::2]
    profiles = {
        "none": None,
        "right": trace_profile(trace, np.concatenate(record), workload),
        "wrong": trace_profile(trace, np.concatenate(theirs[0::2]), other),
    }
    out = {"trace": Path(trace_path).name, "recorded_prompts": len(record),
           "test_prompts": len(tests), "wrong_profile_prompts": len(theirs[0::2]), "results": []}
    for capacity in capacities:
        for policy in policies:
            click.echo(f"{policy} at {capacity}", err=True)
            row = {"capacity": capacity, "policy": policy}
            per_token = {}
            for name, profile in profiles.items():
                hits, accesses = held_out_hits(trace, tests, policy, capacity, profile)
                per_token[name] = (hits, accesses)
                row[name] = {f"first_{n}": round(hits[:n].sum() / accesses[:n].sum(), 4)
                             for n in (16, 64, 256)}
            wrong, cold = (np.cumsum(per_token[n][0]) for n in ("wrong", "none"))
            behind = np.flatnonzero(wrong < cold)
            row["wrong_costs_until"] = int(behind[-1]) + 1 if len(behind) else 0
            out["results"].append(row)
    click.echo(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
