"""Per-layer cost of streaming when every expert is resident, and cold read time per expert.

Builds a model with one real MoE layer shape (default: Qwen3-30B-A3B's, hidden 2048, 128
experts, top-8, moe_intermediate 768, 4-bit) and times, in one run, the MoE block of stock
mlx-lm and of mlx-moestream at a 100% budget on identical inputs (decode: 1 token; prefill: 32
tokens). Then drops the file from the page cache and times cold reads of single experts through
pread into the slot (what the runtime does), from a repacked expert-major copy, and through mmap.
Prints JSON.
"""

from __future__ import annotations

import json
import mmap
import os
import tempfile
import time
from pathlib import Path

import click
import mlx.core as mx
import mlx_lm
import numpy as np

import mlx_moestream
from mlx_moestream.repack import repack
from mlx_moestream.store import ExpertStore
from mlx_moestream.testing import make_tiny_moe


def time_pair(fa, fb, repeats: int) -> tuple[float, float]:
    """Median microseconds of fa() and fb() with evaluation, interleaved so drift hits both."""
    times = ([], [])
    for i in range(repeats + 2):
        for fn, out in zip((fa, fb), times):
            start = time.perf_counter()
            mx.eval(fn())
            if i >= 2:
                out.append(time.perf_counter() - start)
    return float(np.median(times[0]) * 1e6), float(np.median(times[1]) * 1e6)


def drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def timed_reads(store: ExpertStore, layer: int, experts: list[int], dest: dict) -> float:
    """Cold ms per expert through the store (pread straight into the slot)."""
    for path in store.files:
        drop_page_cache(path)
    start = time.perf_counter()
    for e in experts:
        store.read_expert(layer, e, dest)
    return (time.perf_counter() - start) * 1e3 / len(experts)


def cold_reads(runtime, model_dir: Path, experts: list[int]) -> dict:
    """Cold read ms per expert: pread of the stacked layout, of the repacked copy, and copying
    out of an mmap of the stacked layout."""
    store = runtime.store
    pool = runtime.pools[0]
    dest = pool.slot(0)
    out = {"pread_ms": timed_reads(store, 0, experts, dest)}
    repack(model_dir)
    packed = ExpertStore(model_dir)
    layer = runtime.plan.layers[0]
    packed.add_layer(layer.path, {n: (sh, nb) for n, (sh, _, nb) in layer.specs.items()},
                     layer.num_experts)
    out["repacked_ms"] = timed_reads(packed, 0, experts, dest)
    out["repacked_speedup"] = out["pread_ms"] / out["repacked_ms"]
    drop_page_cache(store.files[0])
    with open(store.files[0], "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        start = time.perf_counter()
        for e in experts:
            for t in store.layers[1]:  # another layer: cold too, and same sizes
                off = int(t.offsets[e])
                dest[t.name].reshape(-1).view(np.uint8)[:] = np.frombuffer(
                    mm, np.uint8, t.nbytes, off)
        out["mmap_ms"] = (time.perf_counter() - start) * 1e3 / len(experts)
        mm.close()
    out["expert_bytes"] = runtime.plan.layers[0].expert_bytes
    out["pread_GBps"] = out["expert_bytes"] / out["pread_ms"] / 1e6
    out["mmap_GBps"] = out["expert_bytes"] / out["mmap_ms"] / 1e6
    return out


@click.command()
@click.option("--hidden", default=2048)
@click.option("--experts", default=128)
@click.option("--top-k", default=8)
@click.option("--moe-intermediate", default=768)
@click.option("--bits", default=4)
@click.option("--repeats", default=50)
@click.option("--prefill-tokens", default=32)
def main(hidden, experts, top_k, moe_intermediate, bits, repeats, prefill_tokens):
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        path = make_tiny_moe(Path(tmp) / "model", "qwen3_moe", bits=bits or None, num_layers=2,
                             hidden_size=hidden, num_experts=experts, top_k=top_k,
                             moe_intermediate_size=moe_intermediate)
        stock, _ = mlx_lm.load(str(path))
        streamed, _ = mlx_moestream.load(path, budget="100%")
        rng = np.random.default_rng(0)
        result = {"shape": dict(hidden=hidden, experts=experts, top_k=top_k,
                                moe_intermediate=moe_intermediate, bits=bits)}
        for name, tokens, n in (("decode", 1, repeats), ("prefill", prefill_tokens, 5)):
            x = mx.array(rng.standard_normal((1, tokens, hidden)).astype(np.float32))
            a, b = stock.model.layers[0].mlp, streamed.model.layers[0].mlp
            mx.eval(b(mx.array(rng.standard_normal((1, 512, hidden)).astype(np.float32))))  # warm all
            assert mx.array_equal(a(x), b(x)).item()
            stock_us, stream_us = time_pair(lambda: a(x), lambda: b(x), n)
            result[name] = {"stock_us": stock_us, "streaming_us": stream_us,
                            "ratio": stream_us / stock_us, "overhead_us": stream_us - stock_us}
        result["cold_read"] = cold_reads(streamed.moestream, path, list(range(0, experts, 4)))
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
