"""The streaming forward pass is exact: logits equal stock mlx-lm's bit for bit."""

import copy
import io
import pickle
import re
import threading

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

import mlx_moestream
from mlx_moestream import prefetch
from mlx_moestream.errors import ModelError
from mlx_moestream.mlx import load_lazy
from mlx_moestream.testing import ARCHITECTURES, PROMPT_IDS, greedy_logits

PROMPT = mx.array(PROMPT_IDS)
BUDGETS = ["min", "25%", "50%", "100%"]


def min_budget(path) -> int:
    return load_lazy(path)[-1].min_budget_bytes


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("bits", [None, 4])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_logits_match_stock_mlx_lm_bit_for_bit(tiny_model, reference, arch, bits, budget):
    path = tiny_model(arch, bits=bits)
    model, _ = mlx_moestream.load(path, budget=min_budget(path) if budget == "min" else budget)
    streamed = greedy_logits(model)
    expected = reference(path)
    assert all(mx.array_equal(a, b).item() for a, b in zip(streamed, expected))
    stats = mlx_moestream.stats(model)
    assert stats["resident_bytes"] <= stats["budget_bytes"]
    if budget != "100%":
        assert stats["evictions"] > 0


@pytest.mark.parametrize("budget", ["25%", "100%"])  # 100%: every expert read at load
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_per_expert_hugging_face_layout_streams_exactly(tiny_model, reference, arch, budget):
    stacked = tiny_model(arch)
    model, _ = mlx_moestream.load(tiny_model(arch, layout="per_expert"), budget=budget)
    assert all(mx.array_equal(a, b).item()
               for a, b in zip(greedy_logits(model), reference(stacked)))


def test_sharded_checkpoint_streams_exactly(tiny_model, reference):
    model, _ = mlx_moestream.load(tiny_model("qwen3_moe", shards=3), budget="25%")
    assert all(mx.array_equal(a, b).item()
               for a, b in zip(greedy_logits(model), reference(tiny_model("qwen3_moe"))))


def test_long_prefill_at_minimum_budget_computes_in_rounds(tiny_model):
    path = tiny_model("qwen3_moe")
    model, _ = mlx_moestream.load(path, budget=min_budget(path))
    cache = make_prompt_cache(model)
    mx.eval(model(PROMPT, cache=cache))
    stats = mlx_moestream.stats(model)
    # 8 experts routed by a 64-token prompt but only 2 slots: every layer loaded all 8.
    assert stats["slots"] == 2
    assert all(layer["loads"] == 8 for layer in stats["layers"])


def test_generate_and_stream_generate_work_unchanged(tiny_model):
    path = tiny_model("mixtral")
    model, tokenizer = mlx_moestream.load(path, budget="50%")
    ref_model, _ = mlx_lm.load(str(path))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Ciao"}],
                                           add_generation_prompt=True)
    text = mlx_lm.generate(model, tokenizer, prompt, max_tokens=12)
    assert text == mlx_lm.generate(ref_model, tokenizer, prompt, max_tokens=12)
    streamed = "".join(r.text for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=12))
    assert streamed == text


def test_batch_generate_matches_stock(tiny_model):
    """Prompts of different lengths, left-padded into one batch: every decode call routes
    several tokens at once."""
    path = tiny_model("mixtral")
    model, tokenizer = mlx_moestream.load(path, budget="50%")
    stock, _ = mlx_lm.load(str(path))
    prompts = [tokenizer.encode(text) for text in ("Ciao", "Una storia breve", "def f(x):")]
    expected = mlx_lm.batch_generate(stock, tokenizer, prompts, max_tokens=12).texts
    assert mlx_lm.batch_generate(model, tokenizer, prompts, max_tokens=12).texts == expected
    assert mlx_moestream.stats(model)["evictions"] > 0


@pytest.mark.parametrize("streamed_role", ["model", "draft_model"])
def test_speculative_decoding_matches_stock(tiny_model, streamed_role):
    """The main model verifies drafts several tokens per call, and mlx-lm trims the KV cache of
    the rejected ones; either model may be the streamed one."""
    path = tiny_model("mixtral")
    streamed, tokenizer = mlx_moestream.load(path, budget="50%")
    stock, other = mlx_lm.load(str(path))[0], mlx_lm.load(str(path))[0]

    def text(model, draft_model):
        return "".join(r.text for r in mlx_lm.stream_generate(
            model, tokenizer, "Ciao", max_tokens=16, draft_model=draft_model, num_draft_tokens=3))

    expected = text(stock, other)
    models = {"model": stock, "draft_model": other} | {streamed_role: streamed}
    assert text(**models) == expected
    assert mlx_moestream.stats(streamed)["evictions"] > 0


@pytest.mark.parametrize("budget", ["50%", "100%"])
def test_a_dtype_conversion_after_load_is_refused_at_the_next_call(tiny_model, budget):
    """set_dtype cannot reach the experts in their slot pools, and stock converts its own: a
    4-bit model's float16 logits differed from stock's by up to 0.018."""
    model, _ = mlx_moestream.load(tiny_model("qwen3_moe", bits=4), budget=budget)
    model.set_dtype(mx.float16)
    with pytest.raises(ModelError, match=r"switch_mlp: the model was converted to float16 after "
                                         r"load \(set_dtype\).*mlx_lm.convert --dtype float16"):
        greedy_logits(model)


@pytest.mark.parametrize("through", [mx.bfloat16, mx.float16])
def test_a_dtype_conversion_there_and_back_is_refused_at_the_next_call(tiny_model, through):
    """Stock's experts come back rounded from a conversion of less precision: its float32
    model's logits differed from the streamed model's by up to 0.0094 after bfloat16."""
    model, _ = mlx_moestream.load(tiny_model("qwen3_moe"), budget="50%")
    model.set_dtype(through)
    model.set_dtype(mx.float32)
    with pytest.raises(ModelError, match=r"switch_mlp: the model's weights were changed after "
                                         r"load \(model.apply, update, or set_dtype there and "
                                         r"back\)"):
        greedy_logits(model)


def test_a_conversion_to_the_stored_dtype_changes_nothing(tiny_model, reference):
    path = tiny_model("qwen3_moe")
    model, _ = mlx_moestream.load(path, budget="50%")
    model.set_dtype(mx.float32)
    assert all(mx.array_equal(a, b) for a, b in zip(greedy_logits(model), reference(path)))


@pytest.mark.parametrize("budget", ["50%", "100%"])
def test_a_change_of_the_weights_after_load_is_refused_at_the_next_call(tiny_model, budget):
    """Stock's `apply` changes its experts too; the streamed ones would stay as read."""
    model, _ = mlx_moestream.load(tiny_model("qwen3_moe"), budget=budget)
    model.apply(lambda a: a * 1.5)
    with pytest.raises(ModelError, match=r"switch_mlp: the model's weights were changed after "
                                         r"load \(model.apply, update"):
        greedy_logits(model)


def test_quantizing_experts_after_load_is_refused(tiny_model):
    model, _ = mlx_moestream.load(tiny_model("qwen3_moe"), budget="50%")
    with pytest.raises(ModelError, match="quantizing the model after load cannot reach its "
                                         "experts.*mlx_lm.convert -q"):
        nn.quantize(model, group_size=32, bits=4)


def test_quantizing_a_model_whose_experts_are_quantized_computes_as_stock(tiny_model):
    path = tiny_model("qwen3_moe", bits=4)
    model, _ = mlx_moestream.load(path, budget="50%")
    stock, _ = mlx_lm.load(str(path))
    for m in (model, stock):
        nn.quantize(m, group_size=32, bits=4)
    assert all(mx.array_equal(a, b) for a, b in zip(greedy_logits(model), greedy_logits(stock)))


def test_a_quantize_predicate_reading_the_experts_weight_is_refused(tiny_model):
    """`mlx_lm.utils.quantize_model`'s predicate reads each layer's `weight`: it failed with
    an AttributeError that named nothing."""
    model, _ = mlx_moestream.load(tiny_model("qwen3_moe"), budget="50%")
    with pytest.raises(ModelError, match="switch_mlp: the experts' weights are not the "
                                         "model's parameters"):
        nn.quantize(model, group_size=32, bits=4,
                    class_predicate=lambda _, m: (hasattr(m, "to_quantized")
                                                  and m.weight.shape[-1] % 32 == 0))


def test_lora_layers_given_no_keys_are_refused(tiny_model):
    """Without keys `linear_to_lora_layers` puts LoRA on stock's experts too; on a streamed
    model it left them out, and training gave other weights than stock's with no error."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, _ = mlx_moestream.load(tiny_model("qwen3_moe"), budget="100%")
    with pytest.raises(ModelError, match="switch_mlp: LoRA cannot reach the experts"):
        linear_to_lora_layers(model, 2, {"rank": 4, "scale": 10.0, "dropout": 0.0})


def test_an_optimizer_step_over_every_parameter_is_refused_at_the_next_call(tiny_model):
    """Every expert resident, a gradient works (the experts are not in a transformation's
    way), but the experts are not parameters: a full fine-tune left them as stored, and its
    logits differed from stock's trained the same way with no error."""
    import mlx.optimizers as optim

    model, _ = mlx_moestream.load(tiny_model("qwen3_moe"), budget="100%")
    loss, grads = nn.value_and_grad(model, lambda m: m(PROMPT).mean())(model)
    optim.Adam(1e-3).update(model, grads)
    with pytest.raises(ModelError, match="switch_mlp: an optimizer step reached the experts"):
        greedy_logits(model)


def test_compiling_with_the_model_state_as_inputs_works_with_every_expert_resident(
        tiny_model):
    """`mx.compile(..., inputs=model.state)`, as mlx-lm's trainer compiles its step: the check
    of the experts' marker read a traced array and failed with MLX's own error."""
    path = tiny_model("qwen3_moe")
    model, _ = mlx_moestream.load(path, budget="100%")
    stock, _ = mlx_lm.load(str(path))
    ours = mx.compile(lambda x: model(x), inputs=model.state)
    theirs = mx.compile(lambda x: stock(x), inputs=stock.state)
    assert mx.array_equal(ours(PROMPT), theirs(PROMPT)).item()


def test_stats_report_totals_and_layers(tiny_model):
    model, _ = mlx_moestream.load(tiny_model("qwen3_moe"), budget="50%", window_tokens=16)
    greedy_logits(model)
    stats = mlx_moestream.stats(model)
    for key in ("hits", "misses", "loads", "evictions", "bytes_read", "resident_bytes",
                "budget_bytes", "read_ms", "hit_rate_windows"):
        assert key in stats
    assert stats["tokens"] == 64 + 32
    assert stats["misses"] == stats["loads"]
    assert stats["hits"] == sum(layer["hits"] for layer in stats["layers"])
    assert len(stats["layers"]) == 2
    assert all(0 < layer["unique_experts"] <= 8 for layer in stats["layers"])
    assert [w["end_token"] for w in stats["hit_rate_windows"]] == [64, 80, 96]
    assert stats["bytes_read"] == stats["loads"] * 24576


def test_masked_expert_ids_do_not_trigger_loads(tiny_model):
    model, _ = mlx_moestream.load(tiny_model("qwen3_moe"), budget="50%")
    experts = model.model.layers[0].mlp.switch_mlp
    x = mx.ones((1, 3, 64))
    ids = mx.array([[[1, -1], [1, 8], [-1, 1]]])
    mx.eval(experts(x, ids))
    assert mlx_moestream.stats(model)["layers"][0]["loads"] == 1


def test_a_call_with_every_id_masked_computes_from_a_loaded_slot(tiny_model):
    """Its filled ids point at expert 0, which is read: no slot -1, no unread slot."""
    model, _ = mlx_moestream.load(tiny_model("qwen3_moe"), budget="50%")
    experts = model.model.layers[0].mlp.switch_mlp
    mx.eval(experts(mx.ones((1, 2, 64)), mx.array([[[-1, 8], [8, -1]]])))
    assert mlx_moestream.stats(model)["layers"][0]["loads"] == 1


def test_experts_are_not_model_parameters(tiny_model):
    from mlx.utils import tree_flatten

    model, _ = mlx_moestream.load(tiny_model("qwen3_moe"), budget="25%")
    expert_params = {n: a for n, a in tree_flatten(model.parameters()) if "switch_mlp" in n}
    assert expert_params  # a two-element marker per layer, which shows a conversion
    assert all(n.endswith(".expert_dtype") and a.size == 2 for n, a in expert_params.items())


@pytest.mark.parametrize("per_layer", [False, True])
@pytest.mark.parametrize("policy", ["lru", "lfu", "slru", "wlfu"])
def test_every_policy_keeps_logits_exact(tiny_model, reference, policy, per_layer):
    path = tiny_model("gpt_oss", bits=4)
    model, _ = mlx_moestream.load(path, budget="50%", policy=policy, per_layer=per_layer)
    assert all(mx.array_equal(a, b).item() for a, b in zip(greedy_logits(model), reference(path)))
    assert mlx_moestream.stats(model)["policy"] == policy


def test_policy_options_reach_the_live_policy(tiny_model):
    model, _ = mlx_moestream.load(tiny_model("qwen3_moe"), budget="50%",
                                  policy="wlfu:half_life=16")
    assert model.moestream.residency.caches[0].policies[0].half_life == 16
    assert mlx_moestream.stats(model)["policy"] == "wlfu:half_life=16"


def test_bad_policy_option_fails_before_the_model_is_read(tmp_path):
    with pytest.raises(ValueError, match="no option 'halflife'"):
        mlx_moestream.load(tmp_path / "no-such-model", policy="wlfu:halflife=16")


def test_belady_is_refused_live(tiny_model):
    with pytest.raises(ValueError, match="belady.*replay only"):
        mlx_moestream.load(tiny_model("qwen3_moe"), policy="belady")


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_prefetch_keeps_logits_exact_and_is_scored(tiny_model, reference, arch):
    path = tiny_model(arch, bits=4)
    model, _ = mlx_moestream.load(path, budget="50%", prefetch=True)
    assert all(mx.array_equal(a, b).item() for a, b in zip(greedy_logits(model), reference(path)))
    stats = mlx_moestream.stats(model)
    assert stats["prefetch_loads"] > 0
    assert 0 < stats["prediction_precision"] <= 1 and 0 < stats["prediction_recall"] <= 1
    assert stats["prefetch_used"] <= stats["prefetch_loads"]
    assert stats["resident_bytes"] <= stats["budget_bytes"]


def test_prefetch_reads_into_per_layer_shares_of_one_call_s_experts(tiny_model, reference):
    """This call's experts sit in its own layer's share, not the next one's: counted against
    the next layer's room, they stopped every read where a share held fewer than 2 x top-k,
    and each token paid for predictions that read nothing."""
    path = tiny_model("qwen3_moe", num_layers=4, num_experts=16)
    model, _ = mlx_moestream.load(path, budget=min_budget(path) * 4, prefetch=True,
                                  per_layer=True)  # top-k slots per layer
    assert set(model.moestream.residency.caches[0].limit.values()) == {model.moestream.plan.top_k}
    assert all(mx.array_equal(a, b).item() for a, b in zip(greedy_logits(model), reference(path)))
    assert mlx_moestream.stats(model)["prefetch_loads"] > 0


def _save_model(path, config: dict):
    """A random-weight mlx-lm model of an architecture `make_tiny_moe` does not build."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes, save_config

    from mlx_moestream.testing import _randomize
    from mlx_moestream.testing_tokenizer import make_tokenizer

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    _randomize(model, 0)
    path.mkdir()
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    save_config(config, path / "config.json")
    make_tokenizer(path, config["vocab_size"])
    return path


# A Nemotron-H whose experts compute in a narrower latent space (`moe_latent_size`, as
# Nemotron 3 Super): their input is not what the routers take.
LATENT_MOE = {"model_type": "nemotron_h", "vocab_size": 512, "hidden_size": 64,
              "intermediate_size": 128, "max_position_embeddings": 2048,
              "num_attention_heads": 4, "num_key_value_heads": 2, "attention_bias": False,
              "mamba_num_heads": 4, "mamba_head_dim": 16, "mamba_proj_bias": False,
              "ssm_state_size": 16, "conv_kernel": 4, "n_groups": 1, "mlp_bias": False,
              "layer_norm_epsilon": 1e-5, "use_bias": False, "use_conv_bias": True,
              "hybrid_override_pattern": "ME*E", "num_hidden_layers": 4, "head_dim": 16,
              "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 64,
              "moe_latent_size": 32, "n_group": 1, "n_routed_experts": 16, "n_shared_experts": 1,
              "topk_group": 1, "num_experts_per_tok": 2, "norm_topk_prob": True,
              "routed_scaling_factor": 1.0, "tie_word_embeddings": False}

# ERNIE-4.5-MoE names its experts per token `moe_k`.
ERNIE_MOE = {"model_type": "ernie4_5_moe", "hidden_size": 64, "intermediate_size": 128,
             "max_position_embeddings": 2048, "num_attention_heads": 4, "num_key_value_heads": 2,
             "num_hidden_layers": 3, "rms_norm_eps": 1e-5, "vocab_size": 512,
             "rope_theta": 500000.0, "use_bias": False, "tie_word_embeddings": True,
             "moe_num_experts": 16, "moe_k": 4, "moe_layer_start_index": 1,
             "moe_intermediate_size": 32, "moe_num_shared_experts": 1, "head_dim": 16}

# Hunyuan-A13B lists its experts per token (and expert widths, shared experts) per layer.
HUNYUAN_MOE = {"model_type": "hunyuan", "vocab_size": 512, "hidden_size": 64,
               "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
               "max_position_embeddings": 2048, "tie_word_embeddings": False,
               "num_hidden_layers": 2, "intermediate_size": 128, "attention_bias": False,
               "num_experts": 8, "moe_topk": [2, 3], "moe_intermediate_size": [32, 48],
               "num_shared_expert": [1, 1], "use_mixed_mlp_moe": True, "use_qk_norm": True,
               "use_cla": False, "cla_share_factor": 1, "rope_theta": 10000.0,
               "rope_scaling": {"alpha": 1000.0, "factor": 1.0, "type": "dynamic"}}


def test_prefetch_leaves_out_experts_whose_input_the_routers_do_not_take(tmp_path, reference):
    """A latent MoE's next router cannot predict from its experts' input: no prediction, the
    output still exact (the prediction raised a shape error on the first decode token)."""
    path = _save_model(tmp_path / "latent", LATENT_MOE)
    model, _ = mlx_moestream.load(path, budget="40%", prefetch=True)
    assert all(mx.array_equal(a, b).item() for a, b in zip(greedy_logits(model), reference(path)))


def test_a_config_naming_top_k_its_own_way_streams_exactly(tmp_path, reference):
    path = _save_model(tmp_path / "ernie", ERNIE_MOE)
    model, _ = mlx_moestream.load(path, budget="30%")
    assert model.moestream.plan.top_k == 4
    assert all(mx.array_equal(a, b).item() for a, b in zip(greedy_logits(model), reference(path)))


def test_a_config_listing_top_k_per_layer_streams_exactly(tmp_path, reference):
    path = _save_model(tmp_path / "hunyuan", HUNYUAN_MOE)
    model, _ = mlx_moestream.load(path, budget="40%")
    assert model.moestream.plan.top_k == 3  # the most of any layer: the minimum budget holds it
    assert all(mx.array_equal(a, b).item() for a, b in zip(greedy_logits(model), reference(path)))


def test_prefetch_finds_a_router_one_module_down(tmp_path, reference):
    """Hunyuan's router is `mlp.gate.wg`: prefetch predicted nothing for it."""
    path = _save_model(tmp_path / "hunyuan", HUNYUAN_MOE)
    model, _ = mlx_moestream.load(path, budget="70%", prefetch=True)
    assert all(mx.array_equal(a, b).item() for a, b in zip(greedy_logits(model), reference(path)))
    assert model.moestream.stats.predicted.sum() > 0


# Kimi-Linear: its checkpoints keep the experts in `block_sparse_moe`, mlx-lm in `mlp`.
KIMI_LINEAR = {"model_type": "kimi_linear", "vocab_size": 512, "hidden_size": 64,
               "num_attention_heads": 4, "num_key_value_heads": 4, "rms_norm_eps": 1e-6,
               "max_position_embeddings": 2048, "tie_word_embeddings": False,
               "num_hidden_layers": 4, "intermediate_size": 128, "head_dim": 16,
               "rope_theta": 10000.0, "model_max_length": 2048, "num_experts": 8,
               "moe_intermediate_size": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
               "qk_rope_head_dim": 8, "v_head_dim": 16, "num_experts_per_token": 2,
               "num_shared_experts": 1, "first_k_dense_replace": 1, "num_expert_group": 2,
               "topk_group": 1,
               "linear_attn_config": {"kda_layers": [1, 3], "full_attn_layers": [2, 4],
                                      "head_dim": 16, "num_heads": 4,
                                      "short_conv_kernel_size": 4}}


@pytest.mark.parametrize("config, renamed", [
    (LATENT_MOE, {"fc1": "up_proj", "fc2": "down_proj"}),  # Nemotron-H's names
    (KIMI_LINEAR, {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3",
                   "mlp": "block_sparse_moe"}),
])
def test_per_expert_checkpoints_that_mlx_lm_renames_stream_exactly(tmp_path, reference, config,
                                                                   renamed):
    """Original checkpoints: one tensor per expert, named as mlx-lm's sanitize() expects."""
    path = _save_model(tmp_path / "model", config)
    stacked = mx.load(str(path / "model.safetensors"))
    weights = {}
    for key, value in stacked.items():
        parent, found, tail = key.partition(".switch_mlp.")
        if not found:
            weights[key] = value
            continue
        layer, module = parent.rsplit(".", 1)
        proj, param = tail.split(".")
        for e in range(value.shape[0]):
            weights[f"{layer}.{renamed.get(module, module)}.experts.{e}."
                    f"{renamed[proj]}.{param}"] = value[e]
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    model, _ = mlx_moestream.load(path, budget="40%")
    assert all(mx.array_equal(a, b).item() for a, b in zip(greedy_logits(model), reference(path)))


# Granite-MoE: its checkpoints keep each expert's gate and up rows in one `input_linear`.
GRANITE_MOE = {"model_type": "granitemoe", "vocab_size": 512, "hidden_size": 64,
               "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
               "max_position_embeddings": 2048, "tie_word_embeddings": True,
               "num_hidden_layers": 3, "intermediate_size": 32, "attention_bias": False,
               "rope_theta": 10000.0, "logits_scaling": 4.0, "attention_multiplier": 0.1,
               "embedding_multiplier": 12.0, "residual_multiplier": 0.2,
               "num_local_experts": 8, "num_experts_per_tok": 2}


def test_gate_and_up_stacked_in_one_tensor_stream_exactly(tmp_path, reference):
    """mlx-lm splits Granite's `input_linear` [E, 2I, H] into gate and up: each expert's
    halves are read from it (the load was refused, the tensors in no shard)."""
    path = _save_model(tmp_path / "granite", GRANITE_MOE)
    weights = mx.load(str(path / "model.safetensors"))
    for key in [k for k in weights if ".switch_mlp.gate_proj." in k]:
        up, down = key.replace("gate_proj", "up_proj"), key.replace("gate_proj", "down_proj")
        weights[key.replace("switch_mlp.gate_proj", "input_linear")] = mx.concatenate(
            [weights.pop(key), weights.pop(up)], axis=1)
        weights[down.replace("switch_mlp.down_proj", "output_linear")] = weights.pop(down)
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    model, _ = mlx_moestream.load(path, budget="40%")
    assert all(mx.array_equal(a, b).item() for a, b in zip(greedy_logits(model), reference(path)))


def _alternate(a: mx.array, b: mx.array) -> mx.array:
    """Rows of `a` and `b` taken in turn: [E, R, ...] twice -> [E, 2R, ...]."""
    return mx.stack([a, b], axis=2).reshape(a.shape[0], 2 * a.shape[1], *a.shape[2:])


def test_gate_and_up_rows_alternating_in_one_tensor_stream_exactly(tmp_path, reference):
    """gpt-oss's own MXFP4 checkpoints alternate gate and up rows in `gate_up_proj_blocks`
    (and its scales and biases), which mlx-lm takes apart at load: each expert's rows are
    read at once and copied out (the load was refused, the tensors in no shard)."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes, save_config

    from mlx_moestream.testing import _randomize, tiny_config
    from mlx_moestream.testing_tokenizer import make_tokenizer

    config = tiny_config("gpt_oss")
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    _randomize(model, 0)
    nn.quantize(model, group_size=32, bits=4, mode="mxfp4",
                class_predicate=lambda path, m: ".experts." in path and hasattr(m, "to_quantized"))
    weights = dict(tree_flatten(model.parameters()))
    for key in [k for k in weights if k.endswith(".experts.gate_proj.weight")]:
        experts = key.rsplit(".", 2)[0]
        w = {f"{proj}.{p}": weights.pop(f"{experts}.{proj}.{p}")
             for proj in ("gate_proj", "up_proj", "down_proj") for p in ("weight", "scales", "bias")}
        blocks = _alternate(w["gate_proj.weight"], w["up_proj.weight"]).view(mx.uint8)
        down = w["down_proj.weight"].view(mx.uint8)
        weights.update({
            f"{experts}.gate_up_proj_blocks": blocks.reshape(*blocks.shape[:2], -1, 16),
            f"{experts}.gate_up_proj_scales": _alternate(w["gate_proj.scales"], w["up_proj.scales"]),
            f"{experts}.gate_up_proj_bias": _alternate(w["gate_proj.bias"], w["up_proj.bias"]),
            f"{experts}.down_proj_blocks": down.reshape(*down.shape[:2], -1, 16),
            f"{experts}.down_proj_scales": w["down_proj.scales"],
            f"{experts}.down_proj_bias": w["down_proj.bias"]})
    path = tmp_path / "gpt-oss"
    path.mkdir()
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    save_config(config, path / "config.json")
    make_tokenizer(path, config["vocab_size"])
    model, _ = mlx_moestream.load(path, budget="40%")
    assert all(mx.array_equal(a, b).item() for a, b in zip(greedy_logits(model), reference(path)))


def test_a_streamed_layer_syncs_once_per_call_for_its_ids(tiny_model):
    path = tiny_model("qwen3_moe", bits=4)
    model, _ = mlx_moestream.load(path, budget="50%")
    greedy_logits(model)
    stats = model.moestream.stats
    assert stats.syncs == 33 * len(model.moestream.plan.layers)  # its output is not waited for



def count_rounds(runtime, monkeypatch) -> list[int]:
    """A counter of the rounds `runtime` computes calls in (each waits: a host sync)."""
    made, rounds = [0], runtime.rounds

    def counted(layer, ids):
        for part in rounds(layer, ids):
            made[0] += 1
            yield part

    monkeypatch.setattr(runtime, "rounds", counted)
    return made


def test_a_call_computed_in_rounds_counts_the_wait_of_each_round(tiny_model, monkeypatch):
    path = tiny_model("qwen3_moe", bits=4)
    model, _ = mlx_moestream.load(path, budget=min_budget(path))
    rounds = count_rounds(model.moestream, monkeypatch)
    greedy_logits(model)
    assert rounds[0] > 0  # the prompt's calls
    assert model.moestream.stats.syncs == 33 * len(model.moestream.plan.layers) + rounds[0]


@pytest.mark.parametrize("budget", ["50%", "100%"])
def test_a_streamed_layer_call_converts_nothing_stock_does_not(tiny_model, budget, monkeypatch):
    """Slots go into the experts' matmuls as stock's uint32 ids: any other dtype costs a
    conversion before each of them, in every call."""
    path = tiny_model("qwen3_moe", bits=4)
    models = [mlx_lm.load(str(path))[0], mlx_moestream.load(path, budget=budget)[0]]
    monkeypatch.setattr(models[1].moestream.backend, "issue", lambda y: None)  # graph left to export
    x = mx.zeros((1, 1, models[0].args.hidden_size))
    ids = mx.array([[[1, 3]]], mx.uint32)
    graphs = []
    for model in models:
        dot = io.StringIO()
        mx.export_to_dot(dot, model.layers[0].mlp.switch_mlp(x, ids))
        graphs.append(sorted(re.findall(r'label ?= ?"?([A-Za-z]+)', dot.getvalue())))
    assert graphs[1].count("GatherQMM") == graphs[0].count("GatherQMM") == 3
    assert graphs[1].count("AsType") == graphs[0].count("AsType")


@pytest.mark.parametrize("budget", ["50%", "100%"])
@pytest.mark.parametrize("copy_", [copy.deepcopy, pickle.dumps])
def test_copying_or_pickling_a_streamed_model_is_refused_clearly(tiny_model, budget, copy_):
    """Stock's model pickles; ours failed on an mx.Dtype its experts modules hold."""
    model, _ = mlx_moestream.load(tiny_model("qwen3_moe", bits=4), budget=budget)
    with pytest.raises(ModelError, match="cannot be copied or pickled"):
        copy_(model)

def test_prefetch_predicts_nothing_when_every_expert_has_a_slot(tiny_model):
    model, _ = mlx_moestream.load(tiny_model("qwen3_moe", bits=4), budget="100%", prefetch=True)
    greedy_logits(model)
    stats = mlx_moestream.stats(model)
    assert stats["prediction_precision"] is None and stats["prefetch_loads"] == 0


def test_a_budget_holding_every_expert_reads_them_all_at_load(tiny_model):
    path = tiny_model("qwen3_moe", bits=4)
    model, _ = mlx_moestream.load(path, budget="100%")
    stats = mlx_moestream.stats(model)
    plan = model.moestream.plan
    assert stats["loads"] == plan.num_layers * plan.num_experts
    assert stats["bytes_read"] == plan.expert_bytes
    assert stats["resident_bytes"] == plan.expert_bytes and stats["misses"] == 0


def test_a_budget_holding_every_expert_never_syncs_and_counts_routing_later(tiny_model,
                                                                            reference):
    path = tiny_model("qwen3_moe", bits=4)
    model, _ = mlx_moestream.load(path, budget="100%")
    assert all(mx.array_equal(a, b).item() for a, b in zip(greedy_logits(model), reference(path)))
    stats = mlx_moestream.stats(model)  # the deferred routing is counted by now
    assert model.moestream.stats.syncs == 0
    assert stats["tokens"] == 64 + 32 and stats["misses"] == 0
    assert stats["hits"] == sum(l["hits"] for l in stats["layers"]) > 0
    assert stats["hit_rate_windows"][0]["end_token"] == 64


def test_prefetch_stops_reading_for_layers_whose_predictions_miss(tiny_model, monkeypatch):
    monkeypatch.setattr(prefetch, "PREFETCH_MIN_USEFUL", 1.01)  # no layer is right enough
    model, _ = mlx_moestream.load(tiny_model("qwen3_moe", bits=4), budget="25%", prefetch=True)
    greedy_logits(model)  # past the warm-up
    stats = model.moestream.stats
    loads, scored = stats.prefetch_loads.sum(), stats.predicted.sum()
    greedy_logits(model)
    assert stats.predicted.sum() > scored  # still predicting and scoring, now and then,
    assert stats.prefetch_loads.sum() == loads  # but reading nothing ahead


def test_only_one_token_calls_predict(tiny_model):
    model, _ = mlx_moestream.load(tiny_model("qwen3_moe", bits=4), budget="25%", prefetch=True)
    runtime, cache = model.moestream, make_prompt_cache(model)
    mx.eval(model(PROMPT[:, :3], cache=cache))  # a prompt whose experts fit the budget
    assert runtime.stats.predicted.sum() == 0  # its misses are read while it computes
    token = mx.array([[1]])
    for _ in range(8):
        token = mx.argmax(model(token, cache=cache)[:, -1], axis=-1)[:, None]
    assert runtime.prefetch.gate_predicted.sum() > 0


def test_a_layer_whose_prefetch_does_not_pay_is_predicted_on_one_token_in_eight(tiny_model,
                                                                                 monkeypatch):
    monkeypatch.setattr(prefetch, "PREFETCH_MIN_USEFUL", 1.01)
    model, _ = mlx_moestream.load(tiny_model("qwen3_moe", bits=4), budget="25%", prefetch=True)
    greedy_logits(model)
    runtime = model.moestream
    predictions = []
    read_ahead = runtime.read_ahead
    monkeypatch.setattr(runtime, "read_ahead", lambda *a: (predictions.append(a), read_ahead(*a)))
    greedy_logits(model)  # 33 calls per layer
    layers = len(runtime.plan.layers)
    assert 0 < len(predictions) <= (layers - 1) * (33 // prefetch.PREFETCH_PROBE + 1)


def test_a_prediction_shares_the_host_sync_of_the_calls_routed_ids(tiny_model, monkeypatch):
    model, _ = mlx_moestream.load(tiny_model("qwen3_moe", bits=4), budget="25%", prefetch=True)
    rounds = count_rounds(model.moestream, monkeypatch)  # the prompt's, which predict nothing
    greedy_logits(model)
    stats = model.moestream.stats
    assert stats.predicted.sum() > 0
    assert stats.syncs == 33 * len(model.moestream.plan.layers) + rounds[0]


@pytest.mark.parametrize("prefetch", [False, True])
def test_teacher_forced_tokens_without_eval_between_them_stay_exact(tiny_model, monkeypatch,
                                                                   prefetch):
    """Token t+1's loads must not overwrite slots that token t's last layer has yet to read:
    nothing forces that layer before the next token when the inputs are given, not sampled.
    Scheduled work runs at the latest here: only when something waits for it."""
    path = tiny_model("qwen3_moe", bits=4, num_layers=4)

    def logits(model):
        cache = make_prompt_cache(model)
        out = [model(PROMPT[:, i : i + 1], cache=cache) for i in range(32)]
        mx.eval(out)
        return out

    stock, _ = mlx_lm.load(str(path))
    model, _ = mlx_moestream.load(path, budget=min_budget(path), prefetch=prefetch)
    expected = logits(stock)
    monkeypatch.setattr(mx, "async_eval", lambda *arrays: None)
    assert all(mx.array_equal(a, b).item() for a, b in zip(expected, logits(model)))


def test_a_prompt_computes_its_resident_experts_while_its_misses_are_read(tiny_model,
                                                                          monkeypatch):
    model, _ = mlx_moestream.load(tiny_model("qwen3_moe", bits=4), budget="50%")
    runtime = model.moestream
    runtime.route(0, np.array([[[0, 1]]]))  # experts 0 and 1 of layer 0 resident
    gate, read = threading.Event(), runtime.reads.read

    def held_back(layer, expert, slot):
        if expert == 5:
            assert gate.wait(10)
        return read(layer, expert, slot)

    monkeypatch.setattr(runtime.reads, "read", held_back)
    ids = np.array([[[0, 5], [1, 6]]])  # a prompt of two tokens
    chunks = runtime.route_chunks(0, ids)
    positions, _ = next(chunks)  # while expert 5 is still being read
    assert not gate.is_set() and sorted(ids.reshape(-1)[positions]) == [0, 1]
    gate.set()
    assert sorted(e for positions, _ in chunks for e in ids.reshape(-1)[positions]) == [5, 6]


@pytest.mark.parametrize("budget", ["25%", "minimum"])  # chunks as read; rounds
def test_every_part_of_a_call_stock_sorts_by_expert_is_sorted_too(tiny_model, budget):
    """mlx-lm sorts a call of 64 ids or more by expert, and on Metal a sorted call runs
    another kernel than an unsorted one: a prompt computed in parts (chunks as their experts
    are read, rounds at a small budget) computes every part sorted, as stock does the whole."""
    path = tiny_model("qwen3_moe")
    model, _ = mlx_moestream.load(path, budget=min_budget(path) if budget == "minimum" else budget)
    sizes, experts = [], model.model.layers[0].mlp.switch_mlp
    inner = experts.inner

    def recording(x, indices):
        sizes.append(indices.size)
        return inner(x, indices)

    experts.inner = recording
    mx.eval(model(PROMPT))  # 64 tokens, top-2
    assert len(sizes) > 1 and min(sizes) >= 64, sizes


@pytest.mark.parametrize("transform", ["grad", "compile"])
@pytest.mark.parametrize("tokens", [1, 64])  # one call at once; a call in rounds at the minimum
def test_a_function_transformation_of_a_streamed_model_is_refused_clearly(tiny_model, reference,
                                                                           transform, tokens):
    """Later calls overwrite the slots a streamed call's experts are read into: a gradient or a
    compiled graph would read other experts (gradients came out wrong, silently, in rounds)."""
    path = tiny_model("qwen3_moe")
    model, _ = mlx_moestream.load(path, budget=min_budget(path))
    prompt = PROMPT[:, :tokens]
    call = {"grad": nn.value_and_grad(model, lambda x: model(x).sum()),
            "compile": mx.compile(lambda x: model(x))}[transform]
    with pytest.raises(ModelError, match="function transformation.*holds every expert"):
        call(prompt)
    assert all(mx.array_equal(a, b).item() for a, b in zip(greedy_logits(model), reference(path)))


def test_a_model_holding_every_expert_compiles_and_then_generates_like_stock(tiny_model,
                                                                             reference):
    """Every expert resident: compiling works as stock's does, and the routing its trace left
    behind (never computable) is not counted, rather than failing the next call."""
    path = tiny_model("qwen3_moe")
    model, _ = mlx_moestream.load(path, budget="100%")
    stock, _ = mlx_lm.load(str(path))
    ours, theirs = mx.compile(lambda x: model(x)), mx.compile(lambda x: stock(x))
    for n in (8, 9, 10):  # a trace each
        assert mx.array_equal(ours(PROMPT[:, :n]), theirs(PROMPT[:, :n])).item()
    assert all(mx.array_equal(a, b).item() for a, b in zip(greedy_logits(model), reference(path)))
