"""The `inspect` command: a model's architecture, expert sizes and minimum budget."""

from __future__ import annotations

import json
import sys

import click

from ..budget import format_bytes
from .app import check_torch_model, fail, mlx_backend, model_option, torch_backend


@click.command()
@model_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--hosts", type=click.IntRange(1), default=1, show_default=True,
              help="Hosts sharing the experts (chat --distributed): the minimum budget per host.")
@click.option("--backend", type=click.Choice(["mlx", "torch"]), default="mlx", show_default=True,
              help="The backend to plan for: torch computes a layer's call at once, so its "
                   "minimum budget holds every expert of one layer.")
def inspect(model, as_json, hosts, backend):
    """Architecture, experts, bytes per expert, dense bytes and the minimum budget."""
    from ..hub import resolve_model_path

    check_torch_model(backend, model)
    if backend == "torch" and hosts > 1:
        raise click.UsageError("--hosts needs --backend mlx")
    try:
        if backend == "torch":
            plan = torch_backend().plan_of(model)
            info = {**plan.describe(), "min_budget_bytes": plan.budget_holding(),
                    "min_budget_bytes_per_layer": plan.budget_holding(per_layer=True)}
        else:
            plan = mlx_backend().load_lazy(resolve_model_path(model))[-1]
            info = plan.describe()
        if hosts > 1:
            shares = [plan.host_share(h, hosts) for h in range(hosts)]
            info["hosts"] = hosts
            info["min_budget_bytes_per_host"] = max(p.min_budget_bytes for p in shares)
    except (ValueError, OSError) as e:
        fail(e)
    if as_json:
        json.dump(info, sys.stdout, indent=2)
        click.echo()
        return
    names = {"moe_layers": "MoE layers", "top_k": "top-k", "expert_bytes": "bytes per expert",
             "all_expert_bytes": "all experts", "dense_bytes": "dense weights",
             "min_budget_bytes": "minimum budget",
             "min_budget_bytes_per_layer": "with --per-layer",
             "min_budget_bytes_per_host": "minimum per host",
             "smallest_expert_bytes": "smallest expert"}
    if "smallest_expert_bytes" in info:
        names["expert_bytes"] = "largest expert"
    for key, value in info.items():
        label = names.get(key, key.replace("_", " "))
        shown = f"{format_bytes(value)} ({value} bytes)" if "_bytes" in key else value
        click.echo(f"{label:>17}: {shown}")
