"""Ctrl-C at any point of a generation leaves the model exact: later generations equal stock."""

import _thread
import contextlib
import itertools
import signal
import threading
import time
from concurrent.futures import Future
from contextlib import contextmanager

import mlx.core as mx
import numpy as np
import pytest
from mlx_moestream.cache import ExpertCache
from mlx_moestream.cli.app import Terminated, terminate_as_interrupt
from mlx_moestream.errors import StoreError
from mlx_moestream.testing import PROMPT_IDS, greedy_logits

import mlx_moestream


def _interrupted(model, delay: float) -> bool:
    """Run a generation with a SIGINT (what Ctrl-C sends) `delay` seconds in; whether it landed
    before the generation ended. Nothing escapes: an interrupt that fires late lands here."""
    timer = threading.Timer(delay, _thread.interrupt_main)
    completed = False
    try:
        try:
            timer.start()
            greedy_logits(model, decode_tokens=8)
            completed = True
        finally:
            timer.cancel()
            timer.join()  # it has fired or never will
        time.sleep(0.05)  # an interrupt raised just now is delivered here
    except KeyboardInterrupt:
        pass
    return not completed


@contextmanager
def _sigint_handler(handler):
    """`handler` set for SIGINT after load, as Jupyter sets its own before every cell."""
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _equals_stock(model, expected) -> bool:
    return all(mx.array_equal(a, b).item() for a, b in zip(greedy_logits(model), expected))


@pytest.mark.parametrize("prefetch", [False, True])
def test_generations_after_interrupts_at_random_points_equal_stock(tiny_model, reference,
                                                                   prefetch):
    path = tiny_model("qwen3_moe", bits=4)
    expected = reference(path)
    model, _ = mlx_moestream.load(path, budget="25%", prefetch=prefetch)
    greedy_logits(model, decode_tokens=8)  # cold: its reads make it longer than those timed
    start = time.perf_counter()
    greedy_logits(model, decode_tokens=8)
    span = time.perf_counter() - start
    rng = np.random.default_rng(0)
    hits = 0
    for _ in range(40):
        hits += _interrupted(model, rng.uniform(0, 0.8 * span))
        assert _equals_stock(model, expected)
    assert hits >= 8  # most land mid-generation, fewer on a busy machine


@pytest.mark.parametrize("handler", ["ours", "another set after load"])
@pytest.mark.parametrize("step", ["read", "policy update"])
def test_an_interrupt_inside_a_cache_step_lands_after_it(tiny_model, reference, monkeypatch, step,
                                                         handler):
    """SIGINT raised while an expert is read into its slot, or while the policy learns of the
    call's misses (their slots given, not yet read): it is delivered, and the next generation
    is still exact, also under a SIGINT handler set after load (Jupyter sets one per cell)."""
    path = tiny_model("qwen3_moe", bits=4)
    model, _ = mlx_moestream.load(path, budget="25%")
    runtime = model.moestream
    owner, name = ((runtime.store, "read_expert") if step == "read"
                   else (runtime.residency.caches[0].policies[0], "access"))
    original, calls = getattr(owner, name), itertools.count()

    def interrupting(*args):
        if next(calls) == 8:
            signal.raise_signal(signal.SIGINT)
        return original(*args)

    monkeypatch.setattr(owner, name, interrupting)
    set_after_load = signal.default_int_handler if handler != "ours" else signal.getsignal(
        signal.SIGINT)
    with _sigint_handler(set_after_load):
        with pytest.raises(KeyboardInterrupt):
            greedy_logits(model, decode_tokens=8)
        assert signal.getsignal(signal.SIGINT) is set_after_load  # swapped back after the step
    monkeypatch.undo()
    assert _equals_stock(model, reference(path))


class _Timeout(Exception):
    pass


@contextlib.contextmanager
def _raising_on(signum):
    """A handler of `signum` that raises _Timeout, as a harness's timeout does; yields it."""

    def timeout(*_):
        raise _Timeout

    previous = signal.signal(signum, timeout)
    try:
        yield timeout
    finally:
        signal.signal(signum, previous)


@pytest.mark.parametrize("signum", [signal.SIGALRM, signal.SIGTERM])
def test_a_raising_handler_of_another_signal_inside_a_cache_step_runs_after_it(
        tiny_model, reference, monkeypatch, signum):
    """A harness's SIGALRM timeout or a server's SIGTERM whose handler raises: raised once the
    policy chose its victims, before the cache took them, it left them resident to the cache
    and gone to the policy, and every later call failed ("every resident expert is in use").
    It must run once the step ends, and later generations be exact."""
    path = tiny_model("qwen3_moe", bits=4)
    model, _ = mlx_moestream.load(path, budget="25%")
    runtime = model.moestream
    policy = runtime.residency.caches[0].policies[0]
    original, calls = policy.victims, itertools.count()

    def signalling(*args):
        result = original(*args)
        if next(calls) == 4:
            signal.raise_signal(signum)
        return result

    monkeypatch.setattr(policy, "victims", signalling)
    with _raising_on(signum) as timeout:
        with pytest.raises(_Timeout):
            greedy_logits(model, decode_tokens=8)
        assert signal.getsignal(signum) is timeout  # swapped back after the step
    monkeypatch.undo()
    assert _equals_stock(model, reference(path))


def test_a_raising_handler_inside_a_prewarm_s_pins_runs_after_them(tiny_model, reference,
                                                                   monkeypatch):
    """Raised once a pinned expert left its policy, before the cache marked it pinned: it was
    resident to the cache, gone to the policy and not pinned, and every later call that
    evicted raised KeyError (lru)."""
    path = tiny_model("qwen3_moe", bits=4)
    model, _ = mlx_moestream.load(path, budget="50%", policy="lru")
    greedy_logits(model, decode_tokens=4)
    profile = mlx_moestream.profile(model, "chat")
    policy = model.moestream.residency.caches[0].policies[0]
    original, calls = policy.remove, itertools.count()

    def signalling(key):
        original(key)
        if next(calls) == 0:
            signal.raise_signal(signal.SIGALRM)

    monkeypatch.setattr(policy, "remove", signalling)
    with _raising_on(signal.SIGALRM), pytest.raises(_Timeout):
        mlx_moestream.prewarm(model, profile, share=1.0, pin_share=0.3)
    monkeypatch.undo()
    assert any(model.moestream.state().pinned)
    assert _equals_stock(model, reference(path))


def test_a_prewarm_cut_short_by_a_raising_handler_counts_every_expert_it_read_as_warm(
        tiny_model, monkeypatch):
    """Raised at the end of a read's step, the read counted as a load, not as warm."""
    path = tiny_model("qwen3_moe", bits=4)
    model, _ = mlx_moestream.load(path, budget="50%")
    greedy_logits(model, decode_tokens=4)
    profile = mlx_moestream.profile(model, "chat")
    model, _ = mlx_moestream.load(path, budget="50%")  # nothing read: every load is the prewarm's
    runtime = model.moestream
    original, calls = runtime.reads.read, itertools.count()

    def signalling(*args):
        result = original(*args)
        if next(calls) == 2:
            signal.raise_signal(signal.SIGALRM)
        return result

    monkeypatch.setattr(runtime.reads, "read", signalling)
    with _raising_on(signal.SIGALRM), pytest.raises(_Timeout):
        mlx_moestream.prewarm(model, profile)
    stats = mlx_moestream.stats(model)
    assert stats["loads"] == 3 == sum(layer["warm"] for layer in stats["layers"])


@pytest.mark.parametrize("fault", ["Ctrl-C under another SIGINT handler", "OSError"])
def test_a_read_cut_short_by_any_exception_leaves_no_stale_slot(tiny_model, reference, monkeypatch,
                                                                 fault):
    """A SIGINT handler set after load (Jupyter sets its own before every cell) or an error
    that is not a StoreError cuts a decode step's read short: the expert must not stay
    marked resident over bytes that never landed."""
    path = tiny_model("qwen3_moe", bits=4)
    model, _ = mlx_moestream.load(path, budget="25%")
    greedy_logits(model)  # the cache full: the expert cut short takes a slot another held
    runtime = model.moestream
    original, main_reads = runtime.store.read_expert, itertools.count()

    def failing(*args):
        if threading.current_thread() is threading.main_thread() and next(main_reads) == 2:
            if fault == "OSError":
                raise OSError(12, "Cannot allocate memory")
            signal.raise_signal(signal.SIGINT)
        return original(*args)

    monkeypatch.setattr(runtime.store, "read_expert", failing)
    with _sigint_handler(signal.default_int_handler), pytest.raises((KeyboardInterrupt, OSError)):
        greedy_logits(model, decode_tokens=8)
    monkeypatch.undo()
    assert _equals_stock(model, reference(path))


def test_a_call_s_own_read_failing_while_its_others_run_leaves_no_stale_slot(tiny_model,
                                                                             reference,
                                                                             monkeypatch):
    """A call missing several experts reads the first itself while the I/O threads read the
    others: an error in its own read (not a StoreError) ends the call with the others still
    running, which the next call must finish, the failed expert forgotten."""
    path = tiny_model("qwen3_moe", bits=4)
    model, _ = mlx_moestream.load(path, budget="25%")
    greedy_logits(model)  # the cache full: the expert cut short takes a slot another held
    runtime = model.moestream
    original, failed = runtime.store.read_expert, []

    def failing(*args):
        if threading.current_thread() is threading.main_thread() and _on_io_threads(runtime):
            failed.append(args[:2])  # the others of its call are on the I/O threads
            raise OSError(5, "Input/output error")
        return original(*args)

    monkeypatch.setattr(runtime.store, "read_expert", failing)
    with pytest.raises(OSError):
        greedy_logits(model, decode_tokens=16)
    monkeypatch.undo()
    assert len(failed) == 1 and _on_io_threads(runtime)
    assert _equals_stock(model, reference(path))
    assert _stale_experts(runtime) == []


def test_a_read_that_ends_as_ctrl_c_cuts_its_wait_short_is_counted(tiny_model, monkeypatch):
    """Ctrl-C lands in the wait for a prompt's background read just as the read ends: the read
    was forgotten as failed, its bytes left out of `loads` and `bytes_read` (2.6% of them over
    40 interrupted prompts) and its expert read again."""
    model, _ = mlx_moestream.load(tiny_model("qwen3_moe", bits=4), budget="25%")
    runtime = model.moestream
    read, submit, submits = runtime.reads.read, runtime.reads.pool.submit, itertools.count()
    landed = []

    def counted(*args):
        landed.append(read(*args)[0])
        return landed[-1], 0.0

    def submitted(fn, *args):
        future = submit(fn, *args)
        if next(submits) == 2:
            wait = future.result

            def interrupted(timeout=None):
                wait(timeout)  # the read ends...
                future.result = wait
                raise KeyboardInterrupt  # ...as Ctrl-C cuts the wait short

            future.result = interrupted
        return future

    monkeypatch.setattr(runtime.reads, "read", counted)
    monkeypatch.setattr(runtime.reads.pool, "submit", submitted)
    with pytest.raises(KeyboardInterrupt):
        model(mx.array(PROMPT_IDS))
    monkeypatch.setattr(runtime.reads.pool, "submit", submit)
    model(mx.array(PROMPT_IDS[:, :4]))  # finishes what the interrupted call left
    stats = mlx_moestream.stats(model)
    assert (stats["loads"], stats["bytes_read"]) == (len(landed), sum(landed))


@pytest.mark.parametrize("reader", ["prompt", "prefetch"])
def test_a_read_in_the_background_failing_with_any_error_fails_one_call_and_the_next_are_exact(
        tiny_model, reference, monkeypatch, reader):
    """A background read (a prompt's pipelined reads, a prefetch) that raises what is not a
    StoreError (MemoryError, a backend's copy error): its expert is forgotten and the error
    raised once; it must not stay in flight, raised again by every later call."""
    path = tiny_model("qwen3_moe", bits=4)
    model, _ = mlx_moestream.load(path, budget="25%", prefetch=reader == "prefetch")
    greedy_logits(model)  # the cache full: the failed expert takes a slot another held
    runtime = model.moestream
    original, armed, failed = runtime.reads.read, threading.Event(), threading.Event()
    if reader == "prefetch":  # armed once a decode step predicts: the next reads are prefetches
        read_ahead = runtime.read_ahead
        monkeypatch.setattr(runtime, "read_ahead", lambda *a: (armed.set(), read_ahead(*a))[1])
    else:
        armed.set()

    def failing(*args):
        if (armed.is_set() and threading.current_thread() is not threading.main_thread()
                and not failed.is_set()):
            failed.set()
            raise MemoryError("out of memory in a copy")
        return original(*args)

    monkeypatch.setattr(runtime.reads, "read", failing)
    with pytest.raises(MemoryError):
        greedy_logits(model, decode_tokens=8)
    monkeypatch.undo()
    assert _equals_stock(model, reference(path))


def _on_io_threads(runtime) -> bool:
    """Whether reads started on the I/O threads are pending."""
    return any(isinstance(read, Future) for group in runtime.reads.pending
               for _, read in group.reads)


def _stale_experts(runtime) -> list[tuple[int, int]]:
    """The (layer, expert) pairs marked resident whose slot does not hold their bytes."""
    stale = []
    for layer in range(runtime.plan.num_layers):
        views = runtime.residency.layer_pool[layer].views
        for expert, slot in enumerate(runtime.residency.slot_map(layer).tolist()):
            if slot >= 0:
                fresh = {name: np.empty_like(view[slot]) for name, view in views.items()}
                runtime.store.read_expert(runtime.residency.store_layer[layer], expert, fresh)
                if not all(np.array_equal(fresh[n], views[n][slot]) for n in fresh):
                    stale.append((layer, expert))
    return stale


@pytest.mark.parametrize("reader", ["prompt", "prefetch", "decode"])
def test_a_read_that_cannot_start_leaves_no_stale_slot(tiny_model, reference, monkeypatch, reader):
    """A background read that cannot start (no thread could start; the pool shut down): the
    experts placed for it and for those after it must leave their slots, and a read started
    before it must be finished by the next call, not left to land in a slot given away. A
    one-token call missing several experts reads the first itself once the others started:
    it must leave its slot too."""
    path = tiny_model("qwen3_moe", bits=4)
    model, _ = mlx_moestream.load(path, budget="25%", prefetch=reader == "prefetch")
    if reader != "prefetch":
        greedy_logits(model)  # the cache full: the experts placed take slots others held
    runtime = model.moestream
    original, submits, predicting = runtime.reads.pool.submit, itertools.count(), threading.Event()
    if reader == "prefetch":  # the first prediction's first read fails: none of its reads start
        read_ahead, fail_at = runtime.read_ahead, 0
        monkeypatch.setattr(runtime, "read_ahead",
                            lambda *a: (predicting.set(), read_ahead(*a), predicting.clear()))
    elif reader == "prompt":  # the prompt's second read fails: the first one is left running
        fail_at = 1
    else:  # the first call missing two experts: the one it would read itself never starts
        fail_at = 0

    def failing(*args):
        if (reader != "prefetch" or predicting.is_set()) and next(submits) == fail_at:
            raise RuntimeError("can't start new thread")
        return original(*args)

    monkeypatch.setattr(runtime.reads.pool, "submit", failing)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        if reader == "prompt":  # a short prompt: its experts fit, read while it computes
            for prompt in ([[5, 9, 13]], [[21, 30, 44]], [[2, 50, 61]]):
                model(mx.array(prompt))
        elif reader == "decode":
            for token in range(3, 500):
                mx.eval(model(mx.array([[token]])))
        else:
            greedy_logits(model, decode_tokens=8)
    monkeypatch.undo()
    runtime.backend.settle()
    resident = runtime.state().resident
    layer = next(layer for layer in range(runtime.plan.num_layers) if resident[layer])
    hits = np.array(sorted(resident[layer]))[None, None]
    runtime.route(layer, hits)  # a call of hits (it evicts nothing) finishes the reads left running
    assert _stale_experts(runtime) == []
    assert _equals_stock(model, reference(path))


def test_reads_need_no_new_thread_after_load(tiny_model, reference, monkeypatch):
    """A pool starts its threads in `submit`, after queueing the work: a thread that could not
    start there raised, and the read already queued landed later in a slot given away."""
    path = tiny_model("qwen3_moe", bits=4)
    model, _ = mlx_moestream.load(path, budget="25%")

    def no_thread(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    assert _equals_stock(model, reference(path))


def test_read_threads_that_cannot_start_fail_the_load_clearly(tiny_model, monkeypatch):
    start, started = threading.Thread.start, itertools.count()

    def second_fails(self):  # one thread runs, and must not wait for the others for good
        if next(started) == 1:
            raise RuntimeError("can't start new thread")
        start(self)

    monkeypatch.setattr(threading.Thread, "start", second_fails)
    with pytest.raises(RuntimeError, match="cannot start the 4 threads that read experts"):
        mlx_moestream.load(tiny_model("qwen3_moe", bits=4), budget="25%")


def test_a_closed_model_refuses_to_stream(tiny_model):
    model, _ = mlx_moestream.load(tiny_model("qwen3_moe", bits=4), budget="25%")
    model.moestream.close()
    with pytest.raises(RuntimeError, match="closed"):
        greedy_logits(model)


def test_an_expert_forgotten_twice_frees_its_slot_once(tiny_model):
    """A read group finished again after an interrupt forgets a failed expert a second time:
    its slot must not go back to the free list twice (nor slot -1, the pool's last)."""
    model, _ = mlx_moestream.load(tiny_model("qwen3_moe", bits=4), budget="60%")
    runtime = model.moestream
    runtime.route(0, np.array([[[0, 1]]]))
    runtime.residency.forget(0, 1)
    runtime.residency.forget(0, 1)
    free, = runtime.state().free_slots
    assert len(set(free)) == len(free) and min(free) >= 0


def test_statistics_right_after_an_interrupt_count_the_reads_it_left_running(tiny_model,
                                                                            monkeypatch):
    """Ctrl-C while a prompt waits for its reads leaves them running; `stats()` counts them
    before it reports, so every resident expert has its load."""
    model, _ = mlx_moestream.load(tiny_model("qwen3_moe", bits=4), budget="50%")
    runtime, fired = model.moestream, []
    original = runtime.reads.read

    def read(layer, expert, slot):
        if threading.current_thread() is not threading.main_thread() and not fired:
            fired.append(True)
            _thread.interrupt_main()
            time.sleep(0.3)  # the main thread, waiting for this read, takes the interrupt
        return original(layer, expert, slot)

    monkeypatch.setattr(runtime.reads, "read", read)
    with pytest.raises(KeyboardInterrupt):
        mx.eval(model(mx.array([list(range(3, 40))])))
    assert _on_io_threads(runtime)  # the reads the interrupt left running
    for group in runtime.reads.pending:
        for _, read in group.reads:
            read.exception()  # wait for it to land
    stats = mlx_moestream.stats(model)
    resident = sum(map(len, runtime.state().resident))
    assert fired and stats["loads"] - stats["evictions"] == resident > 0


def test_a_call_failing_after_its_experts_are_resident_is_counted_and_the_next_are_exact(
        tiny_model, reference, monkeypatch):
    """A call's statistics and policy updates are made once its compute is issued (`tally`):
    a call failing in between (an interrupt, a backend error) must still count its routing,
    and the policy learn of the experts it made resident."""
    path = tiny_model("qwen3_moe", bits=4)
    model, _ = mlx_moestream.load(path, budget="25%")
    runtime = model.moestream
    backend, calls = runtime.backend, itertools.count()
    original = backend.issue

    def failing_at_layer_1(y):
        if next(calls) == 1:
            raise RuntimeError("the device failed")
        original(y)

    monkeypatch.setattr(backend, "issue", failing_at_layer_1)
    with pytest.raises(RuntimeError, match="the device failed"):
        mx.eval(model(mx.array(PROMPT_IDS)[:, :1]))
    monkeypatch.undo()
    layer_1 = mlx_moestream.stats(model)["layers"][1]
    assert layer_1["misses"] == layer_1["loads"] > 0
    assert _equals_stock(model, reference(path))


def test_an_interrupt_inside_the_policy_updates_a_failed_read_makes_lands_after_them(
        tiny_model, reference):
    """Forgetting an expert whose read failed first makes the policy updates held since the
    latest call (its uses): SIGINT there lands once the expert has left its slot."""
    path = tiny_model("qwen3_moe", bits=4)
    model, _ = mlx_moestream.load(path, budget="25%")
    runtime = model.moestream
    policy = runtime.residency.caches[0].policies[0]
    original, armed = policy.access, []

    def interrupting(*args):
        if armed:
            signal.raise_signal(signal.SIGINT)
        return original(*args)

    policy.access = interrupting
    runtime.route(0, np.array([[[0, 1]]]))  # its uses held
    armed.append(True)
    with _sigint_handler(signal.default_int_handler), pytest.raises(KeyboardInterrupt):
        runtime.residency.forget(0, 1)
    del policy.access
    state = runtime.state()
    assert 1 not in state.resident[0] and state.held_policy_updates == 0
    assert _equals_stock(model, reference(path))


class _InterruptedAfterPop(list):
    """A list of reads in flight whose every `pop` is followed by Ctrl-C."""

    def pop(self, index=-1):
        item = super().pop(index)
        signal.raise_signal(signal.SIGINT)
        return item


def test_an_interrupt_while_statistics_finish_a_failed_prefetch_read_leaves_no_stale_slot(
        tiny_model, reference, monkeypatch):
    """`stats()` finishes the prefetch reads in flight: Ctrl-C as it takes a failed one off
    its list lands once the expert has left its slot."""
    path = tiny_model("qwen3_moe", bits=4)
    model, _ = mlx_moestream.load(path, budget="75%", prefetch=True)
    runtime, expert = model.moestream, 1
    greedy_logits(model, decode_tokens=1)
    runtime.residency.forget(1, expert)
    original = runtime.store.read_expert

    def failing(layer, e, dest):
        original(layer, e, dest)
        for buffer in dest.values():  # part of the slot written, then the error
            buffer.reshape(-1).view(np.uint8)[:64] ^= 0xFF
        raise StoreError("injected read error")

    monkeypatch.setattr(runtime.store, "read_expert", failing)
    runtime.prefetch.reading = set()
    runtime.read_ahead(0, np.array([expert]))  # layer 1's read, as layer 0's call starts it
    group, = runtime.reads.pending
    for _, read in group.reads:
        read.exception()  # it has failed
    monkeypatch.undo()
    group.reads = _InterruptedAfterPop(group.reads)
    with _sigint_handler(signal.default_int_handler), pytest.raises(KeyboardInterrupt):
        mlx_moestream.stats(model)
    assert expert not in runtime.state().resident[1]
    assert _equals_stock(model, reference(path))


def test_an_interrupt_while_deferred_routing_is_counted_loses_none_of_it(tiny_model,
                                                                         monkeypatch):
    """With every expert resident, routing is counted later, several calls at once (here by
    `stats()`): Ctrl-C while one is counted lands once all those taken are."""
    model, _ = mlx_moestream.load(tiny_model("qwen3_moe", bits=4), budget="100%")
    runtime = model.moestream
    deferred, routed, armed = runtime.backend.deferred, [0], []
    add, admit = deferred.add, runtime._admit

    def adding(layer, indices):
        routed[0] += indices.size
        add(layer, indices)

    def interrupting(*args):
        if armed and armed.pop():
            signal.raise_signal(signal.SIGINT)
        return admit(*args)

    monkeypatch.setattr(deferred, "add", adding)
    monkeypatch.setattr(runtime, "_admit", interrupting)
    greedy_logits(model, decode_tokens=4)
    armed += [True, False]  # at the second call counted
    with _sigint_handler(signal.default_int_handler), pytest.raises(KeyboardInterrupt):
        mlx_moestream.stats(model)
    monkeypatch.undo()
    assert mlx_moestream.profile(model, "counted").counts.sum() == routed[0]


def test_routing_counted_later_stays_whole_after_a_forward_call_cut_short(tiny_model,
                                                                         monkeypatch):
    """With every expert resident, routing is counted later, a forward call at a time: one cut
    short midway (Ctrl-C in its second MoE layer) counts as far as it ran, and every call
    after it counts in full."""
    model, _ = mlx_moestream.load(tiny_model("qwen3_moe", bits=4), budget="100%")
    deferred = model.moestream.backend.deferred
    add, routed, armed = deferred.add, [0] * model.moestream.plan.num_layers, []

    def adding(layer, indices):
        if armed and layer == 1:
            armed.pop()
            raise KeyboardInterrupt
        routed[layer] += len(np.unique(np.array(indices)))  # the call's distinct experts
        add(layer, indices)

    monkeypatch.setattr(deferred, "add", adding)
    greedy_logits(model, decode_tokens=2)
    armed.append(True)
    with pytest.raises(KeyboardInterrupt):
        greedy_logits(model, decode_tokens=2)
    greedy_logits(model, decode_tokens=3)
    layers = mlx_moestream.stats(model)["layers"]
    assert [layer["hits"] + layer["misses"] for layer in layers] == routed


def test_sigterm_while_a_chat_counts_its_calls_lands_after_them(tiny_model, monkeypatch):
    """`chat` ends on SIGTERM and saves what it counted: a SIGTERM while a call's counts are
    made lands once they all are, so none is counted again when the outputs are saved."""
    model, _ = mlx_moestream.load(tiny_model("qwen3_moe", bits=4), budget="25%")
    runtime = model.moestream
    request, count_request = ExpertCache.request, runtime.stats.count_request
    accessed, armed = [0], []

    def requesting(cache, layer, experts):
        loads, hits, evicted = request(cache, layer, experts)
        accessed[0] += hits + len(loads)
        return loads, hits, evicted

    def terminating(*args):
        count_request(*args)
        if armed and armed.pop():
            signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(ExpertCache, "request", requesting)
    monkeypatch.setattr(runtime.stats, "count_request", terminating)
    armed += [True] + [False] * 5  # at the sixth call counted
    with pytest.raises(Terminated), terminate_as_interrupt():
        greedy_logits(model, decode_tokens=4)
    monkeypatch.undo()
    counted = mlx_moestream.stats(model)
    assert not armed and counted["hits"] + counted["misses"] == accessed[0]
