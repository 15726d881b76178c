"""Train the small bilingual MoE shipped in `mlx_moestream/assets/embedded/`.

The model is exactly mlx-lm's `qwen3_moe` (RMSNorm, q/k norm, non-traditional RoPE, GQA, softmax
router -> top-k -> renormalised, SwiGLU experts), written in torch so it trains on a 2-core CPU.
Parameter names match mlx-lm's, so export is a rename-free save (see export_embedded.py).
A Switch-style load-balancing loss (coefficient 0.01) keeps every expert in use without
flattening the language-dependent routing the caching profiles rely on.

Recorded run (seed 0, torch 2.13.0+cpu):
  data: scripts/build_corpus.py --seed 0 (fortunes-it 1.51 MB, fortunes 2.35 MB, Python stdlib
        3.92 MB train split); domain mix it/en/py = 0.35/0.35/0.30; half of the fortunes
        rendered as ChatML user/assistant turns.
  tokenizer: byte-level BPE, vocab 3000 (incl. <|endoftext|>, <|im_start|>, <|im_end|>).
  model: 14.92 M parameters (hidden 256, 4 MoE layers, 16 experts, top-2, expert width 256).
  run: `train --steps 900 --max-minutes 21 --threads 1`: 662 steps x 16 x 256 = 2.71 M tokens
       in 1260 s (21.0 min; ~2150 tok/s). The machine was shared with other jobs: 2 torch
       threads fell to ~450 tok/s under that load (OpenMP threads waiting on each other),
       1 thread held ~2200 tok/s, and the wall-time budget decided the step count.
  final loss: train (EMA) 3.449; held-out italian 3.683, english 4.261, python 3.587 nats.

    python scripts/train_embedded.py tokenizer    # -> /tmp/embedded-work/tokenizer
    python scripts/train_embedded.py train --steps 900 --max-minutes 21 --threads 1
For a load-independent rerun use `--steps 662` without `--max-minutes` (same data order; the
schedule then follows steps, so the numbers differ slightly from the recorded run).
"""

import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import click
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from build_corpus import read_split  # noqa: E402

from mlx_moestream.testing_tokenizer import make_tokenizer  # noqa: E402

DOMAINS = ("italian", "english", "python")


@dataclass
class ModelArgs:
    """mlx-lm's qwen3_moe ModelArgs, field for field (written verbatim into config.json)."""

    vocab_size: int
    model_type: str = "qwen3_moe"
    hidden_size: int = 256
    num_hidden_layers: int = 4
    intermediate_size: int = 512  # unused: every layer is MoE
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    num_experts: int = 16
    num_experts_per_tok: int = 2
    decoder_sparse_step: int = 1
    mlp_only_layers: list = field(default_factory=list)
    moe_intermediate_size: int = 256
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    norm_topk_prob: bool = True


# ---------------------------------------------------------------- tokenizer


def chat_turn(user: str, assistant: str) -> str:
    """One ChatML exchange, byte-identical to what the chat template renders plus the answer."""
    return (
        f"<|im_start|>user\n{user}<|im_end|>\n"
        f"<|im_start|>assistant\n{assistant}<|im_end|>\n"
    )


def train_tokenizer(corpus: Path, out: Path, vocab_size: int) -> None:
    """Byte-level BPE over the train splits, saved as HF files mlx_lm.load reads offline."""
    lines = (line for d in DOMAINS
             for line in (corpus / d / "train.txt").read_text(encoding="utf-8").splitlines(True))
    make_tokenizer(out, vocab_size, lines, min_frequency=2)


# ---------------------------------------------------------------- data


def as_chat(doc: str, other: str) -> str:
    """First third of a fortune's lines as the question, the rest as the answer.

    A one- or two-line fortune becomes the question and `other` (same language) the answer.
    """
    lines = doc.splitlines()
    if len(lines) >= 3:
        cut = max(1, len(lines) // 3)
        return chat_turn("\n".join(lines[:cut]).strip(), "\n".join(lines[cut:]).strip())
    return chat_turn(doc.strip(), other.strip())


def render_documents(docs: list[str], chat_fraction: float, rng: random.Random) -> list[str]:
    """Shuffle documents and render `chat_fraction` of them as ChatML turns."""
    docs = list(docs)
    rng.shuffle(docs)
    return [
        as_chat(d, rng.choice(docs)) if rng.random() < chat_fraction else d
        for d in docs
    ]


def token_stream(tok, texts: list[str]) -> torch.Tensor:
    """Documents joined by <|endoftext|> into one long int64 stream."""
    eot = tok.token_to_id("<|endoftext|>")
    ids = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.long)


def load_streams(corpus: Path, tok, split: str, seed: int, chat_fraction: float) -> dict:
    """One token stream per domain; fortunes get ChatML turns, code never does."""
    rng = random.Random(seed)
    streams = {}
    for domain in DOMAINS:
        docs = read_split(corpus / domain / f"{split}.txt")
        fraction = chat_fraction if domain != "python" else 0.0
        streams[domain] = token_stream(tok, render_documents(docs, fraction, rng))
    return streams


def sample_batch(
    streams: dict, mix: dict, batch: int, seq_len: int, gen: torch.Generator
) -> torch.Tensor:
    """`batch` random windows of seq_len+1 tokens; each row's domain is drawn from `mix`."""
    names = list(mix)
    weights = torch.tensor([mix[n] for n in names])
    picks = torch.multinomial(weights, batch, replacement=True, generator=gen)
    rows = []
    for p in picks.tolist():
        stream = streams[names[p]]
        start = torch.randint(0, len(stream) - seq_len - 1, (1,), generator=gen).item()
        rows.append(stream[start : start + seq_len + 1])
    return torch.stack(rows)


def heldout_windows(stream: torch.Tensor, seq_len: int, max_windows: int) -> torch.Tensor:
    """Consecutive non-overlapping windows from the start of a held-out stream."""
    n = min(max_windows, (len(stream) - 1) // seq_len)
    return torch.stack([stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])


# ---------------------------------------------------------------- model


class RMSNorm(nn.Module):
    """x / rms(x) * weight, as mlx.nn.RMSNorm."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(head_dim: int, theta: float, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for non-traditional RoPE (halves rotated, as mlx nn.RoPE traditional=False)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.arange(length, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of the head dimension; x is [B, H, L, D]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    """GQA attention with per-head q/k RMSNorm before RoPE (Qwen3)."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = (
            a.num_attention_heads, a.num_key_value_heads, a.head_dim
        )
        self.q_proj = nn.Linear(a.hidden_size, self.n_heads * a.head_dim, bias=False)
        self.k_proj = nn.Linear(a.hidden_size, self.n_kv_heads * a.head_dim, bias=False)
        self.v_proj = nn.Linear(a.hidden_size, self.n_kv_heads * a.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * a.head_dim, a.hidden_size, bias=False)
        self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
        self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, L, self.n_heads, -1)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, L, self.n_kv_heads, -1)).transpose(1, 2)
        v = self.v_proj(x).view(B, L, self.n_kv_heads, -1).transpose(1, 2)
        q, k = apply_rope(q, cos[:L], sin[:L]), apply_rope(k, cos[:L], sin[:L])
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, -1))


class SwitchLinear(nn.Module):
    """Stacked expert weights [E, out, in], the layout of mlx-lm's SwitchLinear."""

    def __init__(self, n_experts: int, in_dim: int, out_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, out_dim, in_dim))


class SwitchGLU(nn.Module):
    """SwiGLU experts; tokens are gathered per expert so only routed tokens are computed."""

    def __init__(self, dim: int, hidden: int, n_experts: int):
        super().__init__()
        self.gate_proj = SwitchLinear(n_experts, dim, hidden)
        self.up_proj = SwitchLinear(n_experts, dim, hidden)
        self.down_proj = SwitchLinear(n_experts, hidden, dim)

    def forward(self, x: torch.Tensor, inds: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """x [N, D], inds/scores [N, k] -> sum_k scores * expert_k(x)."""
        flat_expert = inds.reshape(-1)
        flat_token = torch.arange(x.shape[0]).repeat_interleave(inds.shape[1])
        flat_score = scores.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)
        counts = torch.bincount(flat_expert, minlength=self.gate_proj.weight.shape[0]).tolist()
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            sel = order[start : start + n]
            start += n
            tokens = flat_token[sel]
            xe = x.index_select(0, tokens)
            h = F.silu(xe @ self.gate_proj.weight[e].T) * (xe @ self.up_proj.weight[e].T)
            ye = (h @ self.down_proj.weight[e].T) * flat_score[sel, None]
            out = out.index_add(0, tokens, ye)
        return out


class SparseMoeBlock(nn.Module):
    """Softmax router -> top-k -> renormalised scores -> experts; also returns the aux loss."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.top_k, self.norm_topk_prob, self.n_experts = (
            a.num_experts_per_tok, a.norm_topk_prob, a.num_experts
        )
        self.gate = nn.Linear(a.hidden_size, a.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(a.hidden_size, a.moe_intermediate_size, a.num_experts)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        scores, inds = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            scores = scores / scores.sum(-1, keepdim=True)
        y = self.switch_mlp(x, inds, scores)
        return y.reshape(shape), self.balance_loss(probs, inds)

    def balance_loss(self, probs: torch.Tensor, inds: torch.Tensor) -> torch.Tensor:
        """Switch Transformer loss E * sum_e f_e * P_e (1.0 when perfectly balanced)."""
        dispatch = torch.bincount(inds.reshape(-1), minlength=self.n_experts).float()
        fraction = dispatch / dispatch.sum()
        return self.n_experts * (fraction * probs.mean(0)).sum()


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.self_attn = Attention(a)
        self.mlp = SparseMoeBlock(a)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, x, cos, sin):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        r, aux = self.mlp(self.post_attention_layernorm(h))
        return h + r, aux


class Backbone(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(a) for _ in range(a.num_hidden_layers)])
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)


class Qwen3Moe(nn.Module):
    """Module tree named like mlx-lm's qwen3_moe.Model, so state_dict keys export as-is."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.args = a
        self.model = Backbone(a)
        self.lm_head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        cos, sin = rope_tables(a.head_dim, a.rope_theta, a.max_position_embeddings)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 style init: N(0, 0.02), residual outputs scaled down by depth."""
        out_std = 0.02 / math.sqrt(2 * self.args.num_hidden_layers)
        for name, p in self.named_parameters():
            if p.dim() == 1:
                continue
            std = out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            nn.init.normal_(p, std=std)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [B, L, V] and the mean load-balancing loss over layers."""
        h = self.model.embed_tokens(tokens)
        aux = []
        for layer in self.model.layers:
            h, a = layer(h, self.rope_cos, self.rope_sin)
            aux.append(a)
        return self.lm_head(self.model.norm(h)), torch.stack(aux).mean()


# ---------------------------------------------------------------- training


def lr_at(step: int, progress: float, peak: float, warmup: int) -> float:
    """Linear warmup over `warmup` steps, then cosine down to 10% of peak as progress -> 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def run_progress(step: int, steps: int, elapsed_s: float, budget_s: float) -> float:
    """Fraction of the run done: by steps, or by wall time when a budget is set.

    The wall-time budget keeps the run inside its time box on a shared, loaded machine; the
    cost is that the step count then depends on the load (it is recorded).
    """
    by_steps = step / steps
    return max(by_steps, elapsed_s / budget_s) if budget_s > 0 else by_steps


def make_optimizer(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW; no decay on norms (1-D parameters)."""
    decay = [p for p in model.parameters() if p.dim() > 1]
    rest = [p for p in model.parameters() if p.dim() <= 1]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def evaluate(model: Qwen3Moe, windows: dict, batch: int) -> dict:
    """Mean next-token loss per domain on fixed held-out windows."""
    model.eval()
    losses = {}
    for domain, w in windows.items():
        total = 0.0
        for i in range(0, len(w), batch):
            chunk = w[i : i + batch]
            logits, _ = model(chunk[:, :-1])
            total += lm_loss(logits, chunk[:, 1:]).item() * len(chunk)
        losses[domain] = total / len(w)
    model.train()
    return losses


def save_checkpoint(model: Qwen3Moe, out: Path, meta: dict) -> None:
    """state_dict (mlx-lm names) + config.json + the run's record."""
    out.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), out / "model.pt")
    (out / "config.json").write_text(json.dumps(asdict(model.args), indent=2))
    (out / "train_record.json").write_text(json.dumps(meta, indent=2))


@click.group()
def cli() -> None:
    """Tokenizer and training for the embedded MoE."""


@cli.command()
@click.option("--corpus", type=click.Path(path_type=Path), default=Path("/tmp/embedded-work/corpus"))
@click.option("--out", type=click.Path(path_type=Path), default=Path("/tmp/embedded-work/tokenizer"))
@click.option("--vocab-size", type=int, default=3000)
def tokenizer(corpus: Path, out: Path, vocab_size: int) -> None:
    """Train the byte-level BPE tokenizer on the train splits."""
    train_tokenizer(corpus, out, vocab_size)
    click.echo(f"tokenizer written to {out}")


@cli.command()
@click.option("--corpus", type=click.Path(path_type=Path), default=Path("/tmp/embedded-work/corpus"))
@click.option("--tokenizer", "tok_dir", type=click.Path(path_type=Path),
              default=Path("/tmp/embedded-work/tokenizer"))
@click.option("--out", type=click.Path(path_type=Path), default=Path("/tmp/embedded-work/ckpt"))
@click.option("--steps", type=int, default=1000)
@click.option("--batch", type=int, default=16)
@click.option("--seq-len", type=int, default=256)
@click.option("--lr", type=float, default=2e-3)
@click.option("--warmup", type=int, default=50)
@click.option("--aux-coef", type=float, default=0.01)
@click.option("--chat-fraction", type=float, default=0.5)
@click.option("--eval-every", type=int, default=200)
@click.option("--seed", type=int, default=0)
@click.option("--max-minutes", type=float, default=0.0,
              help="wall-time budget; the cosine schedule follows elapsed time (0 = steps only)")
@click.option("--threads", type=int, default=2,
              help="torch threads; 1 is faster when other jobs share the 2 cores")
def train(corpus, tok_dir, out, steps, batch, seq_len, lr, warmup, aux_coef, chat_fraction,
          eval_every, seed, max_minutes, threads) -> None:
    """Train from scratch and save a checkpoint with mlx-lm parameter names."""
    from tokenizers import Tokenizer

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    train_streams = load_streams(corpus, tok, "train", seed, chat_fraction)
    held_streams = load_streams(corpus, tok, "heldout", seed, 0.0)
    held = {d: heldout_windows(s, seq_len, 16) for d, s in held_streams.items()}
    click.echo("train tokens: " + ", ".join(f"{d}={len(s)}" for d, s in train_streams.items()))
    mix = {"italian": 0.35, "english": 0.35, "python": 0.30}
    model = Qwen3Moe(ModelArgs(vocab_size=tok.get_vocab_size()))
    click.echo(f"params: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M")
    opt = make_optimizer(model, lr, 0.1)
    gen = torch.Generator().manual_seed(seed)
    t0, ema, budget_s = time.time(), None, max_minutes * 60
    step = 0
    while (progress := run_progress(step, steps, time.time() - t0, budget_s)) < 1.0:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, progress, lr, warmup)
        x = sample_batch(train_streams, mix, batch, seq_len, gen)
        logits, aux = model(x[:, :-1])
        loss = lm_loss(logits, x[:, 1:])
        opt.zero_grad(set_to_none=True)
        (loss + aux_coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % 10 == 0:
            elapsed = time.time() - t0
            tps = (step + 1) * batch * seq_len / elapsed
            click.echo(f"step {step} loss {loss.item():.3f} ema {ema:.3f} aux {aux.item():.3f} "
                       f"lr {g['lr']:.2e} {tps:.0f} tok/s {elapsed:.0f}s", err=True)
        step += 1
        if step % eval_every == 0:
            click.echo(f"heldout {evaluate(model, held, batch)}", err=True)
    steps = step
    wall_s = time.time() - t0
    heldout = evaluate(model, held, batch)
    meta = {"seed": seed, "steps": steps, "batch": batch, "seq_len": seq_len,
            "max_minutes": max_minutes, "threads": threads,
            "tokens_trained": steps * batch * seq_len, "wall_s": round(wall_s, 1),
            "final_train_loss_ema": round(ema, 4), "heldout_loss": heldout, "mix": mix,
            "lr": lr, "aux_coef": aux_coef, "chat_fraction": chat_fraction,
            "train_stream_tokens": {d: len(s) for d, s in train_streams.items()}}
    save_checkpoint(model, out, meta)
    click.echo(json.dumps(meta, indent=2))


if __name__ == "__main__":
    cli()
