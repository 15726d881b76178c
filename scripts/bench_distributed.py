"""Expert parallelism: decode tok/s of 1 host at budget B and of 2 hosts at B each, in one run.
Prints JSON.

The model is a random qwen3_moe built locally (default 8 layers of 64 experts, top-8, hidden
1024). Host runs are `mlx.launch --backend ring -n 2` on this machine (127.0.0.1), so the
"link" is loopback and both hosts share this machine's cores and disk: the run shows what the
exchange costs and what twice the cache buys, not two machines' compute. Each MoE layer call
exchanges its per-expert outputs, `tokens x k x hidden x dtype size` bytes (`exchange_bytes_per_token`
for one decode token over all MoE layers); `all_sum_ms` is one layer's exchange measured alone,
the input of the link model in docs/distributed.md.

    python scripts/bench_distributed.py --budget 25%
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

# Run from a plain checkout as well as from an installed package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def decode(path: str, budget: str, tokens: int, distributed: bool) -> dict:
    """Greedy decode after a short prompt; tok/s of the decode and the session's statistics."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    import mlx_moestream

    model, _ = mlx_moestream.load(path, budget=budget, distributed=distributed)
    cache = make_prompt_cache(model)
    token = mx.argmax(model(mx.array(np.arange(3, 19)[None]), cache=cache)[:, -1], axis=-1)
    mx.eval(token)
    start = time.perf_counter()
    for _ in range(tokens):
        token = mx.argmax(model(token[:, None], cache=cache)[:, -1], axis=-1)
        mx.eval(token)
    seconds = time.perf_counter() - start
    stats = mlx_moestream.stats(model)
    out = {"tok_s": tokens / seconds, "ms_per_token": seconds / tokens * 1e3,
           "hit_rate": stats["hit_rate"], "bytes_read": stats["bytes_read"]}
    if distributed:
        hosts = mlx_moestream.host_stats(model)
        out.update(hit_rate=hosts["combined"]["hit_rate"],
                   bytes_read=hosts["combined"]["bytes_read"],
                   all_sum_ms=_all_sum_ms(model))
    return out


def _all_sum_ms(model, rounds: int = 200) -> float:
    """One decode token's exchange of one MoE layer, [1, 1, k, hidden], timed alone."""
    import mlx.core as mx

    runtime = model.moestream
    hidden = model.args.hidden_size
    payload = mx.zeros((1, 1, runtime.plan.top_k, hidden), mx.float32)
    mx.eval(mx.distributed.all_sum(payload))
    start = time.perf_counter()
    for _ in range(rounds):
        mx.eval(mx.distributed.all_sum(payload))
    return (time.perf_counter() - start) / rounds * 1e3


@click.command()
@click.option("--budget", default="25%", show_default=True,
              help="B, a share of all the model's experts; each of two hosts gets as many bytes.")
@click.option("--tokens", type=int, default=64, show_default=True)
@click.option("--layers", type=int, default=8, show_default=True)
@click.option("--experts", type=int, default=64, show_default=True)
@click.option("--hidden", type=int, default=1024, show_default=True)
@click.option("--worker", type=click.Path(), hidden=True, help="Run as one host of mlx.launch.")
def main(budget: str, tokens: int, layers: int, experts: int, hidden: int, worker: str | None):
    if worker:
        out = decode(worker, budget, tokens, distributed=True)
        import mlx.core as mx

        if mx.distributed.init().rank() == 0:
            print(json.dumps(out), flush=True)
        return
    from mlx_moestream.testing import make_tiny_moe

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_moe(Path(tmp) / "model", "qwen3_moe", num_layers=layers,
                             num_experts=experts, top_k=8, hidden_size=hidden,
                             moe_intermediate_size=hidden // 2)
        one = decode(str(path), budget, tokens, distributed=False)
        launched = subprocess.run(
            [shutil.which("mlx.launch"), "--backend", "ring", "-n", "2", "--", sys.executable,
             __file__, "--worker", str(path), "--budget", _half(budget), "--tokens", str(tokens)],
            capture_output=True, text=True, timeout=1800)
        results = [l for l in launched.stdout.splitlines() if l.startswith("{")]
        if launched.returncode or not results:  # mlx.launch exits 0 when a host fails
            raise click.ClickException(f"the two-host run failed: {launched.stderr[-2000:]}")
        two = json.loads(results[-1])
    exchange = layers * 8 * hidden * 4
    click.echo(json.dumps({
        "model": {"layers": layers, "experts": experts, "top_k": 8, "hidden": hidden},
        "budget_per_host": budget,
        "one_host": one,
        "two_hosts": two,
        "tok_s_ratio_two_over_one": two["tok_s"] / one["tok_s"],
        "exchange_bytes_per_token": exchange,
        "exchange_bytes_per_token_per_layer": exchange // layers,
    }, indent=1))


def _half(budget: str) -> str:
    """The same bytes B as a share of one host's experts (half of them): a host's budget is
    a share of its own experts, all of them from B = 50% on."""
    return f"{min(float(budget[:-1]) * 2, 100):g}%" if budget.endswith("%") else budget


if __name__ == "__main__":
    main()
