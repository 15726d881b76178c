"""The store finds each expert's bytes and reads exactly them."""

import os
import re

import mlx_moestream
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from mlx_moestream.errors import StoreError
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


def test_a_full_budget_load_read_in_small_runs_equals_the_expert_reads(tiny_model, monkeypatch):
    from mlx_moestream import store as store_module

    monkeypatch.setattr(store_module, "READ_RUN_BYTES", 4096)  # tensors cut in pieces
    monkeypatch.setattr(store_module, "IOV_MAX", 4)  # at most two pieces a read
    model, _ = mlx_moestream.load(tiny_model("qwen3_moe"), budget="100%")
    runtime = model.moestream
    pool = runtime.residency.pools[0]
    for layer in range(len(runtime.plan.layers)):
        for expert in (0, 5):
            slot = runtime.residency.slot_map(layer)[expert]
            want = {n: v.copy() for n, v in pool.slot(slot).items()}
            got = pool.slot(0)
            saved = {n: v.copy() for n, v in got.items()}
            runtime.store.read_expert(runtime.residency.store_layer[layer], expert, got)
            assert all(np.array_equal(want[n], got[n]) for n in want)
            for n, v in saved.items():
                got[n][...] = v


def test_a_full_budget_load_reads_a_small_model_in_one_read_in_file_order(tiny_model):
    store = ExpertStore(tiny_model("qwen3_moe"))
    dests = {}
    for prefix in sorted({k.rsplit(".", 2)[0] for k in store.tensors if ".switch_mlp." in k}):
        tensors = {k[len(prefix) + 1:]: t for k, t in store.tensors.items()
                   if k.startswith(prefix + ".")}
        experts = next(iter(tensors.values())).shape[0]
        layer = store.add_layer(prefix, {n: (t.shape[1:], t.nbytes // experts)
                                         for n, t in tensors.items()}, experts)
        dests[layer] = {n: np.zeros(t.nbytes, np.uint8) for n, t in tensors.items()}
    (run,) = store.plan_reads(dests)  # the dense tensors between them are read through
    offsets = [piece[0] for piece in run.pieces]
    assert offsets == sorted(offsets) and len(offsets) == sum(len(d) for d in dests.values())
    store.read_run(run)
    with open(store.files[0], "rb") as f:
        data = f.read()
    for layer, dest in dests.items():
        for t in store.layers[layer]:
            start = int(t.offsets[0])
            assert dest[t.name].tobytes() == data[start : start + dest[t.name].nbytes]


def test_a_stacked_expert_tensor_of_another_dtype_than_the_model_reads_is_refused(tiny_model):
    """The shape matches, the bytes per expert do not: every read would take the wrong bytes."""
    store = ExpertStore(tiny_model("qwen3_moe"))  # float32 experts
    as_float16 = {name: (shape, nbytes // 2) for name, (shape, nbytes) in _params().items()}
    with pytest.raises(StoreError, match=r"model\.safetensors: tensor 'model\.layers\.1\.mlp\."
                                         r"switch_mlp\.gate_proj\.weight' is F32 \(8192 bytes per "
                                         r"expert\) where the model reads 4096"):
        store.add_layer("model.layers.1.mlp.switch_mlp", as_float16, 8)


def test_per_expert_tensors_the_model_converts_at_load_are_refused_so(model_copy):
    """Same dtype, other bytes per expert: an FP8 checkpoint mlx-lm dequantizes at load. The
    message said to convert the experts to one dtype, which they were."""
    store = ExpertStore(model_copy("qwen3_moe", layout="per_expert"))
    as_bfloat16 = {name: (shape, nbytes // 2) for name, (shape, nbytes) in _params().items()}
    with pytest.raises(StoreError, match=re.escape(
            "tensor 'model.layers.0.mlp.experts.0.gate_proj.weight' is F32 (8192 bytes) where "
            "the model reads 4096 bytes per expert: the model converts the experts at load")):
        store.add_layer("model.layers.0.mlp.switch_mlp", as_bfloat16, 8)


def test_experts_in_no_known_form_are_refused_naming_what_the_checkpoint_holds(tmp_path):
    """A fused tensor stored transposed (Llama 4's `experts.gate_up_proj` [E, H, 2I]): the
    error named only the forms the store knows, not the tensor the file holds."""
    save_file({"model.layers.0.mlp.experts.gate_up_proj": np.zeros((8, 64, 64), np.float32),
               "model.layers.0.mlp.experts.down_proj": np.zeros((8, 32, 64), np.float32),
               "model.layers.0.mlp.gate.weight": np.zeros((8, 64), np.float32)},
              tmp_path / "model.safetensors")
    with pytest.raises(StoreError, match=re.escape(
            "for that layer's experts it holds 'model.layers.0.mlp.experts.down_proj' and 1 "
            "more: experts the model converts at load in another way")):
        ExpertStore(tmp_path).add_layer("model.layers.0.mlp.switch_mlp", _params(), 8)


def test_experts_stored_both_stacked_and_per_expert_are_refused(tiny_model, model_copy):
    """A shard left over from another conversion: mlx-lm stacks the per-expert tensors over the
    stacked ones, so reading the stacked ones would compute other experts than stock's."""
    path = model_copy("qwen3_moe", layout="per_expert")
    other = load_file(tiny_model("qwen3_moe", seed=1) / "model.safetensors")
    save_file({k: v for k, v in other.items() if ".switch_mlp." in k},
              path / "model-stale.safetensors")
    with pytest.raises(StoreError, match=re.escape(
            "expert tensor 'model.layers.0.mlp.switch_mlp.gate_proj.weight' is stored twice, as "
            "'model.layers.0.mlp.switch_mlp.gate_proj.weight' (model-stale.safetensors) and as "
            "'model.layers.0.mlp.experts.0.gate_proj.weight' (model.safetensors)")):
        mlx_moestream.load(path, budget="100%")


def test_a_shard_rewritten_while_the_store_indexes_it_fails_every_read(model_copy, monkeypatch):
    """Rewritten just after its header was read: the index holds the old offsets, so the file
    must not pass for the one indexed."""
    import mlx_moestream.checkpoint as store_module

    path = model_copy()
    tensors = load_file(path / "model.safetensors")
    index_file = store_module.index_file

    def rewritten_after_indexing(file, file_id):
        index = index_file(file, file_id)
        stat = file.stat()
        save_file(dict(reversed(tensors.items())), file)  # the same tensors, other offsets
        os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
        return index

    monkeypatch.setattr(store_module, "index_file", rewritten_after_indexing)
    store = ExpertStore(path)
    layer = store.add_layer("model.layers.1.mlp.switch_mlp", _params(), 8)
    with pytest.raises(StoreError, match=r"model\.safetensors: changed on disk since the model was "
                                         r"loaded"):
        _read(store, layer, 5)


def _open_files() -> int:
    return len(os.listdir("/dev/fd"))


def test_refused_loads_and_dropped_models_leave_no_file_open(tiny_model):
    """A load refused once the files are open (a per-layer split the budget cannot give), and a
    model dropped without `close()`: their descriptors close, not one per load for good."""
    import gc

    from mlx_moestream.errors import BudgetError

    path = tiny_model("qwen3_moe", bits=4)
    mlx_moestream.load(path, budget="25%")  # what a first load opens for good (libraries)
    gc.collect()
    before = _open_files()
    for _ in range(5):
        with pytest.raises(BudgetError, match="per-layer split"):
            mlx_moestream.load(path, budget=9216, per_layer=True)
        model, _ = mlx_moestream.load(path, budget="25%")
        del model
    gc.collect()
    assert _open_files() == before


def test_a_checkpoint_differing_in_one_small_tensor_has_another_fingerprint(tiny_model,
                                                                           model_copy):
    """Hosts join only with equal fingerprints; one whose checkpoint fixed a norm (or a router)
    differs in bytes that the sampled blocks missed, and its outputs differed silently."""
    path = model_copy("qwen3_moe")
    store = ExpertStore(path, drop_page_cache=False)
    norm = store.tensors["model.norm.weight"]
    with open(store.files[norm.file], "r+b") as f:
        f.seek(norm.offset)
        f.write(np.full(norm.nbytes // 4, 2.0, np.float32).tobytes())
    changed = ExpertStore(path, drop_page_cache=False).fingerprint()
    assert changed != ExpertStore(tiny_model("qwen3_moe"), drop_page_cache=False).fingerprint()


def test_a_shard_replaced_while_the_model_loads_fails_the_load(model_copy, monkeypatch):
    """A shard replaced (a download or a sync finishing) after the store indexed it and before
    the dense weights were read: the model got the new file's dense weights and the old
    experts' layout, with no error."""
    import shutil

    from mlx_moestream.mlx import loading

    path = model_copy("qwen3_moe", shards=2)
    attach = loading.attach

    def replacing(*args, **kwargs):
        attach(*args, **kwargs)
        for shard in sorted(path.glob("model*.safetensors")):
            shutil.copy(shard, path / "new")
            os.replace(path / "new", shard)

    monkeypatch.setattr(loading, "attach", replacing)
    with pytest.raises(StoreError, match="changed on disk while the model loaded"):
        mlx_moestream.load(path, budget="50%")
