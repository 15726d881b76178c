"""The expert-major copy: exact outputs, one read per expert, checked at open."""

import errno
import json
import mmap
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlx_moestream
from mlx_moestream.checkpoint import index_file
from mlx_moestream.errors import StoreError
from mlx_moestream.manifest import manifest_checksum, repack_dir
from mlx_moestream.repack import repack, verify
from mlx_moestream.store import ExpertStore

from mlx_moestream.testing import greedy_logits


def test_repacked_store_streams_exactly_and_reads_one_run_per_expert(model_copy, reference):
    path = model_copy("qwen3_moe", bits=4)
    expected = reference(path)
    repack(path)
    model, _ = mlx_moestream.load(path, budget="25%")
    store = model.moestream.store
    assert store.files[-1].name == "experts.bin"
    assert all(mx.array_equal(a, b).item() for a, b in zip(greedy_logits(model), expected))
    calls = []
    store._read_run = lambda *args, **kwargs: calls.append(args)
    store.read_expert(0, 3, model.moestream.residency.pools[0].slot(0))
    assert len(calls) == 1


@pytest.mark.parametrize("bits, buffers", [(None, 3), (4, 1)])
def test_repacked_experts_are_read_with_direct_io_and_match_the_model_files(model_copy, bits,
                                                                           buffers):
    """Float32 tensors of this model fill whole pages: the read lands in the three slot
    tensors. 4-bit ones do not: it lands in one page-aligned buffer, copied out."""
    path = model_copy("qwen3_moe", bits=bits)
    plain = mlx_moestream.load(path, budget="100%")[0].moestream
    folder = repack(path)
    if not _direct_io_works(folder / "experts.bin"):
        pytest.skip(f"the file system of {folder} has no direct I/O")
    packed = mlx_moestream.load(path, budget="100%")[0].moestream
    read_run, calls = packed.store._read_run, []
    packed.store._read_run = lambda *args, fd=None: calls.append((len(args[2]), fd)) or read_run(
        *args, fd=fd)
    for layer in range(len(packed.plan.layers)):
        for expert in (0, 7):
            want, got = plain.residency.pools[0].slot(0), packed.residency.pools[0].slot(1)
            plain.store.read_expert(layer, expert, want)
            packed.store.read_expert(layer, expert, got)
            assert all(np.array_equal(want[n], got[n]) for n in want)
    assert set(calls) == {(buffers, packed.store._direct)}


def _direct_io_works(path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except (AttributeError, OSError):
        return False
    try:
        os.preadv(fd, [mmap.mmap(-1, mmap.PAGESIZE)], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def test_repack_blocks_are_page_aligned(model_copy):
    folder = repack(model_copy("mixtral"))
    manifest = json.loads((folder / "manifest.json").read_text())
    assert all(l["offset"] % 4096 == 0 and l["stride"] % 4096 == 0 for l in manifest["layers"])
    assert verify(folder) == []


def test_verify_finds_a_corrupted_expert(model_copy):
    folder = repack(model_copy("qwen3_moe"))
    manifest = json.loads((folder / "manifest.json").read_text())
    layer = manifest["layers"][1]
    with open(folder / "experts.bin", "r+b") as f:
        f.seek(layer["offset"] + 5 * layer["stride"] + 10)
        f.write(b"\xff\xff\xff\xff")
    assert verify(folder) == [f"{layer['name']} expert 5: checksum mismatch"]


def test_stale_repack_is_ignored_with_a_warning(model_copy):
    path = model_copy("qwen3_moe")
    repack(path)
    from safetensors.numpy import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 2
    tensors["extra"] = np.zeros(3, np.float32)
    save_file(tensors, path / "model.safetensors", metadata={"format": "mlx"})
    with pytest.warns(UserWarning, match="made from other model files"):
        store = ExpertStore(path)
    assert all(f.suffix == ".safetensors" for f in store.files)


def test_corrupt_manifest_is_ignored_with_a_warning(model_copy):
    path = model_copy("qwen3_moe")
    folder = repack(path)
    text = (folder / "manifest.json").read_text().replace('"stride": 24576', '"stride": 4096')
    (folder / "manifest.json").write_text(text)
    with pytest.warns(UserWarning, match="checksum mismatch"):
        store = ExpertStore(path)
    assert len(store.files) == 1


def test_cli_repack_then_verify(model_copy):
    import subprocess
    import sys

    path = model_copy("qwen3_moe")
    cli = [sys.executable, "-m", "mlx_moestream.cli", "repack", "--model", str(path)]
    assert subprocess.run(cli, capture_output=True, timeout=120).returncode == 0
    out = subprocess.run([*cli, "--verify"], capture_output=True, text=True, timeout=120)
    assert "every expert block matches" in out.stdout


def test_a_copy_of_experts_since_rewritten_in_place_is_ignored_and_verify_says_so(model_copy):
    """Same size, same header, other expert bytes: only the shard's modification time tells."""
    path = model_copy("qwen3_moe")
    folder = repack(path)
    shard = path / "model.safetensors"
    stacked = index_file(shard, 0)["model.layers.0.mlp.switch_mlp.down_proj.weight"]
    offset = stacked.offset + 3 * stacked.nbytes // stacked.shape[0]
    stat = shard.stat()
    with open(shard, "r+b") as f:  # rewrite expert 3's bytes, as an in-place edit would
        f.seek(offset)
        f.write(bytes(64))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert verify(folder, path) == [f"{folder}: made from other model files (repack again)"]
    with pytest.warns(UserWarning, match="made from other model files"):
        store = ExpertStore(path)
    assert store.files[-1].name == "model.safetensors"


@pytest.mark.parametrize("shard, message", [
    (b"\0" * 4, "truncated safetensors file (4 bytes, no header)"),  # a download cut short
    (b"version https://git-lfs.github.com/spec/v1\n", "header claims"),  # a clone without LFS
])
def test_verify_against_a_shard_that_is_not_safetensors_is_an_error_naming_it(model_copy, shard,
                                                                             message):
    path = model_copy("qwen3_moe")
    folder = repack(path)
    (path / "model.safetensors").write_bytes(shard)
    with pytest.raises(StoreError, match=f"model.safetensors: {re.escape(message)}"):
        verify(folder, path)


def test_a_copy_of_experts_rewritten_in_place_with_the_old_modification_time_is_ignored(
        model_copy):
    """`cp -p`, `rsync -t` and `touch -d` set a modification time back; the status change
    time a write moves cannot be."""
    path = model_copy("qwen3_moe")
    folder = repack(path)
    shard = path / "model.safetensors"
    stacked = index_file(shard, 0)["model.layers.0.mlp.switch_mlp.down_proj.weight"]
    stat = shard.stat()
    time.sleep(0.01)  # a status change time the file system can tell from the repack's
    with open(shard, "r+b") as f:
        f.seek(stacked.offset + 3 * stacked.nbytes // stacked.shape[0])
        f.write(bytes(64))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.warns(UserWarning, match="made from other model files"):
        store = ExpertStore(path)
    assert store.files[-1].name == "model.safetensors"


def test_a_copy_made_before_status_change_times_were_recorded_is_ignored_saying_so(model_copy):
    path = model_copy("qwen3_moe")
    folder = repack(path)
    manifest = json.loads((folder / "manifest.json").read_text())
    for shard in manifest["source"]:
        del shard["ctime_ns"]
    manifest["checksum"] = manifest_checksum(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.warns(UserWarning, match="made by an earlier mlx-moestream.*repack again"):
        ExpertStore(path)


def test_a_shard_rewritten_after_its_experts_were_read_fails_the_repack(model_copy, monkeypatch):
    """The edit lands while the copy is synced, after every read: the copy holds the old bytes
    and must not be recorded as made from the new files."""
    import mlx_moestream.repack as repack_module

    path = model_copy("qwen3_moe")
    shard = path / "model.safetensors"
    fsync = os.fsync

    def fsync_while_the_shard_changes(fd):
        stat = shard.stat()
        with open(shard, "r+b") as f:
            f.seek(stat.st_size - 64)
            f.write(bytes(64))
        os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
        return fsync(fd)

    monkeypatch.setattr(repack_module.os, "fsync", fsync_while_the_shard_changes)
    with pytest.raises(StoreError, match="the model files changed while they were repacked"):
        repack(path)
    monkeypatch.undo()
    assert not repack_dir(path).exists()  # neither the copy nor its temporary file


def test_a_corrupt_block_in_the_copy_is_an_error_naming_the_expert_never_an_input(model_copy):
    path = model_copy("qwen3_moe")
    folder = repack(path)
    manifest = json.loads((folder / "manifest.json").read_text())
    layer = manifest["layers"][1]
    with open(folder / "experts.bin", "r+b") as f:  # flip bytes inside layer 1 expert 5
        f.seek(layer["offset"] + 5 * layer["stride"] + 100)
        f.write(b"\xff" * 8)
    assert verify(folder) == [f"{layer['name']} expert 5: checksum mismatch"]
    with pytest.raises(mlx_moestream.store.StoreError,
                       match=r"experts\.bin: layer 1 expert 5 does not match its checksum"):
        mlx_moestream.load(path, budget="100%")


def test_repacking_again_rebuilds_the_copy_from_the_model_files(model_copy, reference):
    path = model_copy("qwen3_moe")
    first = (repack(path) / "experts.bin").read_bytes()
    assert (repack(path) / "experts.bin").read_bytes() == first
    model, _ = mlx_moestream.load(path, budget="25%")
    assert model.moestream.store.files[-1].name == "experts.bin"
    assert all(mx.array_equal(a, b).item() for a, b in zip(greedy_logits(model), reference(path)))


def test_verify_before_any_repack_says_there_is_no_copy(model_copy):
    path = model_copy("qwen3_moe")
    out = subprocess.run([sys.executable, "-m", "mlx_moestream.cli", "repack", "--verify",
                          "--model", path], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert f"no repacked copy in {path / 'moestream-experts'}: run `mlx-moestream repack` first" \
        in out.stderr


def test_repacking_the_embedded_model_writes_to_the_user_cache_not_the_package(tmp_path,
                                                                              monkeypatch):
    from mlx_moestream.hub import resolve_model_path

    monkeypatch.setenv("HOME", str(tmp_path))
    embedded = resolve_model_path(None)
    before = sorted(p.name for p in embedded.iterdir())
    folder = repack(embedded)
    assert tmp_path / ".cache" / "mlx-moestream" / "repacked" in folder.parents
    assert sorted(p.name for p in embedded.iterdir()) == before
    model, _ = mlx_moestream.load(None, budget="30%")
    assert model.moestream.store.files[-1] == folder / "experts.bin"


def test_a_copy_written_elsewhere_has_its_manifest_and_serves_the_model(model_copy, tmp_path,
                                                                       reference):
    path = model_copy("qwen3_moe")
    out = repack(path, tmp_path / "elsewhere")
    assert sorted(p.name for p in out.iterdir()) == ["experts.bin", "manifest.json"]
    assert verify(out, path) == []
    store = ExpertStore(path, repacked=out)
    assert store.files[-1] == out / "experts.bin"


def test_repack_never_replaces_a_manifest_it_did_not_write(model_copy, tmp_path):
    out = tmp_path / "site"
    out.mkdir()
    (out / "manifest.json").write_text('{"name": "my web app"}')
    with pytest.raises(StoreError, match="refusing to replace .*manifest.json: it is not a "
                                         "repack manifest"):
        repack(model_copy("qwen3_moe"), out)
    assert (out / "manifest.json").read_text() == '{"name": "my web app"}'
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json"]


def at_third_read(monkeypatch, interrupt) -> None:
    """Call `interrupt` at the third expert read, mid-repack."""
    read_expert, reads = ExpertStore.read_expert, []

    def read(self, *args):
        reads.append(1)
        if len(reads) == 3:
            interrupt()
        return read_expert(self, *args)

    monkeypatch.setattr(ExpertStore, "read_expert", read)


def test_an_interrupted_repack_leaves_no_file_behind(model_copy, monkeypatch):
    path = model_copy("qwen3_moe")

    def interrupt():
        raise KeyboardInterrupt

    at_third_read(monkeypatch, interrupt)
    with pytest.raises(KeyboardInterrupt):
        repack(path)
    assert not repack_dir(path).exists()  # nor the folder it made


def test_a_repack_interrupted_before_its_manifest_is_written_leaves_no_file_behind(
        model_copy, monkeypatch):
    """An experts.bin without its manifest would make every later repack refuse to run."""
    path = model_copy("qwen3_moe")

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr("mlx_moestream.repack.atomic_write_text", interrupted)
    with pytest.raises(KeyboardInterrupt):
        repack(path)
    assert not repack_dir(path).exists()
    monkeypatch.undo()
    assert verify(repack(path), path) == []


def repack_interrupted_after(monkeypatch, path, name: str) -> None:
    """Repack `path`, interrupted right after its write of `name` has renamed the file into
    place."""
    writer = {"experts.bin": "atomic_write", "manifest.json": "atomic_write_text"}[name]
    real = getattr(mlx_moestream.repack, writer)

    def write(target, *args):
        real(target, *args)
        raise KeyboardInterrupt

    monkeypatch.setattr(mlx_moestream.repack, writer, write)
    with pytest.raises(KeyboardInterrupt):
        repack(path)


def test_a_repack_interrupted_right_after_experts_bin_is_renamed_leaves_no_file_behind(
        model_copy, monkeypatch):
    path = model_copy("qwen3_moe")
    repack_interrupted_after(monkeypatch, path, "experts.bin")
    assert not repack_dir(path).exists()


def test_a_repack_interrupted_right_after_its_manifest_is_renamed_keeps_the_complete_copy(
        model_copy, monkeypatch):
    path = model_copy("qwen3_moe")
    repack_interrupted_after(monkeypatch, path, "manifest.json")
    assert verify(repack_dir(path), path) == []


def test_sigterm_during_cli_repack_ends_it_in_one_line_leaving_no_file(model_copy, monkeypatch):
    from click.testing import CliRunner

    from mlx_moestream.cli import main

    path = model_copy("qwen3_moe")
    at_third_read(monkeypatch, lambda: os.kill(os.getpid(), signal.SIGTERM))
    out = CliRunner().invoke(main, ["repack", "--model", str(path)])
    assert out.exit_code == 128 + signal.SIGTERM
    assert out.output.splitlines()[-1] == "Error: terminated: nothing was written"
    assert not repack_dir(path).exists()


def test_a_copy_repacked_while_the_model_folder_was_read_only_is_used_once_it_is_writable(
        model_copy, monkeypatch, tmp_path):
    """The copy went to the user cache, and a load looked only beside the model from then on
    (os.access stands in for a read-only folder: the tests may run as root)."""
    from mlx_moestream import store as store_module

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    path = model_copy("qwen3_moe")
    access = os.access
    monkeypatch.setattr(store_module.os, "access",
                        lambda p, mode: Path(p).resolve() != path.resolve() and access(p, mode))
    folder = repack(path)
    assert tmp_path / "home" in folder.parents
    monkeypatch.setattr(store_module.os, "access", access)  # writable again
    assert ExpertStore(path).files[-1] == folder / "experts.bin"


def test_a_repack_into_an_empty_folder_it_cannot_write_is_refused_naming_it(model_copy,
                                                                            monkeypatch):
    """It failed at the write, naming its temporary file (os.access stands in for a folder
    this process may not write: the tests may run as root)."""
    from mlx_moestream import files

    path = model_copy("qwen3_moe")
    folder = repack_dir(path)
    folder.mkdir()
    access = os.access
    monkeypatch.setattr(files.os, "access", lambda p, mode: Path(p) != folder and access(p, mode))
    with pytest.raises(StoreError, match=re.escape(f"{folder} is not a writable folder")):
        repack(path)


def test_a_repack_the_disk_cannot_hold_names_the_file_it_could_not_write(model_copy):
    """A file size limit (`ulimit -f`) fails its writes as a full disk does."""
    import resource

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    path = model_copy("qwen3_moe")
    out = subprocess.run([sys.executable, "-m", "mlx_moestream.cli", "repack", "--model",
                          str(path)], capture_output=True, text=True, timeout=120,
                         preexec_fn=limit_file_size)
    assert out.returncode == 1
    assert out.stderr.endswith(f"Error: [Errno {errno.EFBIG}] File too large: "
                               f"'{repack_dir(path) / 'experts.bin'}'\n"), out.stderr
    assert not repack_dir(path).exists()


def test_a_manifest_that_is_not_utf8_is_ignored_with_a_warning(model_copy):
    path = model_copy("qwen3_moe")
    folder = repack(path)
    (folder / "manifest.json").write_bytes(b"\xff\xfe{}")
    with pytest.warns(UserWarning, match="unreadable repack manifest"):
        store = ExpertStore(path)
    assert len(store.files) == 1


def test_a_copy_beside_a_model_folder_made_read_only_since_is_still_used(model_copy,
                                                                         monkeypatch):
    path = model_copy("qwen3_moe")
    folder = repack(path)
    monkeypatch.setattr("mlx_moestream.store.os.access", lambda *args: False)  # as root cannot
    assert repack_dir(path) != folder  # a repack now would write to the user cache
    assert ExpertStore(path).files[-1] == folder / "experts.bin"


@pytest.mark.parametrize("manifest", ["{}", "[]", "checksum"])
def test_verify_reports_a_manifest_a_load_would_ignore(model_copy, manifest):
    folder = repack(model_copy("qwen3_moe"))
    if manifest == "checksum":  # valid JSON, one layer's checksums cut, its checksum stale
        data = json.loads((folder / "manifest.json").read_text())
        data["layers"][1]["crc32"] = data["layers"][1]["crc32"][:2]
        manifest = json.dumps(data)
    (folder / "manifest.json").write_text(manifest)
    assert verify(folder) == [f"{folder / 'manifest.json'}: corrupt repack manifest (checksum "
                              "mismatch or missing fields)"]


def test_chat_says_in_one_line_that_it_ignores_a_corrupt_copy(model_copy):
    path = model_copy("qwen3_moe")
    (repack(path) / "manifest.json").write_text("{}")
    out = subprocess.run([sys.executable, "-m", "mlx_moestream.cli", "chat", "--model", str(path),
                          "--prompt", "hi", "--max-tokens", "2"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    warned = [line for line in out.stderr.splitlines() if "repacked" in line]
    assert warned == [f"Warning: ignoring the repacked experts: {path / 'moestream-experts'}"
                      f"/manifest.json: corrupt repack manifest (checksum mismatch or missing "
                      f"fields)"], out.stderr
