"""Tiny random transformers MoE checkpoints, built from their config classes (no download).

`make_tiny_hf_moe` writes what `save_pretrained` writes, in the original per-expert layout or
transformers' fused one, with a tokenizer trained here: what `mlx_moestream.torch.load` and
transformers' own `from_pretrained` both read.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

# Small configs with enough layers that a quarter of the experts exceeds one layer's, and rows
# of tens of KiB, so that the pages rows share (see `torch._pages_touched`) cost a few percent.
COMMON = dict(vocab_size=512, hidden_size=256, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=256)  # hidden / heads
TINY_CONFIGS = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=96, moe_intermediate_size=128,
                                         num_experts=8, num_experts_per_tok=2)),
    "mixtral": ("MixtralConfig", dict(intermediate_size=128, num_local_experts=8,
                                      num_experts_per_tok=2)),
    "gpt_oss": ("GptOssConfig", dict(intermediate_size=128, num_local_experts=8,
                                     num_experts_per_tok=2, sliding_window=64,
                                     layer_types=["sliding_attention", "full_attention"] * 3)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(intermediate_size=96, moe_intermediate_size=128,
                                         shared_expert_intermediate_size=64, num_experts=8,
                                         num_experts_per_tok=2)),
    "olmoe": ("OlmoeConfig", dict(intermediate_size=128, num_experts=8, num_experts_per_tok=2)),
    "deepseek_v3": ("DeepseekV3Config", dict(intermediate_size=96, moe_intermediate_size=128,
                                             n_routed_experts=8, num_experts_per_tok=2,
                                             n_shared_experts=1, n_group=2, topk_group=1,
                                             first_k_dense_replace=1, q_lora_rank=None,
                                             kv_lora_rank=16, qk_rope_head_dim=8,
                                             qk_nope_head_dim=8, v_head_dim=16,
                                             head_dim=8)),  # rope runs on qk_rope_head_dim
}
TORCH_ARCHITECTURES = list(TINY_CONFIGS)
# 16 experts, 4 per token: with 2, a token's two expert outputs add the same in either order,
# so a remap that changes the order of the sum could pass as exact.
WIDER = {
    "qwen3_moe": dict(num_experts=16, num_experts_per_tok=4),
    "mixtral": dict(num_local_experts=16, num_experts_per_tok=4),
    "gpt_oss": dict(num_local_experts=16, num_experts_per_tok=4),
    "qwen2_moe": dict(num_experts=16, num_experts_per_tok=4),
    "olmoe": dict(num_experts=16, num_experts_per_tok=4),
    "deepseek_v3": dict(n_routed_experts=16, num_experts_per_tok=4),
}
# Checkpoints built for the tests of one behaviour each, not run through every test.
MORE_CONFIGS = {
    # experts that compute every expert for every token (no routed ids to stream by)
    "llama4_text": ("Llama4TextConfig", dict(intermediate_size=128, intermediate_size_mlp=96,
                                             num_local_experts=8, num_experts_per_tok=1,
                                             interleave_moe_layer_step=1)),
    # 8 experts plus 2 identity ("zero") experts the router may pick
    "longcat_flash": ("LongcatFlashConfig", dict(ffn_hidden_size=96, expert_ffn_hidden_size=128,
                                                 n_routed_experts=8, moe_topk=2,
                                                 zero_expert_num=2, num_layers=2, q_lora_rank=32,
                                                 kv_lora_rank=16, qk_rope_head_dim=8,
                                                 qk_nope_head_dim=8, v_head_dim=16, head_dim=8,
                                                 num_key_value_heads=4)),
    # a renaming (`post_mlp_layernorm` -> `mlp.post_mlp_layernorm`) that matches its own output
    "axk1": ("AXK1Config", dict(intermediate_size=96, moe_intermediate_size=128,
                                n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                                n_group=1, topk_group=1,
                                mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
                                num_hidden_layers=4, q_lora_rank=32, kv_lora_rank=16,
                                qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                                head_dim=8, num_key_value_heads=4)),
    # original checkpoints with stacked experts transformers renames: Granite's
    # `input_linear` / `output_linear`, Aria's `experts.fc1` / `experts.fc2`
    "granitemoe": ("GraniteMoeConfig", dict(intermediate_size=128, num_local_experts=8,
                                            num_experts_per_tok=2)),
    "aria_text": ("AriaTextConfig", dict(intermediate_size=128, moe_num_experts=8, moe_topk=2,
                                         moe_num_shared_experts=1)),
    # a router bias its original checkpoints keep among the experts, which transformers moves
    "laguna": ("LagunaConfig", dict(intermediate_size=96, moe_intermediate_size=128,
                                    shared_expert_intermediate_size=64, num_experts=8,
                                    num_experts_per_tok=2, sliding_window=64)),
    # its original checkpoints keep q/k/v convolutions apart, which transformers concatenates
    "kimi_linear": ("KimiLinearConfig", dict(intermediate_size=96, moe_intermediate_size=128,
                                             num_local_experts=8, num_experts_per_tok=2,
                                             n_shared_experts=1, num_hidden_layers=4,
                                             layer_types=["linear_attention",
                                                          "full_attention"] * 2,
                                             linear_head_dim=32, linear_num_heads=4,
                                             q_lora_rank=None, kv_lora_rank=16,
                                             qk_rope_head_dim=8, qk_nope_head_dim=8,
                                             v_head_dim=16, head_dim=8, num_key_value_heads=4,
                                             pad_token_id=1, bos_token_id=0, eos_token_id=2)),
}


def make_tiny_hf_moe(path, arch: str = "qwen3_moe", *, fused: bool = False,
                     dtype: str = "float32", seed: int = 0, **fields) -> Path:
    """Save a random-weight `arch` model to `path`: per-expert tensors as the original
    checkpoints name them, or (`fused`) the `experts.gate_up_proj` tensors transformers holds.
    `fields` change its config (`WIDER`: more experts per token)."""
    import transformers

    from .testing_tokenizer import make_tokenizer

    class_name, defaults = {**TINY_CONFIGS, **MORE_CONFIGS}[arch]
    config = getattr(transformers, class_name)(**{**COMMON, **defaults, **fields})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    with torch.no_grad():  # the default init leaves biases and some norms at 0 or 1
        for param in model.parameters():
            param.normal_(0.0, 0.1)
    path = Path(path)
    model.save_pretrained(path, save_original_format=not fused)
    make_tokenizer(path, vocab_size=COMMON["vocab_size"])
    return path
