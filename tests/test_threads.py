"""Two threads generating on one model each get stock mlx-lm's output, and so does later use."""

import os
import signal
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_moestream.mlx import load_lazy
from mlx_moestream.testing import PROMPT_IDS, greedy_logits

import mlx_moestream


@pytest.mark.parametrize("budget, prefetch", [("25%", False), ("25%", True), ("100%", False)])
def test_two_threads_generating_on_one_model_both_match_stock(tiny_model, reference, budget,
                                                               prefetch):
    path = tiny_model("qwen3_moe", bits=4)
    expected = reference(path)
    model, _ = mlx_moestream.load(path, budget=budget, prefetch=prefetch)
    results, errors = {}, []

    def generate(name):
        try:
            results[name] = [greedy_logits(model, decode_tokens=16) for _ in range(2)]
        except Exception as e:  # reported below, with the thread's name
            errors.append(f"{name}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=generate, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for runs in results.values():
        for logits in runs:
            assert all(mx.array_equal(a, b).item() for a, b in zip(logits, expected))
    assert all(mx.array_equal(a, b).item() for a, b in zip(greedy_logits(model), expected))
    # every token of every generation is counted: 2 threads x 2 runs x (64 + 16), then 64 + 32
    assert mlx_moestream.stats(model)["tokens"] == 4 * 80 + 96


def test_a_prewarm_waits_for_another_threads_layer_call(tiny_model):
    """A layer call holds the runtime's lock from its routing to its compute: a pre-warm from
    another thread in between would take slots and change the policy under it."""
    path = tiny_model("qwen3_moe", bits=4)
    model, _ = mlx_moestream.load(path, budget="25%")
    greedy_logits(model, decode_tokens=4)
    profile = mlx_moestream.profile(model, "chat")
    model, _ = mlx_moestream.load(path, budget="25%")
    runtime = model.moestream
    with runtime.lock:  # as a layer call of this thread does
        prewarm = threading.Thread(target=mlx_moestream.prewarm, args=(model, profile))
        prewarm.start()
        prewarm.join(timeout=0.5)
        assert prewarm.is_alive()
        assert runtime.stats.loads.sum() == 0
    prewarm.join()
    assert runtime.stats.loads.sum() > 0


def test_a_profile_is_copied_before_another_threads_layer_call_counts_more(tiny_model,
                                                                          monkeypatch):
    """Its token count and its experts' counts are of the same calls."""
    from mlx_moestream.profiles import Profile

    model, _ = mlx_moestream.load(tiny_model("qwen3_moe", bits=4), budget="25%")
    greedy_logits(model, decode_tokens=2)
    copy, steps = Profile.of.__func__, []

    def of(cls, *args):
        step = threading.Thread(target=greedy_logits, args=(model,), kwargs={"decode_tokens": 1})
        step.start()
        step.join(timeout=0.5)
        steps.append((step, step.is_alive()))
        return copy(cls, *args)

    monkeypatch.setattr(Profile, "of", classmethod(of))
    mlx_moestream.profile(model, "chat")
    (step, waited), = steps
    step.join()
    assert waited


def test_stats_from_another_thread_lag_a_generation_by_at_most_two_tokens(tiny_model):
    """Every expert resident: a thread's routing is counted by that thread, two forward calls
    late (the latest may not be computed yet), so another thread's `stats()` misses at most the
    generating thread's last two decode tokens."""
    model, _ = mlx_moestream.load(tiny_model("qwen3_moe", bits=4), budget="100%")
    lags = []
    _decode_in_a_thread(model, 8, lambda step: lags.append(step + 1 - mlx_moestream.stats(
        model)["tokens"]))
    assert max(lags) <= 2


def _decode_in_a_thread(model, steps: int, between) -> None:
    """Greedy decode `steps` tokens on another thread, calling `between(step)` here after
    each (the generating thread waits meanwhile)."""
    stepped, go = threading.Event(), threading.Event()

    def generate():
        cache, token = make_prompt_cache(model), mx.array([[5]])
        for _ in range(steps):
            out = model(token, cache=cache)
            mx.eval(out)
            token = mx.argmax(out[:, -1:], axis=-1)
            stepped.set()
            go.wait()
            go.clear()

    thread = threading.Thread(target=generate)
    thread.start()
    for step in range(steps):
        stepped.wait()
        stepped.clear()
        between(step)
        go.set()
    thread.join()


@pytest.mark.parametrize("budget", ["30%", "100%"])
def test_a_trace_started_from_another_thread_holds_only_the_calls_after_it(tiny_model,
                                                                           tmp_path, budget):
    """Every expert resident, the generating thread's latest calls are counted late: those
    made before the trace started were recorded in it."""
    model, _ = mlx_moestream.load(tiny_model("qwen3_moe", bits=4), budget=budget)
    _decode_in_a_thread(model, 12, lambda step: step == 5 and mlx_moestream.start_trace(model))
    assert mlx_moestream.save_trace(model, tmp_path / "t.npz").tokens == 6  # after the 6th


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="Linux's /proc")
def test_close_stops_a_prewarm_of_another_thread_and_its_files_stay_closed(model_copy):
    """The prewarm read on, reopening the closed model's files, and reported success."""
    path = model_copy("qwen3_moe")  # files no other test's model holds open
    model, _ = mlx_moestream.load(path, budget="50%")
    greedy_logits(model, decode_tokens=4)
    profile = mlx_moestream.profile(model, "chat")
    model.moestream.close()
    model, _ = mlx_moestream.load(path, budget="90%")
    runtime, read, outcome = model.moestream, model.moestream.store.read_expert, []

    def slow_read(*args):  # a slow disk
        time.sleep(0.05)
        return read(*args)

    def prewarm():
        try:
            outcome.append(mlx_moestream.prewarm(model, profile))
        except RuntimeError as e:
            outcome.append(str(e))

    runtime.store.read_expert = slow_read
    thread = threading.Thread(target=prewarm)
    thread.start()
    time.sleep(0.2)
    runtime.close()
    thread.join()
    assert outcome == ["this model was closed (moestream.close()): load it again to stream its "
                       "experts"]
    open_files = [os.path.realpath(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")]
    assert str(path / "model.safetensors") not in open_files


def test_generation_goes_on_from_a_prompt_cache_another_thread_filled(tiny_model):
    """Every expert resident: a thread that prefilled a prompt cache (evaluating only the cache,
    as generate_step does, so its last layer's routing is never computed) and ended leaves
    nothing that fails the next call or `stats()`."""
    path = tiny_model("qwen3_moe")
    tokens = {}
    for name, model in (("stock", mlx_lm.load(str(path))[0]),
                        ("streamed", mlx_moestream.load(path, budget="100%")[0])):
        cache = make_prompt_cache(model)

        def fill(model=model, cache=cache):
            model(mx.array(PROMPT_IDS[:, :40]), cache=cache)
            mx.eval([c.state for c in cache])

        prefill = threading.Thread(target=fill)
        prefill.start()
        prefill.join()
        steps = generate_step(mx.array(PROMPT_IDS[0, 40:45]), model, prompt_cache=cache,
                              max_tokens=8)
        tokens[name] = [int(token) for token, _ in steps]
    assert tokens["streamed"] == tokens["stock"]
    assert mlx_moestream.stats(model)["tokens"] >= 40 + 5


def test_a_child_forked_after_load_reads_experts_on_its_own_threads(tiny_model, reference):
    """A server's preloaded workers, multiprocessing's fork: the I/O threads do not come along
    into the child, where a call reading several experts waited for ever on them."""
    path = tiny_model("qwen3_moe")
    model, _ = mlx_moestream.load(path, budget=load_lazy(path)[-1].min_budget_bytes)
    runtime = model.moestream
    pool = runtime.residency.layer_pool[0]
    expected = []
    for expert in (0, 1):
        dest = {name: np.empty_like(view) for name, view in pool.slot(0).items()}
        runtime.store.read_expert(runtime.residency.store_layer[0], expert, dest)
        expected.append(dest)
    pid = os.fork()
    if pid == 0:  # the child: its exit status is the test's result
        code = 1
        try:
            slots = runtime.route(0, np.array([[0, 1]])).reshape(-1).tolist()  # two misses
            got = [pool.slot(slot) for slot in slots]
            code = 0 if all(np.array_equal(g[n], e[n]) for g, e in zip(got, expected)
                            for n in e) else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung reading its experts")
    assert os.waitstatus_to_exitcode(done[1]) == 0
    assert all(mx.array_equal(a, b).item()  # the parent goes on
               for a, b in zip(greedy_logits(model), reference(path)))


def test_a_read_left_by_a_call_cut_short_does_not_reopen_a_closed_model(model_copy,
                                                                        monkeypatch):
    """A call missing several experts reads the first itself, after starting the others: cut
    short before (here, an error finishing what an earlier call left), that read stays to make,
    and `stats()` after `close()` made it, opening the closed model's files again."""
    from mlx_moestream.reads import Reads

    path = model_copy("qwen3_moe")  # files no other test's model holds open
    model, _ = mlx_moestream.load(path, budget="25%")
    greedy_logits(model, decode_tokens=4)  # the cache full: calls miss
    runtime, finish = model.moestream, Reads.finish

    def cut_short(self, layer, until=None):
        jobs = [read for group in self.pending for _, read in group.reads]
        if any(isinstance(j, Future) for j in jobs) and any(not isinstance(j, Future) for j in jobs):
            raise OSError("cut short")
        return finish(self, layer, until)

    monkeypatch.setattr(Reads, "finish", cut_short)
    with pytest.raises(OSError, match="cut short"):
        for token in range(3, 500):
            mx.eval(model(mx.array([[token]])))
    monkeypatch.undo()
    runtime.close()
    mlx_moestream.stats(model)
    open_files = [os.path.realpath(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")]
    assert str(path / "model.safetensors") not in open_files
