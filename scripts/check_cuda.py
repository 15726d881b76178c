"""The torch backend on a CUDA GPU: exactness against the fully loaded model, and decode speed.

Run on a machine with a CUDA GPU and torch + transformers (mlx is not needed):

    python scripts/check_cuda.py [--quick] [--out result.json]

1. Parity matrix. Tiny random checkpoints (`testing_torch`, 16 experts, 4 per token: `WIDER`)
   of every torch architecture, in both checkpoint layouts and in float32 and bfloat16, under
   each experts implementation (grouped_mm, batched_mm, eager), streamed at the minimum, 25%
   and 100% budgets: `torch.equal` of prefill logits, greedy tokens and every decode step's
   logits against `from_pretrained(...).to("cuda")`, with the evictions counted, the GPU
   memory of the experts' slot pools checked against the budget, and what the load allocated
   on the GPU beyond the model's tensors (allocator rounding alone, if nothing leaks).
2. Negative control: the same under eager with a plain remap (ids -> slots, no order kept),
   which must differ somewhere, or the matrix could not have failed.
3. torch.compile: stock compiled against streamed compiled (`lm.forward = torch.compile(...)`,
   inductor) at the minimum budget, prefill and every decode step's logits of `generate`, for
   qwen3_moe and gpt_oss in float32, and in bfloat16 with and without inductor's
   `emulate_precision_casts` (equal with it, on the CPU).
4. Decode benchmark. A random bfloat16 checkpoint with Qwen3-30B-A3B's MoE layer shape
   (hidden 2048, moe_intermediate 768, top-8) and 64 experts on --layers layers: greedy decode
   tokens/s of the fully loaded model and of the streamed one at 100%, 50% and 25% (prefetch off
   and on), with the streamed tokens checked equal, the hit rate, stall ms/token, the bytes
   read per token and the host-to-device copy bandwidth from pinned memory.

Prints one JSON document.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx_moestream.torch as moestream_torch  # noqa: E402
from mlx_moestream.torch import forward as torch_forward  # noqa: E402
from mlx_moestream.files import atomic_write_text  # noqa: E402
from mlx_moestream.testing_tokenizer import make_tokenizer  # noqa: E402
from mlx_moestream.testing_torch import TORCH_ARCHITECTURES, WIDER, make_tiny_hf_moe  # noqa: E402

DEVICE = "cuda"
IMPLEMENTATIONS = ("grouped_mm", "batched_mm", "eager")


def decode(model, prompt: torch.Tensor, tokens: int) -> tuple[torch.Tensor, list, torch.Tensor]:
    with torch.no_grad():
        prefill = model(prompt).logits
    out = model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    return prefill, list(out.logits), out.sequences


def same(a, b) -> dict:
    return {"prefill": torch.equal(a[0], b[0]), "tokens": torch.equal(a[2], b[2]),
            "steps": all(torch.equal(x, y) for x, y in zip(a[1], b[1]))}


def parity(root: Path, archs: list[str], decode_tokens: int) -> tuple[list[dict], list[dict]]:
    prompt = torch.randint(3, 500, (1, 24), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    rows, control = [], []
    for arch in archs:
        for fused in (False, True):
            for dtype in ("float32", "bfloat16"):
                path = make_tiny_hf_moe(root / f"{arch}-{fused}-{dtype}", arch, fused=fused,
                                        dtype=dtype, **WIDER[arch])
                minimum = moestream_torch.min_budget_bytes(path, device=DEVICE)
                for impl in IMPLEMENTATIONS:
                    ref = transformers.AutoModelForCausalLM.from_pretrained(
                        path, experts_implementation=impl).to(DEVICE)
                    expected = decode(ref, prompt, decode_tokens)
                    del ref
                    for budget in (minimum, "25%", "100%"):
                        before = allocated()
                        model, _ = moestream_torch.load(path, budget, device=DEVICE,
                                                        experts_implementation=impl)
                        held = storages(model)
                        other = allocated() - before - sum(held.values())
                        got = same(decode(model, prompt, decode_tokens), expected)
                        stats = model.moestream.stats_dict()
                        rows.append({"arch": arch, "fused": fused, "dtype": dtype, "impl": impl,
                                     "budget": "min" if budget == minimum else budget, **got,
                                     "evictions": stats["evictions"],
                                     "hit_rate": round(stats["hit_rate"], 3),
                                     "syncs_per_token": round(stats["syncs_per_token"], 2),
                                     "expert_memory_within_budget":
                                         held["experts"] <= stats["budget_bytes"],
                                     "gpu_bytes_beyond_the_model": other})
                        model.moestream.close()
                        del model
                    if impl == "eager" and not fused:
                        control.append({"arch": arch, "dtype": dtype,
                                        **plain_remap(path, minimum, prompt, expected,
                                                      decode_tokens)})
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows, control


def allocated() -> int:
    """GPU memory held by tensors now (what the loads before left is collected first)."""
    gc.collect()
    return torch.cuda.memory_allocated() if DEVICE == "cuda" else 0


def storages(model) -> dict[str, int]:
    """GPU bytes of the model's tensors: its experts' (the slot pools) and the others'."""
    seen, held = set(), {"experts": 0, "other": 0}
    for name, tensor in [*model.named_parameters(remove_duplicate=False),
                         *model.named_buffers()]:
        storage = tensor.untyped_storage()
        if tensor.is_cuda and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            held["experts" if ".experts." in name else "other"] += storage.nbytes()
    return held


def summary(rows: list[dict], control: list[dict]) -> dict:
    exact = [r["prefill"] and r["tokens"] and r["steps"] for r in rows]
    return {"parity": {"cases": len(rows), "exact": sum(exact),
                       "evicting_cases": sum(r["evictions"] > 0 for r in rows),
                       "expert_memory_within_budget": sum(r["expert_memory_within_budget"]
                                                          for r in rows),
                       "most_gpu_bytes_beyond_the_model": max(r["gpu_bytes_beyond_the_model"]
                                                              for r in rows),
                       "failures": [r for r, ok in zip(rows, exact) if not ok]},
            "negative_control": {"cases": len(control),
                                 "differ": sum(not (c["prefill"] and c["steps"]) for c in control),
                                 "rows": control}}


def plain_remap(path, budget, prompt, expected, decode_tokens) -> dict:
    """Eager computed with ids remapped to slots as grouped_mm's are: the order in which a
    token's expert outputs are added follows the slots, not the experts."""
    row_wise = torch_forward.ROW_WISE
    torch_forward.ROW_WISE = row_wise + ("eager",)
    try:
        model, _ = moestream_torch.load(path, budget, device=DEVICE, experts_implementation="eager")
        got = same(decode(model, prompt, decode_tokens), expected)
        model.moestream.close()
    finally:
        torch_forward.ROW_WISE = row_wise
    return got


def compiled(root: Path, decode_tokens: int) -> list[dict]:
    """Streamed and stock under `torch.compile`: the README says equal in float32, and in
    bfloat16 where inductor rounds fused intermediates as eager does (measured on the CPU)."""
    prompt = torch.randint(3, 500, (1, 24), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    rows = []
    for arch in ("qwen3_moe", "gpt_oss"):
        for dtype, emulate in (("float32", False), ("bfloat16", False), ("bfloat16", True)):
            torch._inductor.config.emulate_precision_casts = emulate
            path = make_tiny_hf_moe(root / f"compile-{arch}-{dtype}-{emulate}", arch, dtype=dtype,
                                    **WIDER[arch])
            stock = transformers.AutoModelForCausalLM.from_pretrained(path).to(DEVICE)
            minimum = moestream_torch.min_budget_bytes(path, device=DEVICE)
            model, _ = moestream_torch.load(path, minimum, device=DEVICE)
            got = []
            for lm in (stock, model):
                lm.forward = torch.compile(lm.forward)
                got.append(decode(lm, prompt, decode_tokens))
            steps = zip([got[0][0], *got[0][1]], [got[1][0], *got[1][1]])
            rows.append({"arch": arch, "dtype": dtype, "emulate_precision_casts": emulate,
                         **same(*got),
                         "most_logit_difference": max((a.float() - b.float()).abs().max().item()
                                                      for a, b in steps),
                         "evictions": model.moestream.stats_dict()["evictions"]})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            model.moestream.close()
            del model, stock
            torch._dynamo.reset()
    return rows


def bench_model(root: Path, layers: int) -> Path:
    config = transformers.Qwen3MoeConfig(
        vocab_size=4096, hidden_size=2048, num_hidden_layers=layers, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
        num_experts=64, num_experts_per_tok=8, max_position_embeddings=4096)
    torch.manual_seed(0)
    with transformers.initialization.no_init_weights():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.to(DEVICE)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02)
    path = root / "bench"
    model.save_pretrained(path)
    make_tokenizer(path, vocab_size=config.vocab_size)
    del model
    return path


def timed_decode(model, prompt, tokens: int) -> tuple[float, torch.Tensor]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    torch.cuda.synchronize()
    return time.perf_counter() - start, out


def copy_bandwidth(nbytes: int = 256 * 2**20) -> float:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return 5 * nbytes / (time.perf_counter() - start) / 1e9


def bench(root: Path, layers: int, tokens: int) -> dict:
    path = bench_model(root, layers)
    prompt = torch.randint(3, 4000, (1, 32), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path).to(DEVICE)
    timed_decode(ref, prompt, 16)  # warm-up
    seconds, expected = timed_decode(ref, prompt, tokens)
    again, _ = timed_decode(ref, prompt, tokens)
    out = {"layers": layers, "experts": 64, "top_k": 8, "tokens": tokens,
           "implementation": ref.config._experts_implementation,
           "expert_gb": round(sum(p.nbytes for n, p in ref.named_parameters()
                                  if ".experts." in n) / 1e9, 3),
           "h2d_pinned_gb_s": round(copy_bandwidth(), 1),
           "resident_tok_s": [round(tokens / seconds, 2), round(tokens / again, 2)],
           "streamed": []}
    resident = tokens / min(seconds, again)
    del ref
    gc.collect()
    torch.cuda.empty_cache()
    for budget in ("100%", "50%", "25%"):
        for prefetch in (False, True):
            model, _ = moestream_torch.load(path, budget, device=DEVICE, prefetch=prefetch)
            timed_decode(model, prompt, 16)  # warm-up: the hot experts become resident
            before = model.moestream.stats_dict()
            seconds, got = timed_decode(model, prompt, tokens)
            after = model.moestream.stats_dict()
            hits = after["hits"] - before["hits"]
            misses = after["misses"] - before["misses"]
            stall = after["stall_ms"] - before["stall_ms"]
            read = after["bytes_read"] - before["bytes_read"]
            out["streamed"].append({
                "budget": budget, "prefetch": prefetch, "tok_s": round(tokens / seconds, 2),
                "implementation": model.config._experts_implementation,
                "x_resident": round(resident / (tokens / seconds), 3),
                "tokens_equal": torch.equal(got, expected),
                "hit_rate": round(hits / max(hits + misses, 1), 3),
                "stall_ms_per_token": round(stall / tokens, 3),
                "mb_read_per_token": round(read / tokens / 1e6, 2)})
            print(json.dumps(out["streamed"][-1]), file=sys.stderr, flush=True)
            model.moestream.close()
            del model
            gc.collect()
            torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="qwen3_moe and gpt_oss only")
    parser.add_argument("--decode-tokens", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8, help="the benchmark model's layers")
    parser.add_argument("--bench-tokens", type=int, default=64)
    parser.add_argument("--skip-parity", action="store_true")
    parser.add_argument("--skip-compile", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    archs = ["qwen3_moe", "gpt_oss"] if args.quick else TORCH_ARCHITECTURES
    with tempfile.TemporaryDirectory() as tmp:
        result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "transformers": transformers.__version__}
        if not args.skip_parity:
            result.update(summary(*parity(Path(tmp), archs, args.decode_tokens)))
        if not args.skip_compile:
            result["compiled"] = compiled(Path(tmp), args.decode_tokens)
        if not args.skip_bench:
            result["decode"] = bench(Path(tmp), args.layers, args.bench_tokens)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        atomic_write_text(args.out, text)


if __name__ == "__main__":
    main()
