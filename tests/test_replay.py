"""Routing traces (format, recorder, synthetic workloads) and replay of policies over them."""

import json
import math
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from mlx_moestream.policies import POLICIES
from mlx_moestream.replay import _segments, capacity_slots, plot_sweep, replay, sweep, trace_profile
from mlx_moestream.errors import TraceError
from mlx_moestream.trace import Trace, TraceRecorder, synthetic_trace
from test_bad_input import run_cli

CAPACITIES = [0.1, 0.25, 0.5]


@pytest.fixture(scope="module")
def sweeps():
    """wlfu against LRU and Belady on drift traces (4 layers, 128 experts, top-8, 2048 tokens
    with the workload switching at token 1024), by (skew, repeat); computed once."""
    done = {}

    def get(skew, repeat):
        if (skew, repeat) not in done:
            trace = synthetic_trace(2048, 4, 128, 8, skew=skew, repeat=repeat, seed=0)
            done[skew, repeat] = sweep(trace, ["wlfu"], CAPACITIES)
        return done[skew, repeat]

    return get


@pytest.mark.parametrize("skew", [0.8, 1.2])
@pytest.mark.parametrize("repeat", [0.0, 0.2, 0.5])
def test_wlfu_is_never_more_than_one_point_below_lru_on_synthetic_traces(sweeps, skew, repeat):
    for result in sweeps(skew, repeat):
        assert result["hit_rate"] >= result["lru_hit_rate"] - 0.01, result["capacity_fraction"]


@pytest.mark.parametrize("skew, repeat", [(1.0, 0.1), (1.2, 0.0)])
def test_wlfu_beats_lru_on_skewed_workloads_with_drift(sweeps, skew, repeat):
    for result in sweeps(skew, repeat):
        assert result["hit_rate"] > result["lru_hit_rate"], result["capacity_fraction"]


@pytest.mark.parametrize("policy", ["wlfu", "cyclic"])
def test_prewarming_with_the_workload_profile_raises_early_hit_rate(policy):
    early = synthetic_trace(256, 4, 128, 8, switch_at=None, seed=0)
    recorded = synthetic_trace(512, 4, 128, 8, switch_at=None, seed=0, sample_seed=1)
    profile = trace_profile(recorded, np.arange(recorded.tokens), "same workload")
    cold = replay(early, policy, 0.25)
    warm = replay(early, policy, 0.25, profile=profile)
    assert warm["hit_rate"] > cold["hit_rate"]


def test_next_call_replays_from_a_prewarmed_cache():
    """Pre-warmed keys are resident before any use: the future is not advanced for them."""
    early = synthetic_trace(32, 4, 128, 8, switch_at=None, seed=0)
    recorded = synthetic_trace(512, 4, 128, 8, switch_at=None, seed=0, sample_seed=1)
    profile = trace_profile(recorded, np.arange(recorded.tokens), "same workload")
    result = replay(early, "next-call", 0.25, profile=profile)
    assert replay(early, "next-call", 0.25)["hit_rate"] < result["hit_rate"]
    assert result["hit_rate"] <= result["belady_hit_rate"]


def test_the_baselines_of_a_prewarmed_replay_start_prewarmed_too():
    """Else a pre-warmed policy beat Belady on a short trace: no reads for what it held."""
    early = synthetic_trace(32, 4, 128, 8, switch_at=None, seed=0)
    recorded = synthetic_trace(512, 4, 128, 8, switch_at=None, seed=0, sample_seed=1)
    profile = trace_profile(recorded, np.arange(recorded.tokens), "same workload")
    for result in sweep(early, ["cyclic", "lru", "belady"], CAPACITIES, profile=profile):
        assert result["hit_rate"] <= result["belady_hit_rate"]
        lru = replay(early, "lru", result["capacity"], profile=profile)
        assert result["lru_hit_rate"] == lru["hit_rate"]


def test_replay_result_is_json_ready_with_baselines_and_segments():
    trace = synthetic_trace(300, 3, 32, 4, seed=2)
    result = json.loads(json.dumps(replay(trace, "slru", 0.3)))
    assert result["policy"] == "slru" and result["capacity"] == round(0.3 * 96)
    assert result["hits"] + result["misses"] == int((trace.experts >= 0).sum())
    assert result["hit_rate"] == result["hits"] / (result["hits"] + result["misses"])
    assert 0 < result["lru_hit_rate"] <= result["belady_hit_rate"] <= 1
    assert [s["start_token"] for s in result["segments"]] == [0, 150]
    assert len(result["recovery_tokens"]) == 1 and len(result["lru_recovery_tokens"]) == 1


def test_replay_accepts_a_policy_factory_and_names_it():
    from mlx_moestream.policies import WindowLFU

    def wlfu_fast(capacity):
        return WindowLFU(capacity, 3 * 32, half_life=16)

    trace = synthetic_trace(200, 3, 32, 4, seed=3)
    assert replay(trace, wlfu_fast, 0.3)["policy"] == "wlfu_fast"


def test_per_layer_replay_splits_slots_by_profile_weights():
    trace = synthetic_trace(300, 3, 32, 4, seed=4)
    uniform = replay(trace, "wlfu", 0.5, per_layer=True)
    by_profile = replay(trace, "wlfu", 0.5, per_layer=trace.routing_entropy())
    assert uniform["per_layer"] and by_profile["per_layer"]
    assert uniform["belady_hit_rate"] >= uniform["hit_rate"]
    assert by_profile["belady_hit_rate"] >= by_profile["hit_rate"]


def test_sweep_reports_every_policy_at_every_capacity():
    trace = synthetic_trace(200, 3, 32, 4, seed=5)
    results = sweep(trace, ["lru", "wlfu", "belady"], [0.2, 40])
    assert [(r["policy"], r["capacity"]) for r in results] == [
        ("lru", 19), ("wlfu", 19), ("belady", 19), ("lru", 40), ("wlfu", 40), ("belady", 40)]
    for r in results:
        assert r["policy"] != "lru" or r["hit_rate"] == r["lru_hit_rate"]
        assert r["policy"] != "belady" or r["hit_rate"] == r["belady_hit_rate"]


def test_segments_measure_recovery_with_a_window_that_stops_at_the_switch():
    hits = np.array([9, 9, 9, 9, 0, 2, 5, 8, 8, 8, 8, 8])
    accesses = np.full(12, 10)
    segment_id = np.array([0] * 4 + [1] * 8)
    first, second = _segments(hits, accesses, segment_id, window_tokens=2)
    assert first["hit_rate"] == 0.9 and first["recovery_tokens"] is None
    assert second["start_token"] == 4 and second["steady_hit_rate"] == 0.8
    # trailing rates from the switch: 0.0, 0.1, 0.35, 0.65, 0.8 -> within 2 points at the 5th
    assert second["recovery_tokens"] == 5


def test_recovery_counts_the_new_segment_tokens_until_caught_up():
    segment_id = np.array([0, 0, 1, 1, 1, 1])
    _, late = _segments(np.array([5, 5, 0, 0, 0, 10]), np.full(6, 10), segment_id, 1)
    assert late["steady_hit_rate"] == 0.5 and late["recovery_tokens"] == 4
    _, flat = _segments(np.array([5, 5, 0, 0, 0, 0]), np.full(6, 10), segment_id, 1)
    assert flat["steady_hit_rate"] == 0.0 and flat["recovery_tokens"] == 1


def test_a_segment_without_accesses_has_no_rates():
    _, empty = _segments(np.array([5, 5, 0, 0]), np.array([10, 10, 0, 0]),
                         np.array([0, 0, 1, 1]), window_tokens=2)
    assert empty["hit_rate"] is None and empty["steady_hit_rate"] is None
    assert empty["recovery_tokens"] is None


@pytest.mark.parametrize(
    "capacity, match",
    [(0, "in \\[1, 128\\]"), (-3, "in \\[1, 128\\]"), (129, "in \\[1, 128\\]"),
     (0.0, "\\(0, 1\\]"), (1.5, "\\(0, 1\\]"), (float("nan"), "\\(0, 1\\]"),
     (float("inf"), "\\(0, 1\\]"), ("25%", "int number of slots"), (None, "int number"),
     (True, "int number"), (7, "below the top-8"), (0.05, "below the top-8")],
)
def test_invalid_capacity_raises_a_clear_error(capacity, match):
    trace = synthetic_trace(10, 2, 64, 8)
    with pytest.raises(ValueError, match=match):
        replay(trace, "lru", capacity)


def test_per_layer_capacity_must_hold_top_k_in_every_layer():
    trace = synthetic_trace(10, 2, 64, 8)
    assert capacity_slots(trace, 16, per_layer=True) == 16
    with pytest.raises(ValueError, match="in each of 2 layers"):
        capacity_slots(trace, 15, per_layer=True)


def test_unknown_policy_raises_a_clear_error():
    with pytest.raises(ValueError, match="unknown policy 'mru'"):
        replay(synthetic_trace(10, 2, 64, 8), "mru", 0.5)


def test_plot_sweep_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    results = sweep(synthetic_trace(100, 2, 32, 4), ["lru", "wlfu"], [0.25, 0.5])
    assert plot_sweep(results, tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_sweep_writes_nothing_without_matplotlib(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert plot_sweep([], tmp_path / "sweep.png") is False
    assert not (tmp_path / "sweep.png").exists()


# --- reading ahead ---


def _chained_trace(tokens=400, layers=4, num_experts=32, k=4, seed=0, chained=True) -> Trace:
    """Random experts at layer 0; each next layer's are a fixed permutation of the previous
    layer's (the strongest layer-to-layer co-activation), or, unchained, random too."""
    rng = np.random.default_rng(seed)
    experts = np.empty((tokens, layers, k), np.int16)
    experts[:, 0] = [rng.choice(num_experts, k, replace=False) for _ in range(tokens)]
    for layer in range(1, layers):
        if chained:
            experts[:, layer] = rng.permutation(num_experts)[experts[:, layer - 1]]
        else:
            experts[:, layer] = [rng.choice(num_experts, k, replace=False) for _ in range(tokens)]
    return Trace(experts, num_experts)


def test_coactivation_predicts_what_followed_and_halves_old_counts_each_half_life():
    from mlx_moestream.prefetch import CoActivation

    predictor = CoActivation(layers=2, num_experts=8, half_life_tokens=4)
    assert predictor.predict(0, [1, 2], 3).tolist() == []  # nothing seen yet
    predictor.learn(0, [1, 2], [5, 6])
    predictor.tick(4)
    predictor.learn(0, [1], [3])
    assert predictor.predict(0, [1, 2], 3).tolist() == [5, 6, 3]  # 2 (0.5 each) against 1
    assert predictor.predict(0, [1], 3).tolist() == [3, 5, 6]  # 1 against 0.5
    assert predictor.predict(0, [7], 3).tolist() == []


def test_prefetch_cuts_demand_misses_on_a_trace_with_layer_to_layer_coactivation(tmp_path):
    _chained_trace().save(tmp_path / "t.npz")
    out = run_cli("replay", tmp_path / "t.npz", "--capacity", "0.25", "--prefetch", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["misses"] < 0.6 * result["misses_without_prefetch"]
    assert result["misses_saved"] == 1 - result["misses"] / result["misses_without_prefetch"]
    assert result["hit_rate"] > result["hit_rate_without_prefetch"]
    assert result["reads_ahead_used"] > result["reads_ahead_wasted"]
    assert result["reads_ahead"] == result["reads_ahead_used"] + result["reads_ahead_wasted"]


def test_prefetch_stops_reading_ahead_for_layers_whose_predictions_are_poor():
    chained = replay(_chained_trace(), "cyclic", 0.25, prefetch_reads=4)
    unchained = replay(_chained_trace(chained=False), "cyclic", 0.25, prefetch_reads=4)
    assert unchained["prediction_precision"] < 0.25 < chained["prediction_precision"]
    assert unchained["reads_ahead"] < 0.2 * chained["reads_ahead"]


@pytest.mark.parametrize("reads", [1, 2])
def test_reads_ahead_per_layer_call_are_bounded_by_prefetch_reads(monkeypatch, reads):
    from mlx_moestream.cache import ExpertCache

    sizes = []
    prefetch = ExpertCache.prefetch

    def counted(self, layer, experts, protected):
        loads, evicted = prefetch(self, layer, experts, protected)
        sizes.append(len(loads))
        return loads, evicted

    monkeypatch.setattr(ExpertCache, "prefetch", counted)
    result = replay(_chained_trace(), "cyclic", 0.25, prefetch_reads=reads)
    assert max(sizes) == reads and sum(sizes) == result["reads_ahead"]


def test_replay_with_prefetch_is_deterministic():
    trace = _chained_trace(seed=1)
    first, second = (replay(trace, "cyclic", 0.25, prefetch_reads=4) for _ in range(2))
    first.pop("accesses_per_second")
    second.pop("accesses_per_second")
    assert first == second


@pytest.mark.parametrize("args, error", [
    (["--prefetch", "--prefetch-reads", "0"],
     "Error: Invalid value for '--prefetch-reads': 0 is not in the range x>=1."),
    (["--prefetch", "--prefetch-reads", "two"],
     "Error: Invalid value for '--prefetch-reads': 'two' is not a valid integer range."),
    (["--prefetch-reads", "2"], "Error: --prefetch-reads limits --prefetch: give both"),
    (["--prefetch", "--policy", "belady"],
     "Error: belady is offline: it cannot rank experts read ahead"),
    (["--read-time", "1"], "Error: --read-time times --prefetch: give both"),
    (["--prefetch", "--read-time", "0"],
     "Error: Invalid value for '--read-time': 0.0 is not in the range x>0."),
    (["--prefetch", "--read-time", "nan"],
     "Error: Invalid value for '--read-time': nan is not a finite number"),
])
def test_bad_prefetch_options_are_a_one_line_error(tmp_path, args, error):
    _chained_trace(tokens=16).save(tmp_path / "t.npz")
    out = run_cli("replay", tmp_path / "t.npz", *args)
    assert out.returncode in (1, 2) and out.stdout == ""
    assert out.stderr.splitlines()[-1] == error and "Traceback" not in out.stderr


@pytest.mark.parametrize("reads", [0, -1, 1.5, True])
def test_replay_refuses_prefetch_reads_that_are_not_a_count(reads):
    with pytest.raises(ValueError, match="must be an int of at least 1"):
        replay(_chained_trace(tokens=16), "cyclic", 0.5, prefetch_reads=reads)


def test_reads_ahead_that_fit_in_a_layer_s_compute_land_in_time_and_save_time(tmp_path):
    _chained_trace().save(tmp_path / "t.npz")
    out = run_cli("replay", tmp_path / "t.npz", "--prefetch", "--prefetch-reads", "4",
                  "--read-time", "0.25", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["reads_ahead"] > 0 and result["reads_ahead_late"] == 0
    assert result["time_per_token"] == pytest.approx(result["layers"] + result["stall_per_token"])
    assert result["time_per_token_without_prefetch"] == pytest.approx(
        result["layers"] + result["misses_without_prefetch"] * 0.25 / result["tokens"])
    assert result["speedup"] > 1.3


def test_reads_ahead_on_a_disk_slower_than_compute_land_late_and_save_no_time():
    result = replay(_chained_trace(), "cyclic", 0.25, prefetch_reads=4, read_time=4.0)
    assert result["reads_ahead_late"] > 0.9 * result["reads_ahead"]
    assert result["speedup"] < 1.0


def test_replay_prints_the_time_per_token_with_and_without_reading_ahead(tmp_path):
    _chained_trace(tokens=16).save(tmp_path / "t.npz")
    out = run_cli("replay", tmp_path / "t.npz", "--prefetch", "--read-time", "0.5")
    assert out.returncode == 0, out.stderr
    assert re.search(r"^time per token at 0.5 layer computes per read: \d+\.\d\d without, "
                     r"\d+\.\d\d with \(\d\.\d{3}x\); \d+ reads ahead landed late$",
                     out.stdout, re.M), out.stdout


@pytest.mark.parametrize("read_time, prefetch_reads", [
    (1.0, None), (0.0, 4), (-1.0, 4), (math.inf, 4), (math.nan, 4), (True, 4)])
def test_replay_refuses_a_read_time_that_is_not_a_time_above_zero(read_time, prefetch_reads):
    with pytest.raises(ValueError, match="read time"):
        replay(_chained_trace(tokens=16), "cyclic", 0.5, prefetch_reads=prefetch_reads,
               read_time=read_time)


def test_replay_output_without_prefetch_is_unchanged(tmp_path):
    synthetic_trace(200, 3, 32, 4, seed=5).save(tmp_path / "t.npz")
    out = run_cli("replay", tmp_path / "t.npz", "--capacity", "0.3")
    assert out.returncode == 0, out.stderr
    assert out.stdout == ("  policy   slots  hit rate     lru  belady  evictions\n"
                          "  cyclic      29    60.92%  54.96%  75.83%        909\n")
    out = run_cli("replay", tmp_path / "t.npz", "--capacity", "0.3", "--json")
    assert list(json.loads(out.stdout)) == [
        "policy", "capacity", "capacity_fraction", "per_layer", "tokens", "layers",
        "num_experts", "top_k", "hits", "misses", "evictions", "hit_rate",
        "accesses_per_second", "segments", "recovery_tokens", "lru_hit_rate",
        "belady_hit_rate", "lru_recovery_tokens"]


# --- trace files ---


def _arrays(**changes):
    arrays = {
        "experts": np.array([[[0, 1], [2, -1]], [[3, 0], [1, 2]]], np.int16),
        "num_experts": np.int64(4),
        "weights": np.full((2, 2, 2), 0.5, np.float16),
        "segment_id": np.array([0, 1], np.int32),
    }
    arrays.update(changes)
    return {k: v for k, v in arrays.items() if v is not None}


def _write(path, **changes):
    np.savez(path, **_arrays(**changes))
    return path


def test_save_then_load_round_trips(tmp_path):
    trace = synthetic_trace(50, 3, 16, 4, seed=1)
    trace.save(tmp_path / "t.npz")
    loaded = Trace.load(tmp_path / "t.npz")
    np.testing.assert_array_equal(loaded.experts, trace.experts)
    np.testing.assert_array_equal(loaded.weights, trace.weights)
    np.testing.assert_array_equal(loaded.segment_id, trace.segment_id)
    assert loaded.num_experts == 16


def test_save_leaves_no_temporary_file(tmp_path):
    synthetic_trace(20, 2, 16, 4).save(tmp_path / "t.npz")
    synthetic_trace(20, 2, 16, 4, seed=1).save(tmp_path / "t.npz")  # replaces
    assert os.listdir(tmp_path) == ["t.npz"]


def test_saved_file_has_the_permissions_the_umask_allows(tmp_path):
    umask = os.umask(0o022)
    os.umask(umask)
    synthetic_trace(20, 2, 16, 4).save(tmp_path / "t.npz")
    assert (tmp_path / "t.npz").stat().st_mode & 0o777 == 0o666 & ~umask


def test_failed_save_keeps_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "t.npz"
    synthetic_trace(20, 2, 16, 4).save(path)
    before = path.read_bytes()

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez_compressed", fail)
    with pytest.raises(OSError, match="disk full"):
        synthetic_trace(20, 2, 16, 4, seed=1).save(path)
    assert os.listdir(tmp_path) == ["t.npz"] and path.read_bytes() == before


def test_optional_arrays_may_be_absent(tmp_path):
    trace = Trace.load(_write(tmp_path / "t.npz", weights=None, segment_id=None))
    assert trace.weights is None and trace.segment_id is None and trace.tokens == 2


def test_a_trace_from_another_tool_loads_with_its_extra_arrays_kept_aside(tmp_path):
    trace = Trace.load(_write(tmp_path / "t.npz", model=np.array("gpt-oss-20b"),
                              segment_names=np.array(["mmlu/a", "gpqa/b"])))
    assert trace.tokens == 2 and sorted(trace.extras) == ["model", "segment_names"]
    assert str(trace.extras["model"]) == "gpt-oss-20b"


def test_a_trace_with_metadata_of_pickled_objects_loads_without_them(tmp_path):
    """Never unpickled (it could run code): left out, as any extra array is ignored."""
    notes = np.array([{"prompt": 1}, None], dtype=object)
    trace = Trace.load(_write(tmp_path / "t.npz", notes=notes, model=np.array("m")))
    assert trace.tokens == 2 and sorted(trace.extras) == ["model"]


@pytest.mark.parametrize(
    "changes, problem",
    [
        ({"experts": None}, "missing experts"),
        ({"num_experts": None}, "missing num_experts"),
        ({"experts": np.zeros((2, 2, 2), np.int32)}, "experts must be an int16 array, got int32"),
        ({"experts": np.zeros((2, 2), np.int16)}, "experts must be \\[tokens, layers, k\\]"),
        ({"experts": np.zeros((0, 2, 2), np.int16)}, "experts is empty"),
        ({"experts": np.full((2, 2, 2), 4, np.int16)}, "must be < num_experts = 4, found 4"),
        ({"experts": np.full((2, 2, 2), -2, np.int16)}, "must be >= -1 .*found -2"),
        ({"experts": np.full((2, 2, 2), -1, np.int16)}, "no expert ids: every entry is -1"),
        ({"num_experts": np.array([4])}, "num_experts must be an integer scalar"),
        ({"num_experts": np.float64(4)}, "num_experts must be an integer scalar"),
        ({"num_experts": np.int64(0)}, "num_experts must be in \\[1, 32768\\]"),
        ({"weights": np.zeros((2, 2, 2), np.float32)}, "weights must be a float16 array"),
        ({"weights": np.zeros((2, 2, 3), np.float16)}, "weights shape \\(2, 2, 3\\) does not"),
        ({"weights": np.full((2, 2, 2), np.inf, np.float16)}, "weights must be finite"),
        ({"segment_id": np.zeros(2, np.float32)}, "segment_id must be an integer array"),
        ({"segment_id": np.zeros((2, 1), np.int32)}, "segment_id must be \\[tokens\\]"),
        ({"segment_id": np.zeros(3, np.int32)}, "segment_id has 3 tokens, experts has 2"),
    ],
)
def test_malformed_trace_raises_trace_error_naming_file_and_problem(tmp_path, changes, problem):
    path = _write(tmp_path / "bad.npz", **changes)
    with pytest.raises(TraceError, match=f"bad.npz: .*{problem}"):
        Trace.load(path)


def test_unreadable_trace_files_raise_trace_error(tmp_path):
    (tmp_path / "junk.npz").write_bytes(b"not a zip at all")
    np.save(tmp_path / "plain.npy", np.zeros(3))
    with zipfile.ZipFile(tmp_path / "truncated.npz", "w") as z:
        z.writestr("experts.npy", b"\x93NUMPY garbage")
    (tmp_path / "notes.txt").write_text("hello")
    for name, problem in [("missing.npz", "not a readable trace .npz"),
                          ("junk.npz", r"not a readable trace .npz \(not a zip"),
                          ("notes.txt", r"not a readable trace .npz \(not a zip"),
                          ("plain.npy", r"not a readable trace .npz \(not a zip"),
                          ("truncated.npz", "not a readable trace .npz")]:
        with pytest.raises(TraceError, match=f"{name}: {problem}"):
            Trace.load(tmp_path / name)


def test_replaying_a_device_says_it_is_not_a_trace_and_never_offers_to_unpickle():
    out = run_cli("replay", "/dev/zero")
    assert out.returncode == 1
    assert out.stderr == "Error: /dev/zero: not a readable trace .npz (not a regular file)\n"


def test_trace_error_is_a_value_error():
    with pytest.raises(ValueError, match="trace: expert ids must be < num_experts"):
        Trace(np.full((1, 1, 1), 9, np.int16), 4)


# --- recorder and synthetic traces ---


def test_recorder_stacks_prefill_and_decode_calls_in_token_order():
    recorder = TraceRecorder(num_layers=2, num_experts=8)
    prefill = [np.array([[0, 1], [2, 3], [4, 5]]), np.array([[6, 7], [0, 2], [1, 3]])]
    decode = [np.array([[[5, 6]]]), np.array([[[7, 0]]])]  # [batch, tokens, k]
    for call in (prefill, decode):
        for layer, ids in enumerate(call):
            recorder.record(layer, ids)
    trace = recorder.to_trace()
    assert trace.experts.dtype == np.int16 and trace.experts.shape == (4, 2, 2)
    np.testing.assert_array_equal(trace.experts[:, 0], [[0, 1], [2, 3], [4, 5], [5, 6]])
    np.testing.assert_array_equal(trace.experts[:, 1], [[6, 7], [0, 2], [1, 3], [7, 0]])


def test_recorder_copies_ids_and_marks_masked_ids_as_none():
    recorder = TraceRecorder(num_layers=1, num_experts=4)
    ids = np.array([[1, 4], [-5, 2]])
    recorder.record(0, ids)
    ids[:] = 0
    np.testing.assert_array_equal(recorder.to_trace().experts[:, 0], [[1, -1], [-1, 2]])


def test_recorder_keeps_weights_when_every_call_has_them():
    recorder = TraceRecorder(num_layers=1, num_experts=4)
    recorder.record(0, np.array([[1, 2]]), np.array([[0.25, 0.75]]))
    assert recorder.to_trace().weights.tolist() == [[[0.25, 0.75]]]


def test_recorder_rejects_layers_out_of_order():
    recorder = TraceRecorder(num_layers=3, num_experts=4)
    recorder.record(0, np.array([[1]]))
    with pytest.raises(ValueError, match="layer 2 recorded out of order: expected layer 1"):
        recorder.record(2, np.array([[1]]))


def test_recorder_started_during_a_forward_call_leaves_that_call_out():
    recorder = TraceRecorder(num_layers=2, num_experts=4)
    for layer in (1, 0, 1):
        recorder.record(layer, np.array([[layer + 2]]))
    np.testing.assert_array_equal(recorder.to_trace().experts, [[[2], [3]]])


def test_recorder_drops_an_unfinished_last_call():
    recorder = TraceRecorder(num_layers=2, num_experts=4)
    for layer in (0, 1, 0):
        recorder.record(layer, np.array([[layer]]))
    assert recorder.to_trace().tokens == 1


def test_synthetic_trace_routes_distinct_experts_and_marks_the_switch():
    trace = synthetic_trace(100, 3, 16, 4, switch_at=0.3)
    assert trace.experts.shape == (100, 3, 4) and trace.experts.dtype == np.int16
    assert all(len(set(row)) == 4 for row in trace.experts.reshape(-1, 4).tolist())
    assert trace.segment_id.tolist() == [0] * 30 + [1] * 70
    np.testing.assert_allclose(trace.weights.astype(np.float32).sum(axis=2), 1, atol=1e-2)


def test_synthetic_trace_is_reproducible_and_sample_seed_keeps_the_workload():
    a = synthetic_trace(400, 2, 32, 4, switch_at=None, seed=7)
    again = synthetic_trace(400, 2, 32, 4, switch_at=None, seed=7)
    other_tokens = synthetic_trace(400, 2, 32, 4, switch_at=None, seed=7, sample_seed=8)
    other_workload = synthetic_trace(400, 2, 32, 4, switch_at=None, seed=8)
    np.testing.assert_array_equal(a.experts, again.experts)
    assert not np.array_equal(a.experts, other_tokens.experts)
    hot = np.argsort(-a.usage(), axis=1)[:, :4]
    assert (np.argsort(-other_tokens.usage(), axis=1)[:, :4] == hot).mean() > \
        (np.argsort(-other_workload.usage(), axis=1)[:, :4] == hot).mean()


def test_synthetic_trace_repeats_previous_experts_more_with_more_locality():
    def overlap(trace):
        e = trace.experts
        return np.mean([len(set(e[t, 0]) & set(e[t - 1, 0])) for t in range(1, trace.tokens)])

    assert overlap(synthetic_trace(300, 1, 64, 4, repeat=0.6)) > \
        overlap(synthetic_trace(300, 1, 64, 4, repeat=0.0)) + 1


def test_profile_helpers_count_uses_per_expert():
    trace = Trace(np.array([[[0, 1]], [[1, -1]]], np.int16), 3)
    assert trace.expert_counts() == {0: 1.0, 1: 2.0}
    assert trace.working_set().tolist() == [2]
    np.testing.assert_allclose(trace.routing_entropy(), [0.9183], atol=1e-4)


def test_a_trace_that_would_expand_past_the_limit_is_refused_before_decompressing(tmp_path,
                                                                                  monkeypatch):
    """A zip bomb: 16 MiB of zeros compresses to a few KiB."""
    from mlx_moestream import trace as trace_module

    monkeypatch.setattr(trace_module, "MAX_TRACE_BYTES", 2**20)
    path = tmp_path / "bomb.npz"
    np.savez_compressed(path, experts=np.zeros((2**20, 4, 2), np.int16), num_experts=np.int64(4))
    assert path.stat().st_size < 2**17
    with pytest.raises(TraceError, match="array 'experts' would expand the trace past"):
        Trace.load(path)


def _declaring(path: Path, experts_bytes: int) -> None:
    """A trace whose `experts` are that many bytes of zeros, written in chunks: a few MiB."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        with z.open("experts.npy", "w", force_zip64=True) as f:
            np.lib.format.write_array_header_1_0(
                f, {"descr": "<i2", "fortran_order": False, "shape": (experts_bytes // 2, 1, 1)})
            chunk = bytes(2**26)
            for start in range(0, experts_bytes, len(chunk)):
                f.write(chunk[: experts_bytes - start])
        with z.open("num_experts.npy", "w") as f:
            np.lib.format.write_array(f, np.array(4))


def test_replay_of_a_trace_that_would_expand_past_the_limit_stays_in_bounded_memory(tmp_path):
    """A file of a few MiB whose `experts` declare 3.9 GiB: refused from its header, the
    process's peak resident memory (VmHWM) read from /proc staying far below it. A data limit
    makes a regression fail instead of filling the memory."""
    from mlx_moestream.trace import MAX_TRACE_BYTES

    path = tmp_path / "big.npz"
    _declaring(path, 39 * 2**30 // 10)
    assert path.stat().st_size < 2**25
    code = ("import resource, sys\n"
            "resource.setrlimit(resource.RLIMIT_DATA, (3 * 2**30, 3 * 2**30))\n"
            "from mlx_moestream.cli import main\n"
            "try:\n"
            "    main(['replay', sys.argv[1], '--capacity', '1.0'])\n"
            "finally:\n"
            "    print(*[l for l in open('/proc/self/status') if l.startswith('VmHWM')],\n"
            "          file=sys.stderr)\n")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1
    assert (f"Error: {path}: array 'experts' would expand the trace past "
            f"{MAX_TRACE_BYTES >> 20} MiB") in out.stderr
    peak_kib = int(out.stderr.split("VmHWM:")[1].split()[0])
    assert peak_kib * 2**10 < 2**29


def test_saving_a_trace_over_a_file_that_is_not_a_trace_is_refused(tmp_path):
    trace = synthetic_trace(16, 2, 8, 2, seed=0)
    notes = tmp_path / "notes.npz"
    notes.write_bytes(b"not mine to replace")
    with pytest.raises(TraceError, match="refusing to replace .*notes.npz: it is not a routing"):
        trace.save(notes)
    assert notes.read_bytes() == b"not mine to replace"
    trace.save(tmp_path / "t.npz")
    trace.save(tmp_path / "t.npz")  # a trace is replaced
    assert Trace.load(tmp_path / "t.npz").tokens == 16


def test_saving_a_trace_over_another_tools_trace_is_refused(tmp_path):
    """Another tool's trace loads as a trace (its extra arrays ignored), and was replaced."""
    trace = synthetic_trace(16, 2, 8, 2, seed=0)
    theirs = tmp_path / "theirs.npz"
    np.savez(theirs, experts=trace.experts, num_experts=np.int64(8), model=np.array("gpt-oss"))
    before = theirs.read_bytes()
    with pytest.raises(TraceError, match="theirs.npz: it is not a routing trace mlx-moestream "
                                         "wrote"):
        trace.save(theirs)
    assert theirs.read_bytes() == before


@pytest.mark.parametrize("target, problem", [
    ("notes.txt", "refusing to replace notes.txt: it is not a routing trace mlx-moestream "
                  "wrote"),
    ("missing/t.npz", "cannot write missing/t.npz: missing is not a writable folder"),
])
def test_make_trace_refuses_a_target_it_cannot_write_in_one_line(tmp_path, target, problem):
    (tmp_path / "notes.txt").write_text("not mine to replace")
    script = Path(__file__).resolve().parent.parent / "scripts" / "make_trace.py"
    out = subprocess.run([sys.executable, str(script), target, "--tokens", "8", "--layers", "2",
                          "--experts", "8", "--top-k", "2"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1 and out.stderr == f"Error: {problem}\n"
    assert (tmp_path / "notes.txt").read_text() == "not mine to replace"


def test_bench_replay_also_replays_the_first_tokens_of_each_trace_alone(tmp_path):
    synthetic_trace(64, 3, 16, 2, seed=3).save(tmp_path / "t.npz")
    script = Path(__file__).resolve().parent.parent / "scripts" / "bench_replay.py"
    out = subprocess.run([sys.executable, str(script), str(tmp_path), "--capacity", "0.5",
                          "--first", "16", "--first", "64"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert list(result["traces"]) == ["t.npz", "t.npz first 16"]  # 64 is the whole trace
    assert result["traces"]["t.npz first 16"]["tokens"] == 16
    assert result["summary"]["rows"] == 2
    worst = min(r["rows"][0]["vs_best_other_points"] for r in result["traces"].values())
    assert result["summary"]["worst_vs_best_other_points"] == worst


def test_bench_policy_times_every_policy_the_offline_ones_included():
    """`next-call` needs the replay's keys per token: without them the script stopped there."""
    script = Path(__file__).resolve().parent.parent / "scripts" / "bench_policy.py"
    out = subprocess.run([sys.executable, str(script), "--layers", "2", "--experts", "8",
                          "--top-k", "2", "--tokens", "16", "--runs", "1", "--repeat", "0.1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    cost = json.loads(out.stdout)["bookkeeping_us_per_layer_token"]
    assert set(cost) == set(POLICIES) and {"next-call", "belady"} <= set(cost)


def bench_replay_module():
    """scripts/bench_replay.py as a module."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "scripts" / "bench_replay.py"
    spec = importlib.util.spec_from_file_location("bench_replay", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_bench_replay_replays_windows_spread_over_each_trace_each_alone(tmp_path):
    synthetic_trace(100, 3, 16, 2, seed=3).save(tmp_path / "t.npz")
    script = Path(__file__).resolve().parent.parent / "scripts" / "bench_replay.py"
    out = subprocess.run([sys.executable, str(script), str(tmp_path), "--capacity", "0.25",
                          "--capacity", "0.5", "--windows", "16"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout)["windows"]["16"]
    assert found["all"]["rows"] == found["t.npz"]["rows"]
    assert found["all"]["rows"]["cyclic"] == found["all"]["rows"]["lfu/layer"] == 6 * 2  # 100 // 16
    trace = Trace.load(tmp_path / "t.npz")
    cuts = bench_replay_module().windows(trace, 16)  # evenly spread, none overlapping
    assert [cut.experts.tolist() for cut in cuts] == [
        trace.experts[start:start + 16].tolist() for start in (0, 16, 33, 50, 67, 84)]


def test_bench_replay_counts_a_policy_below_the_best_baseline_but_itself_by_over_half_a_point():
    rows = [{"hit_rate": {"lru": 0.5, "lfu": 0.6, "slru": 0.55, "cyclic": 0.596,
                          "belady": 0.9}},
            {"hit_rate": {"lru": 0.7, "lfu": 0.6, "slru": 0.55, "cyclic": 0.69,
                          "belady": 0.9}}]
    found = bench_replay_module().below_best_other(rows)
    assert found["share_below_by_over_half_a_point"] == {"lru": 0.5, "lfu": 0.5, "slru": 1.0,
                                                         "cyclic": 0.5}
    assert found["mean_points"]["lfu"] == -2.5  # +5 over slru, then -10 under lru
    assert "belady" not in found["mean_points"]
    assert found["rows"]["lru"] == 2


def test_bench_replay_tables_show_a_gap_closed_just_below_zero_as_0_percent():
    """Rounded with a format, -0.3% printed as '-0%' in docs/caching.md."""
    bench = bench_replay_module()
    row = {"capacity": 0.1, "hit_rate": {"lru": 0.2}, "best_other": "lfu/layer",
           "gap_closed": -0.003}
    table = bench.markdown({"t.npz": {"tokens": 8, "layers": 2, "num_experts": 4, "top_k": 2,
                                      "rows": [row]}})
    assert table.splitlines()[-1].endswith("| lfu/layer | 0% |")
