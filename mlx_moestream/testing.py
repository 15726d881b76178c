"""Tiny random-weight MoE checkpoints built on the spot, so tests and benchmarks never download.

The models are mlx-lm's own classes, so the tensor names, the sanitize() paths and the
quantized layouts are exactly the ones a real checkpoint of the same architecture has.
"""

import dataclasses
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes, quantize_model, save_config

from .testing_tokenizer import make_tokenizer

ARCHITECTURES: tuple[str, ...] = (
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "deepseek_v3",
    "gpt_oss",
)

# Architectures whose sanitize() stacks one tensor per expert (the Hugging Face layout).
PER_EXPERT_ARCHITECTURES: tuple[str, ...] = ARCHITECTURES[:5]

_SHARED = {
    "vocab_size": 512,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    # Ids of <|endoftext|> and <|im_end|>, the first special tokens make_tokenizer adds.
    "pad_token_id": 0,
    "eos_token_id": 2,
}

_CONFIGS = {
    "mixtral": {
        "num_hidden_layers": 2,
        "intermediate_size": 32,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "rope_theta": 1e6,
    },
    "qwen2_moe": {
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "rope_theta": 1e6,
    },
    "qwen3_moe": {
        "num_hidden_layers": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "rope_theta": 1e6,
    },
    "olmoe": {
        "num_hidden_layers": 2,
        "num_key_value_heads": 4,
        "intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": False,
        "rope_theta": 10000.0,
    },
    "deepseek_v3": {
        "num_hidden_layers": 3,
        "num_key_value_heads": 4,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 4,
        "topk_group": 2,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "rope_theta": 10000.0,
    },
    "gpt_oss": {
        "num_hidden_layers": 2,
        "head_dim": 16,
        "intermediate_size": 32,
        "num_local_experts": 8,
        "num_experts_per_tok": 4,
        "sliding_window": 8,
        "rope_theta": 150000,
        "max_position_embeddings": 131072,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
    },
}

# Each architecture spells the expert count and the expert width its own way.
_EXPERT_FIELDS = {
    "mixtral": ("num_local_experts", "intermediate_size"),
    "qwen2_moe": ("num_experts", "moe_intermediate_size"),
    "qwen3_moe": ("num_experts", "moe_intermediate_size"),
    "olmoe": ("num_experts", "intermediate_size"),
    "deepseek_v3": ("n_routed_experts", "moe_intermediate_size"),
    "gpt_oss": ("num_local_experts", "intermediate_size"),
}

_MIXTRAL_PROJ = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}


def tiny_config(arch: str, **overrides) -> dict:
    """A small but complete HF-style config.json dict for `arch` (model_type=arch).

    Overrides take the generic names `num_experts`, `top_k`, `hidden_size`,
    `moe_intermediate_size` and `num_layers`, or any field of the architecture's ModelArgs.
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"Unknown architecture {arch!r}; choose from {ARCHITECTURES}.")
    config = {"model_type": arch, **_SHARED, **_CONFIGS[arch]}
    experts_field, width_field = _EXPERT_FIELDS[arch]
    generic = {
        "num_experts": experts_field,
        "moe_intermediate_size": width_field,
        "top_k": "num_experts_per_tok",
        "num_layers": "num_hidden_layers",
    }
    _, args_class = _get_classes(config)
    fields = {f.name for f in dataclasses.fields(args_class)} | config.keys()
    for name, value in overrides.items():
        key = generic.get(name, name)
        if key not in fields:
            raise ValueError(f"{arch} has no config field {name!r}.")
        config[key] = value
    if arch == "gpt_oss" and "layer_types" not in overrides:
        kinds = ("sliding_attention", "full_attention")
        config["layer_types"] = [kinds[i % 2] for i in range(config["num_hidden_layers"])]
    return config


def make_tiny_moe(
    path,
    arch: str = "qwen3_moe",
    *,
    layout: str = "stacked",
    bits: int | None = None,
    seed: int = 0,
    shards: int = 1,
    **overrides,
) -> Path:
    """Build and save a random-weight model directory that mlx_lm.load() reads.

    `layout="stacked"` writes the mlx-community names ([E, out, in] expert tensors);
    `layout="per_expert"` writes the Hugging Face names that the architecture's sanitize()
    stacks at load time. `bits` quantizes with mlx-lm's own quantize_model.
    """
    if layout not in ("stacked", "per_expert"):
        raise ValueError(f"Unknown layout {layout!r}; choose 'stacked' or 'per_expert'.")
    if layout == "per_expert" and arch not in PER_EXPERT_ARCHITECTURES:
        raise ValueError(f"{arch} has no per-expert layout; use layout='stacked'.")
    if bits is not None and layout != "stacked":
        raise ValueError("Quantized models are only written in the stacked layout.")
    config = tiny_config(arch, **overrides)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    _randomize(model, seed)
    if bits is not None:
        model, config = quantize_model(model, config, _group_size(model), bits)
    for layer in model.layers:  # one layer's float weights at a time, then only quantized ones
        mx.eval(layer.parameters())
    mx.eval(model.parameters())
    weights = dict(tree_flatten(model.parameters()))
    if layout == "per_expert":
        weights = _unstack_experts(weights, arch)
        if arch == "deepseek_v3":
            weights = _merge_kv_b_proj(weights, config)

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _save_weights(path, weights, shards)
    save_config(config, path / "config.json")
    make_tokenizer(path, config["vocab_size"])
    return path


def _randomize(model, seed: int) -> None:
    """Replace mlx-lm's init (zeros for routers, sinks and biases) so every path is exercised."""
    params = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), len(params))
    model.load_weights(
        [(name, _random_like(name, p, key)) for (name, p), key in zip(params, keys)]
    )


def _random_like(name: str, p: mx.array, key: mx.array) -> mx.array:
    noise = mx.random.normal(p.shape, key=key)
    if p.ndim > 1:
        return noise * p.shape[-1] ** -0.5
    if name.endswith(".weight"):
        return 1 + 0.02 * noise  # norms
    return 0.02 * noise  # biases, attention sinks, routing score bias


def _group_size(model) -> int:
    """64 as mlx-lm defaults, 32 when some quantizable input width does not divide by 64."""
    widths = [
        m.weight.shape[-1] for _, m in model.named_modules() if hasattr(m, "to_quantized")
    ]
    return 64 if all(w % 64 == 0 for w in widths) else 32


def _unstack_experts(weights: dict, arch: str) -> dict:
    """Split each [E, ...] switch tensor into the per-expert tensors sanitize() stacks back."""
    unstacked = {}
    for name, w in weights.items():
        if ".switch_mlp." not in name:
            unstacked[name] = w
            continue
        prefix, rest = name.split(".switch_mlp.")
        proj, param = rest.split(".")
        if arch == "mixtral":
            proj = _MIXTRAL_PROJ[proj]
        for e in range(w.shape[0]):
            unstacked[f"{prefix}.experts.{e}.{proj}.{param}"] = w[e]
    return unstacked


def _merge_kv_b_proj(weights: dict, config: dict) -> dict:
    """Invert deepseek_v3 sanitize()'s split of kv_b_proj into embed_q and unembed_out."""
    for l in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{l}.self_attn"
        wk = weights.pop(f"{prefix}.embed_q.weight")  # [heads, kv_lora_rank, qk_nope]
        wv = weights.pop(f"{prefix}.unembed_out.weight")  # [heads, v_head, kv_lora_rank]
        kv_b = mx.concatenate([wk.swapaxes(-1, -2), wv], axis=1)
        weights[f"{prefix}.kv_b_proj.weight"] = kv_b.reshape(-1, kv_b.shape[-1])
    return weights


def _save_weights(path: Path, weights: dict, shards: int) -> None:
    """Write one file, or `shards` files of about equal bytes plus the HF index."""
    if shards == 1:
        mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
        return
    if not 1 < shards <= len(weights):
        raise ValueError(f"shards must be between 1 and {len(weights)}, got {shards}.")
    parts = _split_by_bytes(weights, shards)
    weight_map = {}
    for i, part in enumerate(parts):
        file_name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        mx.save_safetensors(str(path / file_name), part, metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(part, file_name))
    index = {
        "metadata": {"total_size": sum(w.nbytes for w in weights.values())},
        "weight_map": dict(sorted(weight_map.items())),
    }
    with open(path / "model.safetensors.index.json", "w") as f:
        json.dump(index, f, indent=4)


def _split_by_bytes(weights: dict, shards: int) -> list[dict]:
    """Cut the tensors, in order, into `shards` non-empty runs of about equal bytes."""
    target = sum(w.nbytes for w in weights.values()) / shards
    parts = [{}]
    size = 0
    for i, (name, w) in enumerate(weights.items()):
        left = len(weights) - i
        full = size >= target * len(parts) or left == shards - len(parts)
        if parts[-1] and full and len(parts) < shards:
            parts.append({})
        parts[-1][name] = w
        size += w.nbytes
    return parts


# The prompt of the exactness tests: 64 random token ids, the same on every backend and host.
PROMPT_IDS = np.random.default_rng(0).integers(3, 500, size=(1, 64))


def greedy_logits(model, decode_tokens: int = 32) -> list[mx.array]:
    """Logits of a 64-token prefill (`PROMPT_IDS`) and of each greedy decode step: what the
    exactness tests compare with stock mlx-lm's."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = [model(mx.array(PROMPT_IDS), cache=cache)]
    token = mx.argmax(logits[-1][:, -1], axis=-1)
    for _ in range(decode_tokens):
        logits.append(model(token[:, None], cache=cache))
        token = mx.argmax(logits[-1][:, -1], axis=-1)
    mx.eval(logits)
    return logits
