"""Bad model files and budgets fail with an error that names the problem."""

import json
import os
import re
import struct
import subprocess
import sys

import pytest

import mlx_moestream
from mlx_moestream.errors import BudgetError, ModelError, StoreError
from mlx_moestream.store import ExpertStore


def fail_reads_at(monkeypatch, runtime, layer: int, experts) -> None:
    """An I/O error (EIO) on the disk at every read of these experts of `layer` (at their first
    tensor's offset)."""
    import errno
    import os

    failing = {int(runtime.store.layers[layer][0].offsets[e]) for e in experts}
    preadv = os.preadv

    def failing_preadv(fd, bufs, offset):
        if offset in failing:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return preadv(fd, bufs, offset)

    monkeypatch.setattr(os, "preadv", failing_preadv)


def test_truncated_shard_names_the_file_and_tensor(model_copy):
    path = model_copy()
    shard = path / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    with pytest.raises(StoreError, match=r"model\.safetensors: truncated: tensor '.*' ends at byte"):
        mlx_moestream.load(path)


def test_a_shard_linked_to_a_file_that_is_gone_is_named(model_copy):
    """A hub cache whose blob was deleted (an interrupted download, a cache cleaned up)."""
    path = model_copy()
    shard = path / "model.safetensors"
    shard.unlink()
    shard.symlink_to(path / "blobs-gone" / "0123abcd")
    with pytest.raises(StoreError, match=r"model\.safetensors: cannot open: No such file or "
                                         r"directory \(a link to a file that is gone"):
        ExpertStore(path)


def test_corrupt_header_json_names_the_file(model_copy):
    path = model_copy()
    shard = path / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[8:12] = b"!!!!"
    shard.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=r"model\.safetensors: corrupt safetensors header JSON"):
        mlx_moestream.load(path)


def test_a_tensor_in_two_shards_is_refused_naming_both(model_copy):
    """A leftover shard of an earlier conversion: mlx-lm would take the dense weights from one
    and the store the experts from the other."""
    path = model_copy()
    (path / "model-old.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    with pytest.raises(StoreError, match=r"model\.safetensors: tensor '.*' is also in "
                                         r"model-old\.safetensors"):
        mlx_moestream.load(path)


def test_header_longer_than_the_file_is_reported(model_copy):
    path = model_copy()
    shard = path / "model.safetensors"
    shard.write_bytes(struct.pack("<Q", 10**9) + b"{}")
    with pytest.raises(StoreError, match="header claims 1000000000 bytes"):
        mlx_moestream.load(path)


def _edit_header(shard, edit):
    """Rewrite a shard's header JSON through `edit(header)`, keeping its data section."""
    data = shard.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    shard.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n :])


def _first_tensor(header):
    return header[next(k for k in header if k != "__metadata__")]


@pytest.mark.parametrize("edit, problem", [
    (lambda h: _first_tensor(h).update(data_offsets=[-8, 0]), "need non-negative integers"),
    (lambda h: _first_tensor(h).update(shape="64"), "need non-negative integers"),
    (lambda h: _first_tensor(h).update(data_offsets="0,8"), "corrupt header entry"),
    (lambda h: h.update(__metadata__=5), "__metadata__ must map names to strings"),
])
def test_a_malformed_header_entry_is_a_clear_error_naming_the_file(model_copy, edit, problem):
    path = model_copy()
    _edit_header(path / "model.safetensors", edit)
    with pytest.raises(StoreError, match=r"model\.safetensors: .*" + re.escape(problem)):
        ExpertStore(path)


@pytest.mark.parametrize("index", [[1, 2], {"weight_map": [1]}, {"weight_map": {"a": 3}}])
def test_a_malformed_shard_index_is_a_clear_error(model_copy, index):
    path = model_copy()
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(StoreError, match=r"index\.json: corrupt shard index"):
        ExpertStore(path)


def test_a_shard_that_is_a_directory_is_a_clear_error(model_copy):
    path = model_copy()
    (path / "model-extra.safetensors").mkdir()
    with pytest.raises(StoreError, match=r"model-extra\.safetensors: cannot read"):
        ExpertStore(path)


@pytest.mark.parametrize("top_k", [0, -1])
def test_a_config_with_no_experts_per_token_is_refused(model_copy, top_k):
    path = model_copy()
    config = json.loads((path / "config.json").read_text())
    config["num_experts_per_tok"] = top_k
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match=f"num_experts_per_tok = {top_k}: a token must use"):
        mlx_moestream.load(path)


def _set_config(path, **fields) -> None:
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **fields}))


@pytest.mark.parametrize("top_k", [2.5, "2"])
def test_a_top_k_that_is_not_a_whole_number_is_one_line_naming_it(model_copy, top_k):
    path = model_copy()
    _set_config(path, num_experts_per_tok=top_k)
    out = run_cli("inspect", "-m", path)
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith(f"Error: {path}: mlx-lm cannot load this model: ")
    assert f"Field 'num_experts_per_tok' expected int, got {type(top_k).__name__}" in out.stderr


def test_a_top_k_above_the_experts_of_a_layer_is_refused_at_load_naming_both(model_copy):
    path = model_copy()
    _set_config(path, num_experts_per_tok=9)
    with pytest.raises(ModelError, match=r"copy: model_type 'qwen3_moe': config.json routes each "
                                         r"token to 9 experts \(top-k\) but a layer has only 8$"):
        mlx_moestream.load(path)


def test_more_layers_than_the_checkpoint_has_tensors_are_refused_before_building_them(
        model_copy):
    """mlx-lm would build a billion layers (gigabytes) first: a data limit makes a regression
    fail instead of filling the memory."""
    import resource

    path = model_copy()
    _set_config(path, num_hidden_layers=10**9)
    limit = (2**31, 2**31)
    out = subprocess.run([sys.executable, "-m", "mlx_moestream", "inspect", "-m", str(path)],
                         capture_output=True, text=True, timeout=60,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_DATA, limit))
    assert out.returncode == 1
    assert out.stderr == (f"Error: {path}: config.json has num_hidden_layers = 1000000000 but the "
                          f"checkpoint holds 27 tensors (a layer has at least one)\n")


@pytest.mark.parametrize("config, problem", [
    ({"model_type": "qwen3_moe"}, "required positional arguments: 'hidden_size'"),
    (["qwen3_moe"], "'list' object has no attribute 'get'"),
], ids=["fields missing", "not an object"])
def test_a_config_mlx_lm_cannot_build_from_is_a_clear_error(model_copy, config, problem):
    path = model_copy()
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match=f"{re.escape(str(path))}: mlx-lm cannot load this "
                                         f"model: .*{re.escape(problem)}"):
        mlx_moestream.load(path)


def test_a_budget_of_more_digits_than_python_converts_is_a_clear_error(tiny_model):
    with pytest.raises(BudgetError, match="has too many digits"):
        mlx_moestream.load(tiny_model(), budget="9" * 5000)


def _drop_tensor(path, name):
    from safetensors.numpy import load_file, save_file

    shard = path / "model.safetensors"
    tensors = load_file(shard)
    del tensors[name]
    save_file(tensors, shard, metadata={"format": "mlx"})


def test_missing_stacked_expert_tensor_is_named(model_copy):
    path = model_copy()
    _drop_tensor(path, "model.layers.1.mlp.switch_mlp.up_proj.weight")
    with pytest.raises(ModelError, match=r"model\.layers\.1\.mlp\.switch_mlp\.up_proj\.weight"):
        mlx_moestream.load(path)


def test_missing_per_expert_tensor_is_named(model_copy):
    path = model_copy("mixtral", layout="per_expert")
    _drop_tensor(path, "model.layers.0.block_sparse_moe.experts.5.w2.weight")
    with pytest.raises(ModelError, match=r"experts\.5\.w2\.weight"):
        mlx_moestream.load(path)


def test_an_expert_stored_in_another_dtype_is_refused_naming_it(model_copy):
    """float16 among float32 experts: reading it with the others' size would run into the next
    tensor."""
    from safetensors.numpy import load_file, save_file

    path = model_copy("mixtral", layout="per_expert")
    shard = path / "model.safetensors"
    tensors = load_file(shard)
    name = "model.layers.1.block_sparse_moe.experts.3.w1.weight"
    tensors[name] = tensors[name].astype("float16")
    save_file(tensors, shard, metadata={"format": "mlx"})
    with pytest.raises(StoreError, match=re.escape(f"tensor '{name}' is F16") + r".*F32"):
        mlx_moestream.load(path, budget="50%")


def test_a_float16_expert_among_bfloat16_ones_is_refused_naming_it_and_both_dtypes(model_copy):
    """The model stacks the experts in float32 (bfloat16 and float16 promote to it): the
    odd tensor is named, not the first one that differs from the model's size."""
    import mlx.core as mx

    path = model_copy("mixtral", layout="per_expert")
    shard = path / "model.safetensors"
    tensors = {k: v.astype(mx.bfloat16) for k, v in mx.load(str(shard)).items()}
    name = "model.layers.1.block_sparse_moe.experts.3.w1.weight"
    tensors[name] = tensors[name].astype(mx.float16)
    mx.save_safetensors(str(shard), tensors, metadata={"format": "mlx"})
    with pytest.raises(StoreError, match=re.escape(f"tensor '{name}' is F16 where the other "
                                                   "experts' are BF16")):
        mlx_moestream.load(path, budget="50%")


def test_unknown_architecture_is_named(model_copy):
    path = model_copy()
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "no_such_moe"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match="no_such_moe"):
        mlx_moestream.load(path)


TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]


def test_a_model_without_tokenizer_files_is_refused_naming_them(model_copy):
    """mlx-lm loads it with a tokenizer of one token, which encodes every text as nothing."""
    path = model_copy()
    for name in TOKENIZER_FILES:
        (path / name).unlink()
    with pytest.raises(ModelError, match=re.escape(f"{path}: no tokenizer files")):
        mlx_moestream.load(path)


def test_dense_model_is_rejected_as_not_moe(tmp_path):
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=1,
                           intermediate_size=64, num_attention_heads=2, rms_norm_eps=1e-5,
                           vocab_size=512, num_key_value_heads=2)
    model = llama.Model(args)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 64,
         "num_attention_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 512,
         "num_key_value_heads": 2}))
    from mlx_moestream.testing_tokenizer import make_tokenizer

    make_tokenizer(tmp_path)
    with pytest.raises(ModelError, match="not a Mixture-of-Experts model"):
        mlx_moestream.load(tmp_path)


def test_a_missing_local_directory_is_named_as_one(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match=f"no such directory: {re.escape(str(tmp_path))}/nope"):
        mlx_moestream.load(str(tmp_path / "nope"))


def test_a_repo_id_missing_offline_is_reported(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match="'someone/no-such-model' is not a local directory"):
        mlx_moestream.load("someone/no-such-model")


def test_budget_below_minimum_states_the_minimum(tiny_model):
    with pytest.raises(BudgetError, match=r"budget 48\.0 KiB \(49151 bytes\) is below the "
                                          r"minimum 48\.0 KiB \(49152 bytes\)"):
        mlx_moestream.load(tiny_model("qwen3_moe"), budget=49151)



@pytest.mark.parametrize("budget, profile", [(49151, None), ("50%", "no-such-profile")])
def test_every_refusal_is_caught_as_a_moestream_error(tiny_model, budget, profile):
    with pytest.raises(mlx_moestream.MoestreamError):
        mlx_moestream.load(tiny_model("qwen3_moe"), budget=budget, profile=profile)


def test_unknown_policy_is_rejected(tiny_model):
    with pytest.raises(ValueError, match="unknown policy 'mru'"):
        mlx_moestream.load(tiny_model("qwen3_moe"), policy="mru")


@pytest.mark.parametrize("option, problem", [
    (dict(pin_share=-1.0), r"shares must be in \[0, 1\]"),
    (dict(prewarm_share=2.0), r"shares must be in \[0, 1\]"),
    (dict(window_tokens=0), "window_tokens must be a whole number of tokens, at least 1, got 0"),
    (dict(window_tokens=float("nan")), "window_tokens must be a whole number .* got nan"),
    (dict(window_tokens=1.5), "window_tokens must be a whole number .* got 1.5"),
])
def test_options_out_of_range_are_refused_without_a_profile_too(tiny_model, option, problem):
    with pytest.raises(ValueError, match=problem):
        mlx_moestream.load(tiny_model("qwen3_moe"), budget="50%", **option)


@pytest.mark.parametrize("window", [0, -1])
def test_run_text_refuses_a_window_that_is_not_a_number_of_tokens(window):
    """-1 ran nothing and returned the text's token count; 0 was range()'s error."""
    from mlx_moestream.mlx import run_text

    model, tokenizer = mlx_moestream.load(budget="30%")
    with pytest.raises(ValueError, match=f"window_tokens must be a whole number .* got {window}"):
        run_text(model, tokenizer, "ciao, come stai?", window_tokens=window)


def test_a_file_cut_while_a_full_budget_reads_every_expert_fails_the_load_naming_it(
        model_copy, monkeypatch):
    path = model_copy()
    shard = path / "model.safetensors"
    read_run = ExpertStore.read_run
    cut = {}

    def cut_then_read(store, run):
        if not cut:  # the file is cut inside layer 1's last tensor
            cut.update(at=int(store.layers[1][-1].offsets[7]))
            with open(shard, "r+b") as f:
                f.truncate(cut["at"])
        return read_run(store, run)

    monkeypatch.setattr(ExpertStore, "read_run", cut_then_read)
    # reads run concurrently: the first to fail may be any whose bytes lie past the cut, or one
    # that ended after it (the file changed under it)
    with pytest.raises(StoreError, match=r"model\.safetensors: (cannot read '.*' of layer \d+ "
                                         r"at byte \d+: unexpected end of file"
                                         r"|changed on disk)"):
        mlx_moestream.load(path, budget="100%")
    assert cut


def test_read_error_names_file_and_expert_and_the_session_continues(model_copy, monkeypatch):
    import errno
    import os

    import mlx.core as mx

    path = model_copy()
    model, _ = mlx_moestream.load(path, budget="50%")
    experts = model.model.layers[1].mlp.switch_mlp
    preadv, failed = os.preadv, []

    def failing_once(fd, bufs, offset):  # an I/O error on the disk, once
        if not failed:
            failed.append(offset)
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return preadv(fd, bufs, offset)

    monkeypatch.setattr(os, "preadv", failing_once)
    x = mx.ones((1, 1, 64))
    with pytest.raises(StoreError, match=r"model\.safetensors: cannot read '.*' of layer 1 "
                                         r"expert 7 at byte \d+: Input/output error"):
        mx.eval(experts(x, mx.array([[[7, 7]]])))
    mx.eval(experts(x, mx.array([[[7, 1]]])))  # the session goes on, and reads expert 7 again
    stats = mlx_moestream.stats(model)
    assert 7 in model.moestream.state().resident[1]
    assert stats["read_errors"] == 1


def test_every_failed_read_of_a_call_counts_as_a_read_error(model_copy, monkeypatch):
    """As a prefetch's failed reads count: a call whose two reads failed counted one."""

    import mlx.core as mx

    path = model_copy()
    model, _ = mlx_moestream.load(path, budget="50%")
    fail_reads_at(monkeypatch, model.moestream, 1, (0, 1))
    experts = model.model.layers[1].mlp.switch_mlp
    with pytest.raises(StoreError, match="layer 1 expert 0"):
        mx.eval(experts(mx.ones((1, 1, 64)), mx.array([[[0, 1]]])))
    assert mlx_moestream.stats(model)["read_errors"] == 2


def test_a_read_failing_in_a_call_computed_in_rounds_counts_only_the_rounds_that_ran(
        model_copy, monkeypatch):
    """Routing counted the whole call while hits and misses counted the rounds that ran: a
    profile saved then held experts the session never served."""

    import mlx.core as mx

    from mlx_moestream.mlx import load_lazy
    from mlx_moestream.testing import PROMPT_IDS

    path = model_copy()
    model, _ = mlx_moestream.load(path, budget=load_lazy(path)[-1].min_budget_bytes)
    fail_reads_at(monkeypatch, model.moestream, 0, (4,))  # in the third round of two experts
    with pytest.raises(StoreError, match="layer 0 expert 4"):
        mx.eval(model(mx.array(PROMPT_IDS)))
    layer = mlx_moestream.stats(model)["layers"][0]
    assert layer["hits"] + layer["misses"] == layer["unique_experts"] == 6


def test_a_shard_rewritten_in_place_mid_session_fails_every_later_read(model_copy):
    """Same size, other bytes: the experts read before stay (they were right); no expert is
    read from the changed file, even after it is restored, until the model is loaded again."""
    import os

    import mlx.core as mx

    path = model_copy()
    model, _ = mlx_moestream.load(path, budget="50%")
    experts = model.model.layers[1].mlp.switch_mlp
    shard = path / "model.safetensors"
    original, stat = shard.read_bytes(), shard.stat()
    offset = int(model.moestream.store.layers[1][-1].offsets[7])
    with open(shard, "r+b") as f:
        f.seek(offset)
        f.write(bytes(64))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    x = mx.ones((1, 1, 64))
    with pytest.raises(StoreError, match=r"model\.safetensors: changed on disk since the model "
                                         r"was loaded .* layer 1 expert 7"):
        mx.eval(experts(x, mx.array([[[7, 7]]])))
    shard.write_bytes(original)  # restored: same bytes, a new modification time
    with pytest.raises(StoreError, match="changed on disk"):
        mx.eval(experts(x, mx.array([[[7, 7]]])))
    assert 7 not in model.moestream.state().resident[1]


def _rewrite_in_place(model, shard) -> None:
    """Zero the start of layer 1 expert 7's last tensor in place, the modification time set
    back (`cp -p`, `rsync -t --inplace`)."""
    stat = shard.stat()
    offset = int(model.moestream.store.layers[1][-1].offsets[7])
    with open(shard, "r+b") as f:
        f.seek(offset)
        f.write(bytes(64))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_a_shard_rewritten_in_place_with_its_modification_time_set_back_fails_reads(model_copy):
    """What `cp -p` or `rsync -t --inplace` of a same-size checkpoint does: same size, same
    modification time, other bytes. Its status change time tells."""
    import mlx.core as mx

    path = model_copy()
    model, _ = mlx_moestream.load(path, budget="50%")
    _rewrite_in_place(model, path / "model.safetensors")
    with pytest.raises(StoreError, match="changed on disk .* layer 1 expert 7"):
        mx.eval(model.model.layers[1].mlp.switch_mlp(mx.ones((1, 1, 64)), mx.array([[[7, 7]]])))


def _loads(model) -> int:
    return sum(layer["loads"] for layer in mlx_moestream.stats(model)["layers"])


def test_a_shard_replaced_by_a_rename_is_still_read_from_the_open_file(model_copy):
    """The open descriptor still reads the old bytes: a rename over the shard (identical
    bytes or not) changes nothing the session reads."""
    import mlx.core as mx

    from mlx_moestream.testing import PROMPT_IDS

    path = model_copy()
    model, _ = mlx_moestream.load(path, budget="50%")
    prompt = mx.array(PROMPT_IDS)
    expected = model(prompt)
    mx.eval(expected)
    shard = path / "model.safetensors"
    (path / "new.tmp").write_bytes(shard.read_bytes())
    os.replace(path / "new.tmp", shard)
    loads = _loads(model)
    assert mx.array_equal(model(prompt), expected).item()
    assert _loads(model) > loads


def test_a_new_hard_link_of_a_shard_is_harmless_and_a_later_write_still_fails_reads(
        model_copy):
    """A link moves the status change time as a write does, with the link count: once taken
    as the file's, a write after it with the modification time set back still shows."""
    import mlx.core as mx

    path = model_copy()
    model, _ = mlx_moestream.load(path, budget="50%")
    experts = model.model.layers[1].mlp.switch_mlp
    shard = path / "model.safetensors"
    os.link(shard, path / "linked.bin")
    x = mx.ones((1, 1, 64))
    assert 6 not in model.moestream.state().resident[1]  # read now
    mx.eval(experts(x, mx.array([[[6, 6]]])))
    _rewrite_in_place(model, shard)
    with pytest.raises(StoreError, match="changed on disk .* layer 1 expert 7"):
        mx.eval(experts(x, mx.array([[[7, 7]]])))


def test_a_read_failing_in_a_prompt_fails_it_once_every_read_has_ended_and_the_next_is_exact(
        model_copy, monkeypatch):

    import mlx.core as mx
    import mlx_lm

    from mlx_moestream.testing import PROMPT_IDS

    path = model_copy()
    model, _ = mlx_moestream.load(path, budget="50%")
    runtime = model.moestream
    fail_reads_at(monkeypatch, runtime, 1, (0,))  # the first of a prompt's many reads of layer 1
    prompt = mx.array(PROMPT_IDS)
    with pytest.raises(StoreError, match=r"cannot read '.*' of layer 1 expert 0 at byte \d+"):
        mx.eval(model(prompt))
    assert not runtime.state().reading  # every other read of the prompt ended, and counted, before it
    stats = mlx_moestream.stats(model)["layers"][1]
    assert stats["loads"] == stats["misses"] - 1 > 0
    assert 0 not in runtime.state().resident[1]  # the failed expert holds no slot
    monkeypatch.undo()
    stock, _ = mlx_lm.load(str(path))
    assert mx.array_equal(model(prompt), stock(prompt)).item()


def run_cli(*args, cwd=None) -> subprocess.CompletedProcess:
    """The CLI in a process of its own, killed (and the test failed) if it hangs."""
    return subprocess.run([sys.executable, "-m", "mlx_moestream", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes")
@pytest.mark.parametrize("fifo, command, message", [
    ("t.npz", ["replay", "t.npz"], r"t\.npz: not a readable trace \.npz \(not a regular file\)"),
    ("m/model.safetensors.index.json", ["inspect", "-m", "m"],
     r"index\.json: corrupt shard index \(not a regular file\)"),
    ("m/model.safetensors.index.json", ["chat", "-m", "m", "--prompt", "hi", "-n", "1"],
     r"index\.json: corrupt shard index \(not a regular file\)"),
    ("m/moestream-experts/manifest.json", ["repack", "-m", "m"],
     r"refusing to replace .*manifest\.json: it is not a repack manifest"),
    ("text.txt", ["profile", "record", "p.json", "--text", "text.txt", "-m", "m"],
     r"text\.txt: cannot read the text \(not a regular file\)"),
], ids=["replay trace", "inspect index", "chat index", "repack manifest", "profile text"])
def test_a_named_pipe_where_a_file_is_read_is_refused_at_once(model_copy, tmp_path, fifo,
                                                              command, message):
    """Reading a FIFO waits for a writer forever: refused by what it is, before any read."""
    model_copy()  # tmp_path/copy
    (tmp_path / "m").symlink_to(tmp_path / "copy")
    (tmp_path / fifo).parent.mkdir(exist_ok=True)
    os.mkfifo(tmp_path / fifo)
    out = run_cli(*command, cwd=tmp_path)
    assert out.returncode == 1
    assert re.search(r"^Error: .*" + message + "$", out.stderr, re.M), out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes")
def test_a_repack_manifest_that_is_a_named_pipe_is_ignored_with_a_warning(model_copy, tmp_path):
    path = model_copy()
    (path / "moestream-experts").mkdir()
    os.mkfifo(path / "moestream-experts" / "manifest.json")
    out = run_cli("chat", "-m", path, "--prompt", "hi", "-n", "1")
    assert out.returncode == 0, out.stderr
    assert re.search(r"^Warning: ignoring the repacked experts: .*manifest\.json: unreadable "
                     r"repack manifest \(not a regular file\)$", out.stderr, re.M), out.stderr


NESTED = b"[" * 100_000 + b"]" * 100_000  # past Python's recursion limit


def _nest(path, where: str) -> None:
    """Make `where` (the shard's header, the shard index, or a repack manifest) JSON nested
    100k levels deep."""
    if where == "model.safetensors":
        shard = path / where
        data = shard.read_bytes()
        (n,) = struct.unpack("<Q", data[:8])
        shard.write_bytes(struct.pack("<Q", len(NESTED)) + NESTED + data[8 + n:])
    else:
        (path / where).parent.mkdir(exist_ok=True)
        (path / where).write_bytes(NESTED)


@pytest.mark.parametrize("where, problem", [
    ("model.safetensors", "corrupt safetensors header JSON"),
    ("model.safetensors.index.json", "corrupt shard index"),
])
@pytest.mark.parametrize("command", [["inspect"], ["chat", "--prompt", "hi", "-n", "1"]])
def test_json_nested_too_deeply_is_one_line_naming_the_file(model_copy, where, problem,
                                                            command):
    path = model_copy()
    _nest(path, where)
    out = run_cli(*command, "-m", path)
    assert out.returncode == 1
    assert out.stderr == f"Error: {path / where}: {problem} (JSON nested too deeply)\n"


def test_a_repack_manifest_nested_too_deeply_is_ignored_with_a_warning(model_copy):
    """As any bad copy: the model loads from its own files."""
    path = model_copy()
    _nest(path, "moestream-experts/manifest.json")
    out = run_cli("chat", "-m", path, "--prompt", "hi", "-n", "1")
    assert out.returncode == 0, out.stderr
    assert (f"Warning: ignoring the repacked experts: {path}/moestream-experts/manifest.json: "
            "unreadable repack manifest (JSON nested too deeply)\n") in out.stderr


@pytest.mark.parametrize("verify, message", [
    ([], "refusing to replace {folder}/manifest.json: it is not a repack manifest"),
    (["--verify"], "{folder}/manifest.json: unreadable repack manifest (JSON nested too deeply)"),
])
def test_repack_over_a_manifest_nested_too_deeply_is_one_line(model_copy, verify, message):
    path = model_copy()
    _nest(path, "moestream-experts/manifest.json")
    out = run_cli("repack", "-m", path, *verify)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert message.format(folder=path / "moestream-experts") in out.stderr.splitlines()[0]
