"""Requests/s and tokens/s of stock `mlx_lm.server` and `mlx-moestream serve` on one model.

Starts each server in turn on a free port (stock; serve at each --budgets), sends one warm-up
request, then, for 1 and 4 concurrent clients (the real `openai` client, one thread each), each
client sends --requests greedy chat requests of --max-tokens tokens (prompts in turn, so
concurrent clients batch). Reports per server and concurrency the wall time, requests/s and
generated tokens/s, and serve's ratios to stock. Prints one JSON document.
"""

from __future__ import annotations

import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click
import openai

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from mlx_moestream.hub import EMBEDDED_MODEL  # noqa: E402

PROMPTS = ["Ciao, come stai?", "Tell me about the sea.", "def main():", "Dove si trova Roma?",
           "Write a short story.", "Che tempo fa oggi?", "import numpy as np", "Hello there!"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], port: int, log: Path) -> subprocess.Popen:
    """A server process, once it answers /v1/models."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(log, "w"), env=env)
    for _ in range(1200):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5).read()
            return process
        except OSError:
            if process.poll() is not None:
                raise click.ClickException(f"{args}: {log.read_text()[-2000:]}")
            time.sleep(0.1)
    raise click.ClickException(f"{args} never answered")


def run_clients(client: openai.OpenAI, clients: int, requests: int, max_tokens: int) -> dict:
    """`clients` threads each sending `requests` requests; their throughput together."""

    def one_client(c: int) -> int:
        tokens = 0
        for r in range(requests):
            reply = client.chat.completions.create(
                model="default_model", max_tokens=max_tokens, temperature=0,
                messages=[{"role": "user", "content": PROMPTS[(c + r) % len(PROMPTS)]}])
            tokens += reply.usage.completion_tokens
        return tokens

    start_time = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        tokens = sum(pool.map(one_client, range(clients)))
    seconds = time.perf_counter() - start_time
    return {"clients": clients, "requests": clients * requests, "tokens": tokens,
            "seconds": round(seconds, 3),
            "requests_per_s": round(clients * requests / seconds, 3),
            "tokens_per_s": round(tokens / seconds, 2)}


def measure(args: list[str], requests: int, max_tokens: int, work: Path, name: str) -> dict:
    port = free_port()
    process = start([*args, "--port", str(port)], port, work / f"{name}.log")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0, timeout=600)
        run_clients(client, 1, 1, max_tokens)  # warm-up: compiled kernels, first reads
        return {str(c): run_clients(client, c, requests, max_tokens) for c in (1, 4)}
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=60)


@click.command()
@click.option("--model", default=str(EMBEDDED_MODEL), show_default=True,
              help="An mlx-lm MoE model directory (default: the embedded model).")
@click.option("--budgets", default="100%,30%", show_default=True, help="serve's budgets.")
@click.option("--requests", default=4, show_default=True, help="Requests per client.")
@click.option("--max-tokens", default=64, show_default=True)
def main(model, budgets, requests, max_tokens):
    """Print the throughput of stock and of serve at each budget as JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        results = {"stock": measure([sys.executable, "-m", "mlx_lm", "server", "--model", model,
                                     "--log-level", "WARNING"],
                                    requests, max_tokens, work, "stock")}
        for budget in budgets.split(","):
            results[f"serve {budget}"] = measure(
                [sys.executable, "-m", "mlx_moestream", "serve", "--model", model,
                 "--budget", budget], requests, max_tokens, work, re.sub(r"\W", "", budget))
    stock = results["stock"]
    ratios = {name: {c: {k: round(r[c][k] / stock[c][k], 3)
                         for k in ("requests_per_s", "tokens_per_s")} for c in r}
              for name, r in results.items() if name != "stock"}
    print(json.dumps({"model": model, "machine": platform.platform(),
                      "cpus": os.cpu_count(), "max_tokens": max_tokens,
                      "requests_per_client": requests, "results": results,
                      "ratio_to_stock": ratios}, indent=2))


if __name__ == "__main__":
    main()
