"""Resident memory stays within dense weights + budget + KV cache (+10% slack)."""

import json
import subprocess
import sys

import pytest

PROBE = r"""
import json, sys
import mlx.core as mx, mlx_lm
from mlx_lm.models.cache import make_prompt_cache
import mlx_moestream
model, tok = mlx_moestream.load(sys.argv[1], budget="25%")
runtime = model.moestream
after_load = mx.get_active_memory()
mx.reset_peak_memory()
cache = make_prompt_cache(model)
prompt = mx.arange(3, 67)[None]
y = model(prompt, cache=cache)
for _ in range(32):
    y = model(mx.argmax(y[:, -1], -1)[:, None], cache=cache)
    mx.eval(y)
kv = sum(c.nbytes for c in cache)
print(json.dumps(dict(after_load=after_load, peak=mx.get_peak_memory(),
    dense=runtime.plan.dense_bytes, experts=runtime.plan.expert_bytes,
    budget=runtime.budget_bytes, kv=kv)))
"""


def test_active_memory_stays_within_dense_plus_budget_plus_kv(tiny_model):
    path = tiny_model("qwen3_moe", num_experts=64, num_layers=4, hidden_size=128,
                      moe_intermediate_size=128)
    out = subprocess.run([sys.executable, "-c", PROBE, str(path)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    m = json.loads(out.stdout)
    assert m["experts"] >= 10 * m["dense"]
    assert m["after_load"] <= 1.1 * (m["dense"] + m["budget"])
    assert m["peak"] <= 1.1 * (m["dense"] + m["budget"] + m["kv"])


def _cached_bytes(path, offset: int = 0, nbytes: int | None = None) -> int:
    """Bytes of a file (or of `nbytes` at `offset`) in the page cache now, in whole pages
    (mincore over a map of it)."""
    import ctypes
    import ctypes.util
    import mmap

    import numpy as np

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    data = np.frombuffer(mapped, np.uint8)
    pages = ctypes.create_string_buffer(-(-len(mapped) // mmap.PAGESIZE))
    assert libc.mincore(data.ctypes.data, len(mapped), pages) == 0, ctypes.get_errno()
    del data
    end = len(mapped) if nbytes is None else offset + nbytes
    mapped.close()
    first, last = offset // mmap.PAGESIZE, -(-end // mmap.PAGESIZE)
    return sum(b & 1 for b in pages.raw[first:last]) * mmap.PAGESIZE


def _dropped(path) -> None:
    """Drop a file from the page cache; skip where the file system keeps its pages."""
    import os

    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)  # the fixture just wrote it: the kernel drops no page not yet written back
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    if _cached_bytes(path):
        pytest.skip("this file system keeps the pages it is told to drop (tmpfs)")


@pytest.fixture(scope="module")
def page_cache_model(tiny_model):
    return tiny_model("qwen3_moe", num_experts=16, num_layers=4, hidden_size=256,
                      moe_intermediate_size=512)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="posix_fadvise, mincore")
def test_expert_reads_leave_the_page_cache(page_cache_model):
    """The kernel drops only whole folios in a dropped range, and readahead caches large ones
    across a read's edges: an exact range left half of the file cached after a session."""
    import mlx_moestream
    from mlx_moestream.testing import greedy_logits

    model, _ = mlx_moestream.load(page_cache_model, budget="25%")
    shard = page_cache_model / "model.safetensors"
    _dropped(shard)  # what loading the dense weights left cached
    greedy_logits(model, decode_tokens=16)
    assert mlx_moestream.stats(model)["bytes_read"] > shard.stat().st_size
    assert _cached_bytes(shard) <= shard.stat().st_size // 20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="posix_fadvise, mincore")
def test_expert_reads_drop_what_another_program_cached_of_the_model(page_cache_model):
    """Another program's reads of the model (a checksum, a copy, a second load), or a model
    still being written back at load, cache it in large folios, which a drop of an expert's
    own pages leaves whole: the whole file stayed cached through a session."""
    import mlx_moestream
    from mlx_moestream.testing import greedy_logits

    shard = page_cache_model / "model.safetensors"
    model, _ = mlx_moestream.load(page_cache_model, budget="25%")
    shard.read_bytes()  # another program, with readahead
    greedy_logits(model, decode_tokens=16)
    assert _cached_bytes(shard) <= shard.stat().st_size // 20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="posix_fadvise, mincore")
def test_a_load_that_reads_every_expert_leaves_the_page_cache(page_cache_model):
    """Read in large runs, every expert at once, the files' pages stayed cached around each
    run (its gaps kept for the dense weights, readahead past its edges)."""
    import mlx_moestream

    shard = page_cache_model / "model.safetensors"
    _dropped(shard)
    model, _ = mlx_moestream.load(page_cache_model, budget="100%")
    assert mlx_moestream.stats(model)["bytes_read"] > 0.9 * shard.stat().st_size
    assert _cached_bytes(shard) <= shard.stat().st_size // 20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="posix_fadvise, mincore")
def test_pages_readahead_brings_after_a_read_is_dropped_do_not_stay_cached(page_cache_model):
    """A read started readahead that could complete after the read's pages were dropped:
    what it brought stayed cached, after a streamed session or a full load (in about one
    round in four here, while the session's streamed model lived on)."""
    import mlx_moestream
    from mlx_moestream.testing import greedy_logits

    shard = page_cache_model / "model.safetensors"
    limit = shard.stat().st_size // 20
    for _ in range(6):
        streamed, _ = mlx_moestream.load(page_cache_model, budget="25%")
        _dropped(shard)
        greedy_logits(streamed, decode_tokens=16)
        assert _cached_bytes(shard) <= limit
        _dropped(shard)
        mlx_moestream.load(page_cache_model, budget="100%")
        assert _cached_bytes(shard) <= limit


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="posix_fadvise, mincore")
def test_pages_a_failed_read_requested_leave_the_page_cache(page_cache_model, monkeypatch):
    """An expert's pieces are all requested before the first is read: when that read fails,
    the others are still arriving, and the kernel does not drop pages in flight. They are
    dropped again once the next read ends."""
    import errno
    import os
    import time

    import numpy as np

    import mlx_moestream
    from mlx_moestream.errors import StoreError

    model, _ = mlx_moestream.load(page_cache_model, budget="25%")
    store = model.moestream.store
    slot = model.moestream.residency.layer_pool[0].slot(0)
    dest = {name: np.empty_like(view) for name, view in slot.items()}
    shard = page_cache_model / "model.safetensors"
    _dropped(shard)
    first = min(int(t.offsets[3]) for t in store.layers[0])
    preadv = os.preadv

    def failing_preadv(fd, bufs, offset, *flags):
        if offset == first:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return preadv(fd, bufs, offset, *flags)

    monkeypatch.setattr(os, "preadv", failing_preadv)
    with pytest.raises(StoreError, match="expert 3"):
        store.read_expert(0, 3, dest)
    time.sleep(0.5)  # what it requested has landed
    store.read_expert(0, 4, dest)
    assert _cached_bytes(shard) == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="posix_fadvise, mincore")
def test_a_read_is_dropped_while_another_read_is_in_flight(page_cache_model, monkeypatch):
    """Reads of every expert on four threads (a load whose budget holds them all, read expert
    by expert) were never all done at once, and each drop waited for that: the whole file
    stayed cached until the load ended. A read's pages now go once no read in progress
    reads near them."""
    import os
    import threading

    import numpy as np

    import mlx_moestream
    from mlx_moestream.rawio import DROP_ALIGN

    model, _ = mlx_moestream.load(page_cache_model, budget="25%")
    store = model.moestream.store
    shard = page_cache_model / "model.safetensors"

    def pieces(layer, expert):
        return [(int(t.offsets[expert]), t.nbytes) for t in store.layers[layer]]

    def windows(layer, expert):
        return {w for o, n in pieces(layer, expert)
                for w in range(o // DROP_ALIGN, -(-(o + n) // DROP_ALIGN))}

    held, other = (3, 0), (1, 0)  # their pieces lie in other 2 MiB windows of the file
    if windows(*held) & windows(*other):
        pytest.skip("the two experts' pieces share a window of the page cache's largest folio")
    first = min(o for o, _ in pieces(*held))
    reading, release = threading.Event(), threading.Event()
    preadv = os.preadv

    def held_preadv(fd, bufs, offset, *flags):
        if offset == first:
            reading.set()
            release.wait(30)
        return preadv(fd, bufs, offset, *flags)

    def buffers():
        slot = model.moestream.residency.layer_pool[0].slot(0)
        return {name: np.empty_like(view) for name, view in slot.items()}

    monkeypatch.setattr(os, "preadv", held_preadv)
    _dropped(shard)
    reader = threading.Thread(target=store.read_expert, args=(*held, buffers()))
    reader.start()
    try:
        assert reading.wait(30)
        store.read_expert(*other, buffers())
        cached = sum(_cached_bytes(shard, o, n) for o, n in pieces(*other))
    finally:
        release.set()
        reader.join()
    assert cached == 0
