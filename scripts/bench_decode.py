"""Decode tokens/s of stock mlx-lm and of mlx-moestream at several budgets, measured in one run.

Builds (once, cached in --model-dir) a random-weight model with Qwen3-30B-A3B's MoE layer shape
(hidden 2048, 128 experts, top-8, moe_intermediate 768, 4-bit) and attention shape (32 heads,
4 KV heads, head_dim 128), with --layers layers. Then, in one process and on the same prompt:

- stock mlx-lm, fully resident;
- mlx-moestream at 100% of the expert bytes (warm: every routed expert resident), prefetch
  off and on; these three are loaded together and their passes interleaved, twice (loaded in
  one order, then in the reverse order);
- mlx-moestream at 50%, 25%, 12.5% (cold: fresh load, the model file dropped from the page
  cache, so misses read from disk), prefetch off and on.

Decode tokens/s is measured over a steady segment after the prompt (the first --skip-tokens
decode tokens are left out), with the statistics of that same segment. `--routing trace`
replaces the routing of every MoE layer by a synthetic trace (identically for both models);
`--routing both` runs everything with the trace and again with the model's own router.
`--profile 25` adds a cProfile of one more cold pass at 25%: where a token's time goes.

A micro-benchmark times cold and warm reads of single experts through the store (pread into a
slot) and through mmap; the cold concurrent store read rate is the disk bandwidth of the
I/O-bound prediction 1 / (t_compute + bytes_read_per_token / disk_bandwidth).

Prints one JSON document; --out also writes it, --markdown writes docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import cProfile
import gc
import json
import mmap
import os
import platform
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click
import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
from mlx_lm.generate import generate_step

import mlx_moestream
import mlx_moestream.store
from mlx_moestream.files import atomic_write_text
from mlx_moestream.loader import load_lazy
from mlx_moestream.repack import repack
from mlx_moestream.mlx_backend import MLXSlotPool
from mlx_moestream.testing import make_tiny_moe
from mlx_moestream.trace import synthetic_trace

# Qwen3-30B-A3B: attention shape (the MoE shape is the CLI's defaults).
ATTENTION = {"num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128}
TRACE_NOTE = (
    "routing=trace: every MoE layer computes the trace's expert ids for the token, in the stock "
    "and the streaming model alike; the router still runs (its scores weight the experts' "
    "outputs). Prefetch predicts the next layer's experts with that layer's real router, which "
    "does not know the trace: prediction precision/recall are reported as measured."
)


# ---------------------------------------------------------------------------- model and routing


def build_model(model_dir: Path, shape: dict) -> Path:
    """The benchmark model, built once: reused when model_dir's build.json matches `shape`."""
    marker = model_dir / "build.json"
    if marker.exists() and json.loads(marker.read_text()) == shape:
        return model_dir
    if model_dir.exists():
        if not marker.exists():
            raise click.ClickException(f"{model_dir} exists and was not built by this script")
        shutil.rmtree(model_dir)
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.", dir=model_dir.parent))
    tmp.chmod(0o755)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # make_tiny_moe prints; stdout is the JSON
            make_tiny_moe(tmp, "qwen3_moe", bits=shape["bits"], num_layers=shape["layers"],
                          hidden_size=shape["hidden"], num_experts=shape["experts"],
                          top_k=shape["top_k"], moe_intermediate_size=shape["moe_intermediate"],
                          **ATTENTION)
        (tmp / "build.json").write_text(json.dumps(shape))
        os.replace(tmp, model_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return model_dir


class TraceFeed:
    """The trace's expert ids, served token by token to every MoE layer of one forward call."""

    def __init__(self, experts: np.ndarray):
        self.ids = mx.array(experts.astype(np.uint32))  # [tokens, layers, k]
        self.last_layer = experts.shape[1] - 1
        self.pos = 0

    def take(self, layer: int, shape: tuple[int, ...]) -> mx.array:
        n = shape[-2]
        ids = self.ids[self.pos : self.pos + n, layer]
        if layer == self.last_layer:
            self.pos += n
        return ids.reshape(shape)


class TraceRouted(nn.Module):
    """Runs an expert module on the trace's ids instead of the router's.

    `mx.depends` keeps the router's ids as a dependency (no computation): reading the ids
    still waits for every earlier layer, as with real routing, which is what makes the
    streaming runtime's in-place slot reads safe."""

    def __init__(self, inner: nn.Module, layer: int, feed: TraceFeed):
        super().__init__()
        self.inner = inner
        object.__setattr__(self, "layer", layer)
        object.__setattr__(self, "feed", feed)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        ids = self.feed.take(self.layer, indices.shape)
        return self.inner(x, mx.depends(ids, indices))


def route_by_trace(model: nn.Module, feed: TraceFeed) -> None:
    for i, layer in enumerate(model.model.layers):
        layer.mlp.switch_mlp = TraceRouted(layer.mlp.switch_mlp, i, feed)


def drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def model_files(model_dir: Path) -> list[Path]:
    """Every file the store reads experts from (the shards, and a repacked copy if any)."""
    return list(mlx_moestream.store.ExpertStore(model_dir).files)


def file_of(tensor, expert: int) -> int:
    """The file index of one expert's tensor (one per tensor, or one per expert)."""
    files = getattr(tensor, "files", None)
    return int(files[expert]) if files is not None else tensor.file


# ----------------------------------------------------------------------------------- decoding

COUNTERS = ("hits", "misses", "loads", "bytes_read", "read_seconds", "stall_seconds",
            "predicted", "predicted_routed", "routed_scored", "prefetch_loads", "prefetch_used")


def snapshot(model: nn.Module) -> dict | None:
    runtime = getattr(model, "moestream", None)
    if runtime is None:
        return None
    s = runtime.stats
    out = {name: float(getattr(s, name).sum()) for name in COUNTERS}
    out["syncs"] = s.syncs
    return out


def decode_pass(model, prompt: mx.array, decode_tokens: int, skip: int, feed) -> dict:
    """One prompt + decode; the time and the statistics of the decode segment after `skip`."""
    if feed is not None:
        feed.pos = 0
    marks, ids = [], []
    start = time.perf_counter()
    for token, _ in generate_step(prompt, model, max_tokens=decode_tokens):
        marks.append((time.perf_counter(), snapshot(model)))
        ids.append(token)
    (t0, s0), (t1, s1) = marks[skip], marks[-1]
    tokens = len(marks) - 1 - skip
    out = {"tokens": tokens, "seconds": t1 - t0, "tok_s": tokens / (t1 - t0),
           "first_token_s": marks[0][0] - start, "pass_s": t1 - start,
           "distinct_tokens": len(set(ids[skip:]))}
    if s0 is not None:
        out["counters"] = {k: s1[k] - s0[k] for k in s1}
    return out


def memory_mark() -> tuple[int, int]:
    gc.collect()
    mx.clear_cache()
    active = mx.get_active_memory()
    mx.reset_peak_memory()
    return active, active


def memory_since(mark: tuple[int, int]) -> dict:
    base, _ = mark
    active, peak = mx.get_active_memory(), mx.get_peak_memory()
    return {"active_memory_bytes": active - base, "peak_memory_bytes": peak - base,
            "process_active_memory_bytes": active, "process_peak_memory_bytes": peak}


def load_streaming(path: Path, budget: float, prefetch: bool, policy: str):
    model, _ = mlx_moestream.load(path, budget=f"{budget:g}%", policy=policy, prefetch=prefetch)
    return model


def free(model) -> None:
    runtime = getattr(model, "moestream", None)
    if runtime is not None:
        runtime.close()
    del model, runtime
    gc.collect()
    mx.clear_cache()


def runtime_info(model) -> dict | None:
    runtime = getattr(model, "moestream", None)
    if runtime is None:
        return None
    return {"budget_bytes": runtime.budget_bytes,
            "slots": runtime.stats_dict()["slots"]}


def config_result(name, budget, prefetch, passes: list[dict], memory: dict, info) -> dict:
    """Median tok/s of a config's passes, with the segment statistics of the pass nearest to it."""
    tok_s = statistics.median(p["tok_s"] for p in passes)
    best = min(passes, key=lambda p: abs(p["tok_s"] - tok_s))
    out = {"name": name, "budget_percent": budget, "prefetch": prefetch,
           "tok_s": tok_s, "tok_s_passes": [p["tok_s"] for p in passes],
           "ms_per_token": 1e3 / tok_s, "measured_tokens": best["tokens"],
           "first_token_s": best["first_token_s"], "distinct_tokens": best["distinct_tokens"],
           **memory}
    c = best.get("counters")
    if c is not None:
        n = best["tokens"]
        accesses = c["hits"] + c["misses"]
        out.update({
            **info,
            "hit_rate": c["hits"] / accesses if accesses else None,
            "misses_per_token": c["misses"] / n,
            "loads_per_token": c["loads"] / n,
            "bytes_read_per_token": c["bytes_read"] / n,
            "read_GBps": c["bytes_read"] / c["read_seconds"] / 1e9 if c["read_seconds"] else None,
            "stall_ms_per_token": c["stall_seconds"] * 1e3 / n,
            "syncs_per_token": c["syncs"] / n,
            "prefetch_loads_per_token": c["prefetch_loads"] / n,
            "prefetch_used_per_token": c["prefetch_used"] / n,
            "prediction_precision": (c["predicted_routed"] / c["predicted"]
                                     if c["predicted"] else None),
            "prediction_recall": (c["predicted_routed"] / c["routed_scored"]
                                  if c["routed_scored"] else None),
            "prefetch_used_share": (c["prefetch_used"] / c["prefetch_loads"]
                                    if c["prefetch_loads"] else None),
        })
    return out


# --------------------------------------------------------------------------- micro-benchmark


def read_benchmark(path: Path, count: int, top_k: int, seed: int) -> dict:
    """Cold and warm ms per expert: the store's pread into a slot, from the model's own layout
    and from a repacked copy, vs. a copy out of an mmap."""
    plan = load_lazy(path)[4]
    # Beside the model, not MODEL/moestream-experts: the decode passes read the model's layout.
    packed_dir = path.with_name(path.name + "-repacked")
    with contextlib.redirect_stdout(sys.stderr):
        repack(path, packed_dir)
    os.sync()  # the copy's writeback would compete with the cold reads timed below

    def open_store(drop_page_cache: bool, repacked: Path | None = None):
        s = mlx_moestream.store.ExpertStore(path, drop_page_cache, repacked)
        ids = [s.add_layer(l.path, {n: (sh, b) for n, (sh, _, b) in l.specs.items()},
                           l.num_experts) for l in plan.layers]
        return s, ids

    store, layers = open_store(True)
    warm_store, _ = open_store(False)
    packed, _ = open_store(True, packed_dir)
    packed_warm, _ = open_store(False, packed_dir)
    pool = MLXSlotPool(plan.layers[0], top_k)
    rng = np.random.default_rng(seed)
    keys = rng.choice(plan.num_layers * plan.num_experts, size=min(count, plan.num_layers
                      * plan.num_experts), replace=False)
    picks = [(layers[k // plan.num_experts], int(k % plan.num_experts)) for k in keys]
    expert_bytes = plan.layers[0].expert_bytes
    files = packed.files  # the model's files and experts.bin

    def cold():
        for f in files:
            drop_page_cache(f)

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def serial(s):
        for i, (layer, e) in enumerate(picks):
            s.read_expert(layer, e, pool.slot(i % top_k))

    def concurrent(s, io):
        # Like the runtime: a layer's misses (top-k at most) are read together, then waited for.
        for g in range(0, len(picks), top_k):
            group = picks[g : g + top_k]
            list(io.map(lambda a: s.read_expert(a[1][0], a[1][1], pool.slot(a[0])),
                        enumerate(group)))

    mm = []
    for f in store.files:
        with open(f, "rb") as handle:
            mm.append(mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ))

    def mmap_copy():
        for i, (layer, e) in enumerate(picks):
            dest = pool.slot(i % top_k)
            for t in store.layers[layer]:
                dest[t.name].reshape(-1).view(np.uint8)[:] = np.frombuffer(
                    mm[file_of(t, e)], np.uint8, t.nbytes, int(t.offsets[e]))

    n = len(picks)
    out = {"experts": n, "expert_bytes": expert_bytes, "io_threads": 4}
    with ThreadPoolExecutor(4) as io:
        cold()
        out["store_cold_ms"] = timed(lambda: serial(store)) * 1e3 / n
        cold()
        out["store_cold_concurrent_ms"] = timed(lambda: concurrent(store, io)) * 1e3 / n
        cold()
        serial(warm_store)  # into the page cache
        out["store_warm_ms"] = timed(lambda: serial(warm_store)) * 1e3 / n
        cold()
        out["mmap_cold_ms"] = timed(mmap_copy) * 1e3 / n
        out["mmap_warm_ms"] = timed(mmap_copy) * 1e3 / n
        cold()
        out["repacked_cold_ms"] = timed(lambda: serial(packed)) * 1e3 / n
        cold()
        out["repacked_cold_concurrent_ms"] = timed(lambda: concurrent(packed, io)) * 1e3 / n
        cold()
        serial(packed_warm)
        out["repacked_warm_ms"] = timed(lambda: serial(packed_warm)) * 1e3 / n
    cold()
    for m in mm:
        m.close()
    for s in (store, warm_store, packed, packed_warm):
        s.close()
    shutil.rmtree(packed_dir)
    for key in [k for k in out if k.endswith("_ms")]:
        out[key[:-3] + "_GBps"] = expert_bytes / (out[key] * 1e-3) / 1e9
    out["disk_GBps"] = out["store_cold_concurrent_GBps"]
    out["disk_GBps_note"] = ("disk bandwidth of the I/O-bound prediction: cold store reads, "
                             "top-k at a time on 4 threads (the runtime's miss path)")
    return out


# ---------------------------------------------------------------------------------- the run


def run_benchmark(path, budgets, prompt, decode_tokens, skip, repeats, cold_passes, feed_of,
                  policy, log) -> list[dict]:
    results = []
    # Warm configurations: loaded together, one warm-up pass each, then `repeats` rounds of
    # interleaved passes; all of it twice, loading them in one order then in the other (where a
    # model's weights land in memory moves tok/s by a few percent).
    specs = [("stock", None, None)] + [(f"stream-{b:g}%-prefetch-{'on' if p else 'off'}", b, p)
                                       for b in budgets if b >= 100 for p in (False, True)]
    passes = {name: [] for name, _, _ in specs}
    ratios = {name: [] for name, _, _ in specs}
    memory, info = {}, {}
    for generation, order in enumerate((specs, specs[::-1])):
        loaded = []
        for name, budget, prefetch in order:
            mark = memory_mark()
            for f in model_files(path):
                drop_page_cache(f)
            if budget is None:
                model, _ = mlx_lm.load(str(path))
            else:
                model = load_streaming(path, budget, prefetch, policy)
            feed = feed_of(model)
            first = decode_pass(model, prompt, decode_tokens, skip, feed)
            memory.setdefault(name, memory_since(mark))
            info[name] = runtime_info(model)
            log(f"{name}: load order {generation + 1}, warm-up pass {first['tok_s']:.2f} tok/s")
            loaded.append((name, model, feed))
        for r in range(repeats):  # forward, then backward: drift hits every config alike
            tok_s = {}
            for name, model, feed in (loaded if r % 2 == 0 else loaded[::-1]):
                passes[name].append(decode_pass(model, prompt, decode_tokens, skip, feed))
                tok_s[name] = passes[name][-1]["tok_s"]
                log(f"{name}: load order {generation + 1}, pass {r + 1}/{repeats} "
                    f"{tok_s[name]:.2f} tok/s")
            for name in tok_s:
                ratios[name].append(tok_s[name] / tok_s["stock"])
        del model, feed
        while loaded:
            free(loaded.pop()[1])
    for name, budget, prefetch in specs:
        results.append(config_result(name, budget, prefetch, passes[name], memory[name],
                                     info[name]))
        results[-1]["ratio_to_stock_per_round"] = ratios[name]
        results[-1]["tok_s_by_load_order"] = [
            statistics.median(p["tok_s"] for p in passes[name][:repeats]),
            statistics.median(p["tok_s"] for p in passes[name][repeats:])]

    # Cold configurations: a fresh load per pass, the file dropped from the page cache.
    for budget in [b for b in budgets if b < 100]:
        for prefetch in (False, True):
            name = f"stream-{budget:g}%-prefetch-{'on' if prefetch else 'off'}"
            passes = []
            for r in range(cold_passes):
                mark = memory_mark()
                model = load_streaming(path, budget, prefetch, policy)
                for f in model_files(path):
                    drop_page_cache(f)
                feed = feed_of(model)
                passes.append(decode_pass(model, prompt, decode_tokens, skip, feed))
                memory, info = memory_since(mark), runtime_info(model)
                log(f"{name}: cold pass {r + 1} {passes[-1]['tok_s']:.2f} tok/s")
                free(model)
                del model, feed  # before the next pass's memory mark
            results.append(config_result(name, budget, prefetch, passes, memory, info))
    return results


def profile_pass(path, budget, prefetch, policy, prompt, decode_tokens, skip, feed_of,
                 rows: int = 14) -> dict:
    """cProfile of the measured decode segment of one cold pass: where a token's time goes."""
    model = load_streaming(path, budget, prefetch, policy)
    for f in model_files(path):
        drop_page_cache(f)
    feed = feed_of(model)
    steps = generate_step(prompt, model, max_tokens=decode_tokens)
    for _ in range(skip + 1):
        next(steps)
    s0, start = snapshot(model), time.perf_counter()
    profiler = cProfile.Profile()
    profiler.enable()
    tokens = sum(1 for _ in steps)
    profiler.disable()
    seconds, s1 = time.perf_counter() - start, snapshot(model)
    free(model)
    del model, feed
    table = pstats.Stats(profiler).stats  # (file, line, function) -> (cc, calls, tt, ct, callers)
    top = sorted(table.items(), key=lambda kv: kv[1][2], reverse=True)[:rows]
    return {
        "budget_percent": budget, "prefetch": prefetch, "tokens": tokens,
        "ms_per_token": seconds * 1e3 / tokens,
        "stall_ms_per_token": (s1["stall_seconds"] - s0["stall_seconds"]) * 1e3 / tokens,
        "note": "cProfile self time per token, largest first; MLX calls made from Python "
                "(mx.eval, np.array of an mx.array) wait for the computation, so that wait is "
                "the self time of their caller or of numpy.array",
        "functions": [
            {"function": f"{Path(file).name}:{line}({func})" if line else func,
             "calls_per_token": calls / tokens, "self_ms_per_token": tt * 1e3 / tokens,
             "cumulative_ms_per_token": ct * 1e3 / tokens}
            for (file, line, func), (_, calls, tt, ct, _) in top
        ],
    }


def add_predictions(results: list[dict], disk_GBps: float) -> None:
    """I/O-bound prediction of each streaming config: 1 / (t_compute + bytes/token / disk)."""
    stock = next(r for r in results if r["name"] == "stock")["tok_s"]
    full = {r["prefetch"]: r for r in results if r["budget_percent"] == 100}
    for r in results:
        r["ratio_to_stock"] = r["tok_s"] / stock
        if r["budget_percent"] is None or r["prefetch"] not in full:
            continue
        t_compute = 1 / full[r["prefetch"]]["tok_s"]
        t_io = r["bytes_read_per_token"] / (disk_GBps * 1e9)
        r["predicted_tok_s"] = 1 / (t_compute + t_io)
        r["ratio_to_prediction"] = r["tok_s"] / r["predicted_tok_s"]
        if not r["prefetch"] and r["budget_percent"] < 100:
            # What a perfect prefetch could give: every read stall hidden behind compute.
            total, stall = 1 / r["tok_s"], r["stall_ms_per_token"] / 1e3
            r["prefetch_ceiling_speedup"] = total / max(total - stall, stall)


def target_row(routing: str, text: str, value: float, threshold: float) -> dict:
    return {"routing": routing, "target": text, "value": value, "threshold": threshold,
            "met": value >= threshold}


def check_targets(results: list[dict], routing: str) -> list[dict]:
    by = {(r["budget_percent"], r["prefetch"]): r for r in results}
    targets = []

    def target(text, value, threshold):
        targets.append(target_row(routing, text, value, threshold))

    for prefetch in (False, True):
        full = by.get((100, prefetch))
        if full:
            target(f"budget 100% (prefetch {'on' if prefetch else 'off'}) >= 0.97x stock "
                   "resident tok/s", full["ratio_to_stock"], 0.97)
    on, off = by.get((25, True)), by.get((25, False))
    if on and off:
        target("budget 25%: prefetch on >= 1.3x prefetch off tok/s", on["tok_s"] / off["tok_s"],
               1.3)
        targets[-1]["context"] = (
            f"a perfect prefetch (every read stall of prefetch off hidden) would give at most "
            f"{off['prefetch_ceiling_speedup']:.2f}x; prediction precision "
            f"{_f(on['prediction_precision'])}")
        target("budget 25%, prefetch on: >= 0.8x the I/O-bound prediction",
               on["ratio_to_prediction"], 0.8)
    return targets


# ---------------------------------------------------------------------------------- markdown


def _f(value, digits=2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def config_row(r: dict) -> str:
    stream = r["budget_percent"] is not None
    prefetch = bool(r.get("prefetch"))

    def cell(key, digits=2, scale=1.0, when=stream):
        value = r.get(key)
        return _f(value * scale if value is not None else None, digits) if when else "-"

    return " | ".join([
        f"| {r['name']}", _f(r["tok_s"]), _f(r["ratio_to_stock"], 3), cell("hit_rate", 3),
        cell("bytes_read_per_token", 1, 1e-6), cell("read_GBps"), cell("stall_ms_per_token", 1),
        cell("syncs_per_token", 1),
        f"{cell('prediction_precision', when=prefetch)} / "
        f"{cell('prediction_recall', when=prefetch)}",
        f"{cell('prefetch_used_per_token', 1, when=prefetch)} / "
        f"{cell('prefetch_loads_per_token', 1, when=prefetch)}",
        cell("predicted_tok_s"), cell("ratio_to_prediction"),
        f"{r['peak_memory_bytes'] / 2**20:.0f} / {r['active_memory_bytes'] / 2**20:.0f} |",
    ])


def markdown(doc: dict) -> str:
    m, run, disk, routing = doc["model"], doc["run"], doc["read_benchmark"], doc["routing"]
    trace = routing.get("trace")
    lines = [
        "# Decode benchmark",
        "",
        f"Generated by `scripts/bench_decode.py` on {doc['machine']['description']}, MLX device "
        f"`{doc['machine']['mlx_device']}` (mlx {doc['machine']['mlx']}, mlx-lm "
        f"{doc['machine']['mlx_lm']}). The run took {doc['runtime_s']:.0f} s; load average "
        f"{doc['machine']['loadavg_start'][0]} at its start, {doc['machine']['loadavg_end'][0]} "
        f"at its end. Code: commit `{doc['code'].get('commit', '?')[:12]}`"
        + (f" with uncommitted changes in {', '.join(l.split()[-1] for l in doc['code']['uncommitted'])}"
           if doc["code"].get("uncommitted") else "") + ".",
        "",
        f"Model: random weights with Qwen3-30B-A3B's MoE layer shape (hidden {m['hidden']}, "
        f"{m['experts']} experts, top-{m['top_k']}, moe_intermediate {m['moe_intermediate']}, "
        f"{m['bits']}-bit, group 64, float32 scales and biases) and attention shape (32 heads, "
        f"4 KV heads, head_dim 128), {m['layers']} layers, vocabulary 512. One expert is "
        f"{m['expert_bytes'] / 2**20:.2f} MiB, all experts {m['all_expert_bytes'] / 2**30:.2f} "
        f"GiB, the dense weights {m['dense_bytes'] / 2**20:.0f} MiB.",
        "",
        "Routing: " + ", ".join(f"`{r}`" for r in routing["modes"]) + ".",
    ]
    if trace:
        lines += ["", f"- `trace`: a synthetic trace (`mlx_moestream.trace.synthetic_trace`, Zipf "
                  f"skew {trace['skew']}, repeat {trace['repeat']}, switch_at "
                  f"{trace['switch_at']}, seed {trace['seed']}). {TRACE_NOTE}"]
    if "router" in routing["modes"]:
        stock = next(r for r in doc["configs"] if r["routing"] == "router")
        lines += ["", "- `router`: the model's own router. With random weights, greedy decoding "
                  f"falls into a loop ({stock['distinct_tokens']} distinct tokens in the measured "
                  "segment of the stock run), so consecutive tokens route to the same experts: "
                  "an easy case for the cache, not a realistic one; it shows what the real "
                  "router's prediction of the next layer achieves."]
    lines += [
        "",
        f"Each pass is a {run['prompt_tokens']}-token prompt, then {run['decode_tokens']} decode "
        f"tokens with `mlx_lm.generate.generate_step` (greedy). tok/s is measured over decode "
        f"tokens {run['skip_tokens']}..{run['decode_tokens'] - 1} ({run['measured_tokens']} "
        "tokens), and every statistic in the table is of that same segment. Stock and 100% are "
        f"warm: loaded together, one warm-up pass each, then {run['repeats']} rounds of "
        "interleaved passes (forward and backward in turn); all of it twice, loading the models "
        f"in one order then in the reverse order; tok/s is the median of the "
        f"{2 * run['repeats']} passes and the other statistics are those of the pass nearest to "
        "it. Budgets below 100% start cold: a fresh load, the model file "
        f"dropped from the page cache (median of {run['cold_passes']} cold pass(es)). Policy "
        f"`{run['policy']}`.",
        "",
        "Reproduce:",
        "",
        "```bash",
        doc["command"],
        "```",
    ]
    header = ("| config | tok/s | x stock | hit rate | MB read/token | read GB/s | stall ms/token "
              "| syncs/token | prediction precision / recall | prefetch used / loaded per token "
              "| I/O-bound prediction tok/s | x prediction | peak / active MiB |")
    for mode in routing["modes"]:
        lines += ["", f"## Decode, routing `{mode}`", "", header, "|---" * 13 + "|"]
        lines += [config_row(r) for r in doc["configs"] if r["routing"] == mode]
    lines += [
        "",
        "read GB/s: bytes read / summed duration of the single reads (a layer's misses are read "
        "on 4 threads at once, so the aggregate rate can be higher). I/O-bound prediction: "
        "1 / (1 / tok/s at 100% with the same prefetch setting + bytes read per token / disk "
        f"bandwidth), with the disk bandwidth measured cold in this run: "
        f"{disk['disk_GBps']:.2f} GB/s (below). syncs/token: as `stats()` counts them: one "
        "read of the routed ids per layer (none when every expert has a slot of its own, at "
        "100%) and one per prediction. Memory: MLX peak and active memory above what "
        "was allocated before the config's load (the slot pool or all experts, the dense "
        "weights, the KV cache, temporaries).",
        "",
        "## Reading one expert",
        "",
        f"{disk['experts']} random experts of {disk['expert_bytes'] / 2**20:.2f} MiB; cold: the "
        "file dropped from the page cache first.",
        "",
        "| path | ms/expert | GB/s |",
        "|---|---|---|",
    ]
    for key, label in (("store_cold", "store: pread into the slot, cold, one at a time"),
                       ("store_cold_concurrent", "store: pread, cold, top-k at a time on 4 "
                        "threads (the disk bandwidth above)"),
                       ("store_warm", "store: pread, warm (page cache)"),
                       ("mmap_cold", "copy out of an mmap, cold"),
                       ("mmap_warm", "copy out of an mmap, warm"),
                       ("repacked_cold", "repacked copy: one direct-I/O read, cold, one at a "
                        "time"),
                       ("repacked_cold_concurrent", "repacked copy: cold, top-k at a time on 4 "
                        "threads"),
                       ("repacked_warm", "repacked copy: page-cache read, warm")):
        lines.append(f"| {label} | {disk[key + '_ms']:.2f} | {disk[key + '_GBps']:.2f} |")
    for p in doc["profiles"]:
        lines += ["", f"## Where a token's time goes: routing `{p['routing']}`, budget "
                  f"{p['budget_percent']:g}%, prefetch off", "",
                  f"cProfile of the measured segment of one more cold pass ({p['tokens']} "
                  f"tokens, {p['ms_per_token']:.0f} ms/token under the profiler, of which "
                  f"{p['stall_ms_per_token']:.0f} ms waiting for reads). {p['note']}.", "",
                  "| function | calls/token | self ms/token | cumulative ms/token |",
                  "|---|---|---|---|"]
        lines += [f"| `{f['function']}` | {f['calls_per_token']:.1f} | "
                  f"{f['self_ms_per_token']:.1f} | {f['cumulative_ms_per_token']:.1f} |"
                  for f in p["functions"]]
    lines += ["", "## Targets", "", "| routing | target | measured | met | context |",
              "|---|---|---|---|---|"]
    for t in doc["targets"]:
        lines.append(f"| {t['routing']} | {t['target']} | {t['value']:.3f} | "
                     f"{'yes' if t['met'] else 'no'} | {t.get('context', '')} |")
    lines += ["", "## Reading", ""] + [f"- {s}" for s in doc["reading"]] + [""]
    return "\n".join(lines)


def reading(doc: dict) -> list[str]:
    """Plain-words sentences drawn from the numbers of this run."""
    out = []
    for mode in doc["routing"]["modes"]:
        configs = [r for r in doc["configs"] if r["routing"] == mode]
        stock = next(r for r in configs if r["budget_percent"] is None)
        for r in configs:
            if r["budget_percent"] is None:
                continue
            where = f"`{mode}` {r['name']}"
            if r["budget_percent"] >= 100:
                out.append(
                    f"{where}: {r['tok_s']:.2f} tok/s against {stock['tok_s']:.2f} for stock "
                    f"({r['ratio_to_stock']:.3f}x, {r['ms_per_token'] - stock['ms_per_token']:+.1f}"
                    f" ms/token) with every expert resident. Median tok/s by load order: "
                    f"{r['tok_s_by_load_order'][0]:.2f} then {r['tok_s_by_load_order'][1]:.2f} "
                    f"(stock {stock['tok_s_by_load_order'][0]:.2f} then "
                    f"{stock['tok_s_by_load_order'][1]:.2f}); the ratio of single rounds ranged "
                    f"{min(r['ratio_to_stock_per_round']):.2f}-"
                    f"{max(r['ratio_to_stock_per_round']):.2f}.")
                continue
            text = (f"{where}: hit rate {r['hit_rate']:.2f}, "
                    f"{r['bytes_read_per_token'] / 1e6:.1f} MB read per token, "
                    f"{r['stall_ms_per_token']:.0f} of {r['ms_per_token']:.0f} ms per token "
                    f"waiting for reads; {r['tok_s']:.2f} tok/s = {r['ratio_to_stock']:.2f}x "
                    f"stock and {r['ratio_to_prediction']:.2f}x the I/O-bound prediction")
            if "prefetch_ceiling_speedup" in r:
                text += (f"; hiding every read stall would make it at most "
                         f"{r['prefetch_ceiling_speedup']:.2f}x faster")
            if r["prefetch"]:
                chance = doc["model"]["top_k"] / doc["model"]["experts"]
                text += (f"; prediction precision {_f(r['prediction_precision'])} (a random "
                         f"guess: {chance:.2f}), "
                         f"{_f(r['prefetch_loads_per_token'], 1)} prefetch loads per token of "
                         f"which {_f(r['prefetch_used_per_token'], 1)} were used")
            out.append(text + ".")
    spread = [abs(a - b) / min(a, b) for r in doc["configs"] if "tok_s_by_load_order" in r
              for a, b in [r["tok_s_by_load_order"]]]
    if spread:
        out.append(f"Noise: the same warm configuration differs by up to {max(spread):.0%} in "
                   "median tok/s between the two load orders; differences of that size between "
                   "configurations, and between the single cold passes, are not significant.")
    met = [f"`{t['routing']}` {t['target']} ({t['value']:.3f})" for t in doc["targets"]
           if t["met"]]
    missed = [f"`{t['routing']}` {t['target']} ({t['value']:.3f})" for t in doc["targets"]
              if not t["met"]]
    out.append("Targets met: " + ("; ".join(met) if met else "none") + ".")
    out.append("Targets not met: " + ("; ".join(missed) if missed else "none") + ".")
    return out


def machine_description() -> str:
    model = "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    return (f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores ({model}), "
            f"{mem:.0f} GiB RAM")


def code_state() -> dict:
    """The commit of the package measured, and its files with uncommitted changes."""
    root = Path(mlx_moestream.__file__).resolve().parent.parent

    def git(*args) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              check=True).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"),
                "uncommitted": git("status", "--porcelain", "--", "mlx_moestream").splitlines()}
    except (OSError, subprocess.CalledProcessError):
        return {}


def parse_budgets(text: str) -> list[float]:
    try:
        budgets = sorted({float(b) for b in text.split(",")}, reverse=True)
    except ValueError:
        raise click.BadParameter(f"not a list of percentages: {text}") from None
    if budgets[0] != 100 or min(budgets) <= 0:
        raise click.BadParameter("give percentages including 100, e.g. 100,50,25,12.5")
    return budgets


@click.command()
@click.option("--model-dir", default="/tmp/bench-work/qwen3-30b-layer", show_default=True,
              type=click.Path(path_type=Path), help="Where the model is built once and reused.")
@click.option("--layers", default=4, show_default=True, help="MoE layers of the model.")
@click.option("--hidden", default=2048, show_default=True)
@click.option("--experts", default=128, show_default=True)
@click.option("--top-k", default=8, show_default=True)
@click.option("--moe-intermediate", default=768, show_default=True)
@click.option("--bits", default=4, show_default=True)
@click.option("--routing", type=click.Choice(["trace", "router", "both"]), default="trace",
              show_default=True, help="Trace ids for every MoE layer, the model's router, or both "
              "(each with its own stock baseline).")
@click.option("--skew", default=1.0, show_default=True, help="Trace: Zipf skew.")
@click.option("--repeat", default=0.3, show_default=True, help="Trace: temporal locality.")
@click.option("--switch-at", default=None, type=float,
              help="Trace: workload switch at this share of the tokens (default: none).")
@click.option("--seed", default=0, show_default=True)
@click.option("--prompt-tokens", default=16, show_default=True)
@click.option("--decode-tokens", default=48, show_default=True)
@click.option("--skip-tokens", default=8, show_default=True,
              help="Decode tokens left out before the measured segment.")
@click.option("--budgets", default="100,50,25,12.5", show_default=True,
              help="Percentages of all expert bytes.")
@click.option("--repeats", default=3, show_default=True,
              help="Rounds of measured passes of the warm configs (stock, 100%), per load order.")
@click.option("--cold-passes", default=1, show_default=True,
              help="Cold passes (fresh loads) of each config below 100%.")
@click.option("--policy", default="wlfu", show_default=True)
@click.option("--read-experts", default=128, show_default=True,
              help="Experts read by the micro-benchmark.")
@click.option("--profile", "profile_budget", type=float, default=None,
              help="Also cProfile one cold pass at this budget (%) with prefetch off, per routing "
              "mode (timed apart from the measured configs).")
@click.option("--out", type=click.Path(path_type=Path), help="Also write the JSON here.")
@click.option("--markdown", "markdown_path", type=click.Path(path_type=Path),
              help="Write a markdown report of this run here (atomically).")
def main(model_dir, layers, hidden, experts, top_k, moe_intermediate, bits, routing, skew, repeat,
         switch_at, seed, prompt_tokens, decode_tokens, skip_tokens, budgets, repeats,
         cold_passes, policy, read_experts, profile_budget, out, markdown_path):
    """Decode tok/s: stock mlx-lm vs. mlx-moestream at several budgets, prefetch off/on."""
    started = time.perf_counter()
    loadavg, code = os.getloadavg(), code_state()
    budgets = parse_budgets(budgets)
    if not 0 <= skip_tokens < decode_tokens - 1:
        raise click.BadParameter("need 0 <= --skip-tokens < --decode-tokens - 1")
    if repeats < 1 or cold_passes < 1:
        raise click.BadParameter("--repeats and --cold-passes must be at least 1")

    def log(msg):
        click.echo(f"[{time.perf_counter() - started:7.1f}s] {msg}", err=True)

    shape = dict(layers=layers, hidden=hidden, experts=experts, top_k=top_k,
                 moe_intermediate=moe_intermediate, bits=bits, attention=ATTENTION)
    path = build_model(model_dir, shape)
    log(f"model at {path}")
    info = load_lazy(path)[4].describe()
    modes = ["trace", "router"] if routing == "both" else [routing]
    trace = None
    if "trace" in modes:
        trace = synthetic_trace(tokens=prompt_tokens + decode_tokens + 8, layers=layers,
                                num_experts=experts, top_k=top_k, skew=skew, repeat=repeat,
                                switch_at=switch_at, seed=seed)
    rng = np.random.default_rng(seed)
    prompt = mx.array(rng.integers(3, 512, prompt_tokens).astype(np.uint32))

    disk = read_benchmark(path, read_experts, top_k, seed)
    log(f"reads: store cold {disk['store_cold_ms']:.2f} ms/expert, disk "
        f"{disk['disk_GBps']:.2f} GB/s")
    speedup = disk["store_cold_ms"] / disk["repacked_cold_ms"]
    results, profiles = [], []
    targets = [target_row("-", "repacked copy: cold read of one expert >= 2x faster than the "
                          "model's layout", speedup, 2.0)]
    for mode in modes:
        def feed_of(model, mode=mode):
            if mode != "trace":
                return None
            feed = TraceFeed(trace.experts)
            route_by_trace(model, feed)
            return feed

        found = run_benchmark(path, budgets, prompt, decode_tokens, skip_tokens, repeats,
                              cold_passes, feed_of, policy, lambda m: log(f"{mode}: {m}"))
        for r in found:
            r["routing"] = mode
        add_predictions(found, disk["disk_GBps"])
        results += found
        targets += check_targets(found, mode)
        if profile_budget is not None:
            log(f"{mode}: profiling a cold pass at {profile_budget:g}%")
            profiles.append({"routing": mode, **profile_pass(
                path, profile_budget, False, policy, prompt, decode_tokens, skip_tokens,
                feed_of)})

    doc = {
        "benchmark": "decode",
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
        "machine": {"description": machine_description(), "mlx_device": str(mx.default_device()),
                    "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
                    "loadavg_start": [round(x, 2) for x in loadavg],
                    "loadavg_end": [round(x, 2) for x in os.getloadavg()]},
        "code": code,
        "model": {"dir": str(path), **{k: v for k, v in shape.items() if k != "attention"},
                  "attention": ATTENTION, "expert_bytes": info["expert_bytes"],
                  "all_expert_bytes": info["all_expert_bytes"],
                  "dense_bytes": info["dense_bytes"]},
        "routing": {"modes": modes, **({"trace": {"skew": skew, "repeat": repeat,
                                                  "switch_at": switch_at, "seed": seed,
                                                  "note": TRACE_NOTE}} if trace else {})},
        "run": {"prompt_tokens": prompt_tokens, "decode_tokens": decode_tokens,
                "skip_tokens": skip_tokens, "measured_tokens": decode_tokens - 1 - skip_tokens,
                "repeats": repeats, "cold_passes": cold_passes, "policy": policy,
                "budgets_percent": budgets},
        "read_benchmark": disk,
        "configs": results,
        "targets": targets,
        "profiles": profiles,
    }
    doc["runtime_s"] = time.perf_counter() - started
    doc["reading"] = reading(doc)
    text = json.dumps(doc, indent=2)
    click.echo(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, text + "\n")
    if markdown_path:
        atomic_write_text(markdown_path, markdown(doc))


if __name__ == "__main__":
    main()
