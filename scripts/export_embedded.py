"""Export the trained torch checkpoint to mlx-lm, quantize it, and measure its routing.

`export`: writes an mlx-lm float32 checkpoint (qwen3_moe, experts stacked as
`model.layers.{l}.mlp.switch_mlp.{gate,up,down}_proj.weight` [E, out, in]), checks mlx-lm's
logits against torch's on held-out text, quantizes to 4 bits with `mlx_lm.convert` and installs
the result plus small held-out texts into `mlx_moestream/assets/embedded/`.

`analyze`: runs the shipped 4-bit model on each workload's held-out text, counts router top-k
choices per layer, and writes docs/embedded-model.md and docs/embedded-routing.png. The point is
to show that routing depends on the language, which is what makes per-workload profiles useful.

    python scripts/export_embedded.py export
    python scripts/export_embedded.py analyze
"""

import json
import shutil
import sys
from pathlib import Path

import click
import mlx.core as mx
import numpy as np

import mlx_moestream
from mlx_moestream import profiles

sys.path.insert(0, str(Path(__file__).parent))
from build_corpus import read_split  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
ASSETS = REPO / "mlx_moestream" / "assets" / "embedded"
WORK = Path("/tmp/embedded-work")
DOMAINS = ("italian", "english", "python")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
HELDOUT_CHARS = 8000
WINDOW_TOKENS = 256
SAMPLE_PROMPTS = {
    "italian": "Ciao, come stai?",
    "english": "Hello, how are you today?",
}


# ---------------------------------------------------------------- export


def write_float_checkpoint(ckpt: Path, tokenizer: Path, out: Path) -> None:
    """torch state_dict -> mlx-lm layout; names already match, so this is a dtype/format move."""
    import torch
    from safetensors.numpy import save_file

    state = torch.load(ckpt / "model.pt", map_location="cpu")
    weights = {k: v.float().numpy() for k, v in state.items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "mlx"})
    config = json.loads((ckpt / "config.json").read_text())
    config["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer / name, out / name)


def eval_windows(corpus: Path, tokenizer_dir: Path) -> dict:
    """The exact held-out windows training evaluated on (same rendering, seed and order).

    Reusing them makes the mlx losses directly comparable with the torch ones in the record.
    """
    from tokenizers import Tokenizer

    from train_embedded import heldout_windows, load_streams

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    streams = load_streams(corpus, tok, "heldout", seed=0, chat_fraction=0.0)
    return {d: heldout_windows(s, WINDOW_TOKENS, 16).tolist() for d, s in streams.items()}


def torch_logits(ckpt: Path, ids: list[int]) -> np.ndarray:
    """Logits of the training-time torch model, the reference for the export check."""
    import torch

    from train_embedded import ModelArgs, Qwen3Moe

    model = Qwen3Moe(ModelArgs(**json.loads((ckpt / "config.json").read_text())))
    model.load_state_dict(torch.load(ckpt / "model.pt", map_location="cpu"))
    model.eval()
    with torch.no_grad():
        logits, _ = model(torch.tensor([ids]))
    return logits[0].numpy()


def compare_logits(ckpt: Path, float_dir: Path, corpus: Path) -> dict:
    """Max |mlx - torch| logit difference per domain on the first held-out window."""
    from mlx_lm import load

    model, _ = load(str(float_dir))
    windows = eval_windows(corpus, float_dir)
    diffs = {}
    for domain in DOMAINS:
        ids = windows[domain][0][:WINDOW_TOKENS]
        ref = torch_logits(ckpt, ids)
        got = np.array(model(mx.array([ids]))[0].astype(mx.float32))
        diffs[domain] = float(np.abs(got - ref).max())
    return diffs


def quantize(float_dir: Path, out: Path) -> None:
    """4-bit affine, group 64, via mlx-lm's own convert (router stays 8-bit, its predicate)."""
    from mlx_lm import convert

    if out.exists():
        shutil.rmtree(out)
    convert(hf_path=str(float_dir), mlx_path=str(out), quantize=True, q_bits=4,
            q_group_size=64, dtype="float32")


def install_assets(quant_dir: Path, tokenizer: Path, corpus: Path) -> None:
    """Copy the 4-bit weights, our own tokenizer files and a few KB of held-out text.

    The tokenizer files come from the tokenizer step, not from convert's re-save: those name
    a transformers-5-only class, ours (PreTrainedTokenizerFast + chat_template) load anywhere.
    """
    if ASSETS.exists():
        shutil.rmtree(ASSETS)
    (ASSETS / "heldout").mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "model.safetensors.index.json"):
        shutil.copy(quant_dir / name, ASSETS / name)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer / name, ASSETS / name)
    for domain in DOMAINS:
        text = cut_text(read_split(corpus / domain / "heldout.txt"), HELDOUT_CHARS)
        (ASSETS / "heldout" / f"{domain}.txt").write_text(text, encoding="utf-8")


def cut_text(docs: list[str], max_chars: int) -> str:
    """Whole documents (the first one cut if needed) until `max_chars`."""
    out, total = [], 0
    for doc in docs:
        if total + len(doc) > max_chars:
            if not out:
                out.append(doc[:max_chars])
            break
        out.append(doc)
        total += len(doc) + 2
    return "\n\n".join(out)


def sample_generations(model_dir: Path, max_tokens: int = 32) -> dict:
    """Greedy answers to one chat prompt per language."""
    from mlx_lm import generate, load

    model, tok = load(str(model_dir))
    out = {}
    for lang, prompt in SAMPLE_PROMPTS.items():
        chat = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                       add_generation_prompt=True)
        out[lang] = {"prompt": prompt,
                     "answer": generate(model, tok, chat, max_tokens=max_tokens)}
    return out


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# ---------------------------------------------------------------- routing analysis


def expert_counts(ids: list[int]) -> np.ndarray:
    """[layers, experts] tokens routed to each expert, counted by the runtime itself while it
    reads `ids` in training-length windows."""
    model, _ = mlx_moestream.load(ASSETS, budget="100%")
    for start in range(0, len(ids), WINDOW_TOKENS):
        mx.eval(model(mx.array([ids[start : start + WINDOW_TOKENS]])))
    return mlx_moestream.profile(model, "analysis").counts


def js_divergence(p: np.ndarray, q: np.ndarray) -> float:
    """Jensen-Shannon divergence in bits (0 = same distribution, 1 = disjoint)."""
    return float(profiles.js_divergence(p.astype(float), q.astype(float)))


def top_quarter_share(counts: np.ndarray) -> float:
    """Share of activations carried by the busiest 25% of experts (0.25 = uniform)."""
    top = np.sort(counts)[::-1][: max(1, len(counts) // 4)]
    return float(top.sum() / counts.sum())


def heldout_loss(model, windows: list[list[int]]) -> float:
    """Mean next-token cross-entropy over windows of WINDOW_TOKENS + 1 tokens."""
    import mlx.nn as nn

    batch = mx.array(windows)
    logits = model(batch[:, :-1])
    return float(nn.losses.cross_entropy(logits, batch[:, 1:], reduction="mean"))


def plot_heatmap(counts: dict, path: Path) -> None:
    """One panel per layer: workloads x experts, colour = share of that workload's choices."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n_layers = next(iter(counts.values())).shape[0]
    fig, axes = plt.subplots(n_layers, 1, figsize=(8, 1.3 * n_layers + 0.8), sharex=True)
    for layer, ax in enumerate(np.atleast_1d(axes)):
        share = np.stack([c[layer] / c[layer].sum() for c in counts.values()])
        im = ax.imshow(share, aspect="auto", cmap="viridis", vmin=0)
        ax.set_yticks(range(len(counts)), list(counts))
        ax.set_ylabel(f"layer {layer}", rotation=0, ha="right", va="center")
        fig.colorbar(im, ax=ax, fraction=0.02, pad=0.01)
    np.atleast_1d(axes)[-1].set_xlabel("expert")
    np.atleast_1d(axes)[-1].set_xticks(range(share.shape[1]))
    fig.suptitle("Embedded MoE: share of router top-k choices per expert")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---------------------------------------------------------------- report


def markdown_report(r: dict) -> str:
    """docs/embedded-model.md from the analysis results (no hand-edited numbers)."""
    cfg, rec = r["config"], r["train_record"]
    lines = [
        "# The embedded model",
        "",
        "`mlx_moestream/assets/embedded/` ships a small bilingual (Italian/English) plus Python",
        "Mixture-of-Experts, so `mlx-moestream chat` works with no download and the per-workload",
        "caching profiles (`italian-chat`, `english-chat`, `python-code`) describe real,",
        "language-dependent routing. It is mlx-lm's `qwen3_moe` architecture, trained from scratch",
        "with `scripts/train_embedded.py` and exported/quantized with `scripts/export_embedded.py`.",
        "It is a toy: it writes language-shaped text, not sensible answers.",
        "",
        "## Config",
        "",
        "| field | value |",
        "|---|---|",
    ]
    keys = ("hidden_size", "num_hidden_layers", "num_experts", "num_experts_per_tok",
            "moe_intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "vocab_size", "norm_topk_prob", "tie_word_embeddings", "rope_theta",
            "max_position_embeddings")
    lines += [f"| {k} | {cfg[k]} |" for k in keys]
    lines += [
        f"| parameters (float) | {r['n_params'] / 1e6:.2f} M |",
        f"| quantization | {cfg['quantization']['bits']}-bit affine, group "
        f"{cfg['quantization']['group_size']} (router `mlp.gate` 8-bit); float32 activations |",
        f"| size on disk (assets dir) | {r['asset_bytes'] / 1e6:.2f} MB |",
        "",
        "## Training",
        "",
        "- Data (`scripts/build_corpus.py --seed 0`, offline): Italian from Debian `fortunes-it`,",
        "  English from `fortunes`/`fortunes-min` (offensive and ASCII-art files skipped), Python",
        "  from the interpreter's standard library (no tests, capped at 4 MB). Held-out: 5% of",
        "  documents, seeded.",
        "- Half of the fortunes are rendered as ChatML turns (first third of the lines as the",
        "  user message, the rest as the assistant answer), so a chat prompt is answered in its",
        "  own language.",
        f"- Train-split tokens: {rec['train_stream_tokens']}; mix {rec['mix']}.",
        f"- {rec['steps']} steps x {rec['batch']} x {rec['seq_len']} = "
        f"{rec['tokens_trained'] / 1e6:.2f} M tokens, AdamW (peak lr {rec['lr']}, cosine), "
        f"load-balancing coefficient {rec['aux_coef']}, seed {rec['seed']}.",
        f"- Wall time: {rec['wall_s'] / 60:.1f} min on a shared 2-core CPU (torch "
        f"{rec.get('threads', 2)} thread(s); the cosine schedule followed a "
        f"{rec.get('max_minutes', 0):g}-minute wall-time budget, so the step count reflects the "
        "machine's load).",
        f"- Final train loss (EMA): {rec['final_train_loss_ema']:.3f}.",
        f"- Export check: max |mlx-lm float32 - torch| logit difference on held-out text: "
        f"{max(r['logit_diff'].values()):.2e}.",
        "",
        "## Held-out loss",
        "",
        "Next-token loss (nats) on the held-out documents (never trained on), mlx-lm on the",
        "same windows the training run evaluated (torch column: the training record).",
        "",
        "| workload | tokens | torch loss | float32 loss | float32 ppl | 4-bit loss | 4-bit ppl |",
        "|---|---|---|---|---|---|---|",
    ]
    for d in DOMAINS:
        t, f, q = rec["heldout_loss"][d], r["loss_float"][d], r["loss_4bit"][d]
        lines.append(f"| {d} | {r['loss_tokens'][d]} | {t:.3f} | {f:.3f} | {np.exp(f):.1f} | "
                     f"{q:.3f} | {np.exp(q):.1f} |")
    lines += [
        "",
        "## Routing depends on the language",
        "",
        "Counts of router top-k choices per layer, from the 4-bit model on the shipped held-out",
        "texts (`assets/embedded/heldout/`). Jensen-Shannon divergence in bits between expert",
        "distributions; the *halves* columns compare the two halves of one text and give the",
        "noise floor.",
        "",
        "| layer | it vs en | it vs py | en vs py | it halves | en halves | py halves |",
        "|---|---|---|---|---|---|---|",
    ]
    for layer, row in enumerate(r["js"]):
        lines.append("| " + " | ".join([str(layer)] + [f"{row[k]:.3f}" for k in JS_KEYS]) + " |")
    lines += [
        "",
        "Share of activations carried by the busiest 25% of experts (0.25 would be uniform):",
        "",
        "| layer | " + " | ".join(DOMAINS) + " |",
        "|---|" + "---|" * len(DOMAINS),
    ]
    for layer, row in enumerate(r["top_quarter"]):
        lines.append(f"| {layer} | " + " | ".join(f"{row[d]:.2f}" for d in DOMAINS) + " |")
    lines += ["", "![expert use per layer and workload](embedded-routing.png)", "",
              "## Sample generations (4-bit, greedy, 32 tokens)", ""]
    for lang, g in r["samples"].items():
        lines += [f"- {lang}: `{g['prompt']}` ->", "", "  ```", *[
            "  " + s for s in g["answer"].splitlines()], "  ```", ""]
    return "\n".join(lines) + "\n"


JS_KEYS = ("it-en", "it-py", "en-py", "it-halves", "en-halves", "py-halves")


def js_table(counts: dict, halves: dict) -> list[dict]:
    """Per layer: divergences between workloads and between halves of each workload."""
    it, en, py = counts["italian"], counts["english"], counts["python"]
    rows = []
    for l in range(it.shape[0]):
        rows.append({
            "it-en": js_divergence(it[l], en[l]), "it-py": js_divergence(it[l], py[l]),
            "en-py": js_divergence(en[l], py[l]),
            **{f"{d[:2]}-halves": js_divergence(halves[d][0][l], halves[d][1][l])
               for d in DOMAINS},
        })
    return rows


def routing_analysis(tok) -> tuple[dict, dict]:
    """Counts per workload on the shipped held-out text, whole and in two halves."""
    counts, halves = {}, {}
    for d in DOMAINS:
        ids = tok.encode((ASSETS / "heldout" / f"{d}.txt").read_text(encoding="utf-8"))
        mid = len(ids) // 2
        halves[d] = (expert_counts(ids[:mid]), expert_counts(ids[mid:]))
        counts[d] = halves[d][0] + halves[d][1]
    return counts, halves


@click.group()
def cli() -> None:
    """Export, quantize and analyse the embedded MoE."""


@cli.command()
@click.option("--ckpt", type=click.Path(path_type=Path), default=WORK / "ckpt")
@click.option("--tokenizer", type=click.Path(path_type=Path), default=WORK / "tokenizer")
@click.option("--corpus", type=click.Path(path_type=Path), default=WORK / "corpus")
def export(ckpt: Path, tokenizer: Path, corpus: Path) -> None:
    """torch -> mlx-lm float32 -> logits check -> 4-bit -> package assets."""
    float_dir, quant_dir = WORK / "float", WORK / "q4"
    write_float_checkpoint(ckpt, tokenizer, float_dir)
    diffs = compare_logits(ckpt, float_dir, corpus)
    click.echo(f"max |logit diff| mlx vs torch: {diffs}")
    quantize(float_dir, quant_dir)
    install_assets(quant_dir, tokenizer, corpus)
    samples = sample_generations(ASSETS)
    record = {"logit_diff": diffs, "asset_bytes": dir_bytes(ASSETS), "samples": samples}
    (WORK / "export_record.json").write_text(json.dumps(record, indent=2, ensure_ascii=False))
    click.echo(json.dumps(record, indent=2, ensure_ascii=False))


@cli.command()
@click.option("--corpus", type=click.Path(path_type=Path), default=WORK / "corpus")
def analyze(corpus: Path) -> None:
    """Losses (float and 4-bit), routing divergences, heatmap and docs/embedded-model.md."""
    from mlx.utils import tree_flatten
    from mlx_lm import load

    record = json.loads((WORK / "export_record.json").read_text())
    float_model, tok = load(str(WORK / "float"))
    q_model, _ = load(str(ASSETS))
    ids = eval_windows(corpus, WORK / "float")
    counts, halves = routing_analysis(tok)
    report = {
        "config": json.loads((ASSETS / "config.json").read_text()),
        "train_record": json.loads((WORK / "ckpt" / "train_record.json").read_text()),
        "n_params": sum(v.size for _, v in tree_flatten(float_model.parameters())),
        "asset_bytes": dir_bytes(ASSETS),
        "logit_diff": record["logit_diff"],
        "samples": record["samples"],
        "loss_tokens": {d: len(v) * WINDOW_TOKENS for d, v in ids.items()},
        "loss_float": {d: heldout_loss(float_model, v) for d, v in ids.items()},
        "loss_4bit": {d: heldout_loss(q_model, v) for d, v in ids.items()},
        "js": js_table(counts, halves),
        "top_quarter": [{d: top_quarter_share(counts[d][l]) for d in DOMAINS}
                        for l in range(counts["italian"].shape[0])],
        "counts": {d: c.tolist() for d, c in counts.items()},
    }
    (WORK / "analysis.json").write_text(json.dumps(report, indent=2, ensure_ascii=False))
    plot_heatmap(counts, REPO / "docs" / "embedded-routing.png")
    (REPO / "docs" / "embedded-model.md").write_text(markdown_report(report), encoding="utf-8")
    click.echo(json.dumps({k: report[k] for k in ("loss_float", "loss_4bit", "js",
                                                  "top_quarter")}, indent=2))


if __name__ == "__main__":
    cli()
