import json

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

from mlx_moestream.testing import (
    ARCHITECTURES,
    PER_EXPERT_ARCHITECTURES,
    make_tiny_moe,
    tiny_config,
)


def _load_parameters(path) -> dict:
    model, _ = mlx_lm.load(str(path))
    return dict(tree_flatten(model.parameters()))


def _assert_same_parameters(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert mx.array_equal(a[name], b[name]), name


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_architecture_loads_and_generates_text(tmp_path, arch):
    model, tokenizer = mlx_lm.load(str(make_tiny_moe(tmp_path, arch)))
    text = mlx_lm.generate(model, tokenizer, "Ciao, come stai?", max_tokens=8)
    assert isinstance(text, str) and text


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_parameter_is_randomized(tmp_path, arch):
    for name, p in _load_parameters(make_tiny_moe(tmp_path, arch)).items():
        assert not mx.all(p == 0).item(), name
        assert not mx.all(p == 1).item(), name


@pytest.mark.parametrize("arch", PER_EXPERT_ARCHITECTURES)
def test_per_expert_layout_loads_same_parameters_as_stacked(tmp_path, arch):
    stacked = make_tiny_moe(tmp_path / "stacked", arch, seed=7)
    per_expert = make_tiny_moe(tmp_path / "per_expert", arch, seed=7, layout="per_expert")
    _assert_same_parameters(_load_parameters(stacked), _load_parameters(per_expert))


@pytest.mark.parametrize("arch", PER_EXPERT_ARCHITECTURES)
def test_per_expert_layout_writes_one_tensor_per_expert(tmp_path, arch):
    names = mx.load(str(make_tiny_moe(tmp_path, arch, layout="per_expert") / "model.safetensors"))
    assert not any(".switch_mlp." in n for n in names)
    assert any(".experts.7." in n for n in names)


def test_per_expert_layout_is_refused_for_gpt_oss(tmp_path):
    with pytest.raises(ValueError, match="gpt_oss"):
        make_tiny_moe(tmp_path, "gpt_oss", layout="per_expert")


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_bits_4_loads_quantized_switch_experts(tmp_path, arch):
    model, tokenizer = mlx_lm.load(str(make_tiny_moe(tmp_path, arch, bits=4)))
    experts = [m for _, m in model.named_modules() if isinstance(m, QuantizedSwitchLinear)]
    assert experts and all(m.bits == 4 for m in experts)
    assert mlx_lm.generate(model, tokenizer, "def route(", max_tokens=4)


def test_bits_8_with_wide_experts_uses_group_size_64(tmp_path):
    path = make_tiny_moe(tmp_path, "mixtral", bits=8, moe_intermediate_size=64)
    config = json.loads((path / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": 8, "mode": "affine"}


def test_a_quantized_model_holds_one_layer_of_float_weights_at_a_time_while_built(tmp_path):
    """Benchmarks build models of a real model's layer shape: 12 float32 layers of Qwen3-30B-A3B
    would not fit in memory, their quantized weights do."""
    layers, shape = 8, {"num_experts": 32, "moe_intermediate_size": 256, "hidden_size": 256}
    float_layer = 3 * shape["num_experts"] * shape["moe_intermediate_size"] * 256 * 4
    mx.reset_peak_memory()
    before = mx.get_active_memory()  # what other tests keep alive
    make_tiny_moe(tmp_path, "qwen3_moe", bits=4, num_layers=layers, **shape)
    assert mx.get_peak_memory() - before < 3 * float_layer < layers * float_layer


def test_shards_write_an_index_and_load_identically(tmp_path):
    single = make_tiny_moe(tmp_path / "single", "qwen3_moe")
    sharded = make_tiny_moe(tmp_path / "sharded", "qwen3_moe", shards=3)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    _assert_same_parameters(_load_parameters(single), _load_parameters(sharded))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_overrides_change_expert_count_and_top_k(tmp_path, arch):
    path = make_tiny_moe(tmp_path, arch, num_experts=16, top_k=3, num_layers=4)
    model, _, config = mlx_lm.load(str(path), return_config=True)
    experts = [p for n, p in tree_flatten(model.parameters()) if n.endswith("gate_proj.weight")]
    assert {p.shape[0] for p in experts if p.ndim == 3} == {16}
    assert config["num_experts_per_tok"] == 3
    assert config["num_hidden_layers"] == len(model.layers) == 4


def test_unknown_override_is_refused():
    with pytest.raises(ValueError, match="num_expert"):
        tiny_config("qwen3_moe", num_expert=4)


def test_deepseek_v3_has_dense_first_layer_then_grouped_moe():
    config = tiny_config("deepseek_v3")
    assert config["first_k_dense_replace"] == 1
    assert config["num_hidden_layers"] - 1 >= 2
    assert config["n_group"] > 1 and config["topk_group"] > 1 and config["n_shared_experts"]


def test_tokenizer_vocab_matches_config(tmp_path):
    _, tokenizer = mlx_lm.load(str(make_tiny_moe(tmp_path, "olmoe")))
    assert len(tokenizer.get_vocab()) == tiny_config("olmoe")["vocab_size"]


def test_chat_template_renders_chatml(tmp_path):
    _, tokenizer = mlx_lm.load(str(make_tiny_moe(tmp_path)))
    messages = [{"role": "user", "content": "Ciao!"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    expected = "<|im_start|>user\nCiao!<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(ids) == expected
    assert tokenizer.eos_token == "<|im_end|>"
