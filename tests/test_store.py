"""The store finds each expert's bytes and reads exactly them."""

import mlx_moestream
import numpy as np
from safetensors.numpy import load_file

from mlx_moestream.store import ExpertStore

SHAPES = {"gate_proj.weight": (32, 64), "up_proj.weight": (32, 64), "down_proj.weight": (64, 32)}


def _params():
    return {n: (s, int(np.prod(s)) * 4) for n, s in SHAPES.items()}


def _read(store, layer, expert):
    dest = {n: np.empty(s, np.float32) for n, s in SHAPES.items()}
    nbytes = store.read_expert(layer, expert, dest)
    assert nbytes == sum(b for _, b in _params().values())
    return dest


def test_stacked_expert_reads_equal_the_tensor_slice(tiny_model):
    path = tiny_model("qwen3_moe")
    store = ExpertStore(path)
    layer = store.add_layer("model.layers.1.mlp.switch_mlp", _params(), 8)
    tensors = load_file(path / "model.safetensors")
    got = _read(store, layer, 5)
    for name in SHAPES:
        np.testing.assert_array_equal(got[name], tensors[f"model.layers.1.mlp.switch_mlp.{name}"][5])


def test_per_expert_reads_equal_the_expert_tensor(tiny_model):
    path = tiny_model("mixtral", layout="per_expert")
    store = ExpertStore(path)
    layer = store.add_layer("model.layers.0.block_sparse_moe.switch_mlp", _params(), 8)
    tensors = load_file(path / "model.safetensors")
    got = _read(store, layer, 3)
    prefix = "model.layers.0.block_sparse_moe.experts.3"
    np.testing.assert_array_equal(got["gate_proj.weight"], tensors[f"{prefix}.w1.weight"])
    np.testing.assert_array_equal(got["up_proj.weight"], tensors[f"{prefix}.w3.weight"])
    np.testing.assert_array_equal(got["down_proj.weight"], tensors[f"{prefix}.w2.weight"])


def test_sharded_model_indexes_every_shard(tiny_model):
    store = ExpertStore(tiny_model("qwen3_moe", shards=3))
    assert len(store.files) == 3
    assert "model.layers.1.mlp.switch_mlp.down_proj.weight" in store.tensors


def test_a_whole_layer_read_in_small_pieces_equals_the_expert_reads(tiny_model, monkeypatch):
    from mlx_moestream import store as store_module

    monkeypatch.setattr(store_module, "READ_CHUNK_BYTES", 4096)
    model, _ = mlx_moestream.load(tiny_model("qwen3_moe"), budget="100%")
    runtime = model.moestream
    pool = runtime.pools[0]
    for layer in range(len(runtime.plan.layers)):
        for expert in (0, 5):
            want = {n: v.copy() for n, v in pool.slot(runtime.caches[0].slot_of[layer, expert]).items()}
            got = pool.slot(0)
            saved = {n: v.copy() for n, v in got.items()}
            runtime.store.read_expert(runtime.store_layer[layer], expert, got)
            assert all(np.array_equal(want[n], got[n]) for n in want)
            for n, v in saved.items():
                got[n][...] = v
