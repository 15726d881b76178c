"""Activation profiles: recorded live, saved atomically, refused on another model, pre-warming."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

import mlx_moestream
from mlx_moestream.errors import ProfileError, StoreError
from mlx_moestream.profiles import Profile, find
from mlx_moestream.replay import token_hits
from mlx_moestream.trace import Trace

PROMPT = "the quick brown fox jumps over the lazy dog " * 3


def _session(path, **kwargs):
    model, tokenizer = mlx_moestream.load(path, **kwargs)
    text = mlx_lm.generate(model, tokenizer, PROMPT, max_tokens=16)
    return model, text


def _saved_profile(path, tmp_path, budget):
    """The profile of a short session on `path`, saved as tmp_path/p.json."""
    model, _ = _session(path, budget=budget)
    return mlx_moestream.save_profile(model, tmp_path / "p.json")


def test_profile_counts_every_routed_token(tiny_model, tmp_path):
    model, _ = _session(tiny_model("qwen3_moe"), budget="50%")
    saved = Profile.load(mlx_moestream.save_profile(model, tmp_path / "p.json"))
    stats = mlx_moestream.stats(model)
    assert saved.tokens == stats["tokens"]
    # top-2 routing: each layer routed every token to 2 experts
    assert (saved.counts.sum(axis=1) == 2 * saved.tokens).all()
    assert saved.model["model_type"] == "qwen3_moe"
    assert json.loads((tmp_path / "p.json").read_text())["schema"] == "mlx-moestream-profile"


def test_a_profile_named_with_an_upper_case_json_suffix_is_that_file(tiny_model, tmp_path,
                                                                      monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, _ = _session(tiny_model("qwen3_moe"), budget="50%")
    saved = mlx_moestream.save_profile(model, "UP.JSON")
    assert saved == Path("UP.JSON") and os.listdir(tmp_path) == ["UP.JSON"]
    assert find("UP.JSON") == saved


def test_profile_save_is_atomic(tiny_model, tmp_path, monkeypatch):
    model, _ = _session(tiny_model("qwen3_moe"), budget="50%")
    target = mlx_moestream.save_profile(model, tmp_path / "p.json")
    previous = target.read_text()

    def broken_fsync(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk full"):
        mlx_moestream.save_profile(model, target)
    assert target.read_text() == previous
    assert os.listdir(tmp_path) == ["p.json"]


def test_prewarm_loads_the_hottest_experts(tiny_model, tmp_path):
    path = tiny_model("qwen3_moe")
    profile_path = _saved_profile(path, tmp_path, "25%")
    model, _ = mlx_moestream.load(path, budget="25%", profile=profile_path)
    resident = {(l, e) for l, experts in enumerate(model.moestream.state().resident)
                for e in experts}
    assert resident == set(Profile.load(profile_path).hottest(4))
    assert mlx_moestream.stats(model)["prewarm"]["experts"] == 4


def test_prewarm_raises_hit_rate_and_keeps_outputs_identical(tiny_model, tmp_path):
    path = tiny_model("qwen3_moe")
    first, text = _session(path, budget="50%")
    profile_path = mlx_moestream.save_profile(first, tmp_path / "p.json")
    warm, warm_text = _session(path, budget="50%", profile=profile_path)
    assert warm_text == text
    assert mlx_moestream.stats(warm)["hit_rate"] > mlx_moestream.stats(first)["hit_rate"]


def test_prewarm_reads_are_counted_apart_from_demand_reads(tiny_model, tmp_path):
    """A profile reads experts before any call asks: counted with the demand reads, it made
    a session with a higher hit rate look as if it read more."""
    path = tiny_model("qwen3_moe")
    warm, _ = _session(path, budget="50%", profile=_saved_profile(path, tmp_path, "50%"))
    stats = mlx_moestream.stats(warm)
    prewarm = stats["prewarm"]
    assert prewarm["experts"] > 0 and stats["demand_loads"] == stats["misses"]
    assert stats["loads"] - stats["demand_loads"] == prewarm["experts"]
    assert stats["bytes_read"] - stats["demand_bytes_read"] == prewarm["bytes"]


def test_a_prewarm_at_a_budget_holding_every_expert_says_why_it_read_none(tiny_model, tmp_path):
    path = tiny_model("qwen3_moe")
    profile = _saved_profile(path, tmp_path, "50%")
    out = _cli("chat", "-m", path, "--prompt", PROMPT, "-n", 4, "-b", "100%",
               "--profile", "load", profile, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert (f"pre-warmed 0 experts from profile '{Profile.load(profile).workload}' (every "
            "expert is resident at this budget, read at load)") in out.stdout


def test_prewarm_mid_session_splits_the_hit_rate_at_that_point(tiny_model, tmp_path):
    path = tiny_model("qwen3_moe")
    profile_path = _saved_profile(path, tmp_path, "50%")
    model, tokenizer = mlx_moestream.load(path, budget="50%")
    mlx_lm.generate(model, tokenizer, PROMPT, max_tokens=8)
    before = mlx_moestream.stats(model)
    mlx_moestream.prewarm(model, profile_path)
    mlx_lm.generate(model, tokenizer, PROMPT, max_tokens=8)
    after = mlx_moestream.stats(model)
    hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
    assert after["prewarm"]["hit_rate_before"] == before["hit_rate"]
    assert after["prewarm"]["hit_rate_after"] == hits / (hits + misses)


def test_prewarm_at_load_has_no_hit_rate_before(tiny_model, tmp_path):
    path = tiny_model("qwen3_moe")
    first, _ = _session(path, budget="50%")
    warm, _ = _session(path, budget="50%", profile=mlx_moestream.save_profile(first, tmp_path / "p"))
    stats = mlx_moestream.stats(warm)
    assert stats["prewarm"]["hit_rate_before"] is None
    assert stats["prewarm"]["hit_rate_after"] == stats["hit_rate"]


def test_prewarm_share_limits_the_warm_set(tiny_model, tmp_path):
    path = tiny_model("qwen3_moe")
    profile_path = _saved_profile(path, tmp_path, "50%")
    model, _ = mlx_moestream.load(path, budget="50%", profile=profile_path, prewarm_share=0.5)
    assert mlx_moestream.stats(model)["prewarm"]["experts"] == 4


def test_pins_are_read_even_beyond_the_prewarm_share(tiny_model, tmp_path):
    """Pinning the hottest experts reads them, whatever share is pre-warmed, and no more: of
    8 slots, 6 may be pinned (2 stay for a call's top-2)."""
    path = tiny_model("qwen3_moe")
    profile_path = _saved_profile(path, tmp_path, "50%")
    model, _ = mlx_moestream.load(path, budget="50%", profile=profile_path, prewarm_share=0,
                                  pin_share=1)
    prewarm = mlx_moestream.stats(model)["prewarm"]
    assert prewarm["pinned"] == prewarm["experts"] == 6


def test_profile_of_another_model_is_refused_naming_both(tiny_model, tmp_path):
    qwen, _ = _session(tiny_model("qwen3_moe"), budget="50%")
    profile_path = mlx_moestream.save_profile(qwen, tmp_path / "qwen.json")
    with pytest.raises(ProfileError, match=r"recorded on qwen3_moe .* this model is mixtral"):
        mlx_moestream.load(tiny_model("mixtral"), budget="50%", profile=profile_path)


def test_profile_recorded_on_float_model_applies_to_its_quantized_version(tiny_model, tmp_path):
    model, _ = _session(tiny_model("qwen3_moe"), budget="50%")
    profile_path = mlx_moestream.save_profile(model, tmp_path / "p.json")
    quantized, _ = mlx_moestream.load(tiny_model("qwen3_moe", bits=4), budget="50%",
                                      profile=profile_path)
    assert mlx_moestream.stats(quantized)["prewarm"]["experts"] > 0


def _profile_json(counts, decayed, model=None, half_life_tokens=256) -> str:
    return json.dumps({
        "schema": "mlx-moestream-profile", "version": 1, "workload": "w", "created": "now",
        "model": model or {"fingerprint": "f"}, "tokens": 1, "half_life_tokens": half_life_tokens,
        "layers": [{"name": "l0", "counts": counts, "decayed": decayed}]})


@pytest.mark.parametrize("content, problem", [
    ("{not json", "not a readable profile"),
    ('{"schema": "other"}', "not an mlx-moestream profile"),
    ('{"schema": "mlx-moestream-profile", "version": 1, "layers": []}', "malformed profile"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    (_profile_json([1e30, 1], [1, 1]), "malformed profile"),
    (_profile_json([1, 1], [float("nan"), 1]), "must be finite"),
    (_profile_json([1.7, 1], [1, 1]), "whole numbers"),
    (_profile_json([1, 1], [1, 1], half_life_tokens=0), "half_life_tokens >= 1"),
    (_profile_json([], []), "at least one of each"),  # `profile diff` divided by zero
    (_profile_json([1], [1]).replace('[{"name": "l0", "counts": [1], "decayed": [1]}]', "[]"),
     "at least one of each"),
    # merged with a profile of its model, such counts were broadcast over every expert
    (_profile_json([1], [1], {"fingerprint": "f", "moe_layers": 1, "experts": 2}),
     "counts for 1 layers x 1 experts, but its own model record has 1 x 2"),
    # shown by `profile show` and `list` as they were: an escape sequence cleared the screen
    (_profile_json([1], [1]).replace('"workload": "w"', '"workload": "w\\u001b[2J"'),
     "its workload holds control characters"),
    (_profile_json([1], [1], {"fingerprint": "f", "model_type": "q\nfake line"}),
     "its model.model_type holds control characters"),
])
def test_malformed_profile_is_a_clear_error(tmp_path, content, problem):
    (tmp_path / "bad.json").write_text(content)
    with pytest.raises(ProfileError, match=problem):
        Profile.load(tmp_path / "bad.json")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes")
def test_a_profile_path_that_is_a_named_pipe_is_refused_at_once(tmp_path):
    """Reading a FIFO (or /dev/zero) as a profile waited for a writer forever: `profile list`
    hung on one in ./profiles."""
    os.mkfifo(tmp_path / "p.json")
    with pytest.raises(ProfileError, match="not a regular file"):
        Profile.load(tmp_path / "p.json")


def test_unknown_profile_name_lists_where_it_looked(tiny_model, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ProfileError, match="no profile named 'nowhere' .*looked in"):
        mlx_moestream.load(tiny_model("qwen3_moe"), profile="nowhere")


def test_trace_records_every_token_and_layer(tiny_model, tmp_path):
    model, tokenizer = mlx_moestream.load(tiny_model("qwen3_moe"), budget="50%")
    mlx_moestream.start_trace(model)
    mlx_lm.generate(model, tokenizer, PROMPT, max_tokens=8)
    mlx_moestream.save_trace(model, tmp_path / "t.npz")
    trace = Trace.load(tmp_path / "t.npz")
    assert trace.experts.shape == (mlx_moestream.stats(model)["tokens"], 2, 2)
    assert trace.num_experts == 8


def test_a_trace_saved_into_a_missing_folder_is_refused_naming_the_folder(tiny_model, tmp_path):
    """The error named the hidden temporary file the write could not open."""
    model, tokenizer = mlx_moestream.load(tiny_model("qwen3_moe"), budget="50%")
    mlx_moestream.start_trace(model)
    mlx_lm.generate(model, tokenizer, PROMPT, max_tokens=2)
    with pytest.raises(ValueError, match=f"cannot write {tmp_path}/no/t.npz: {tmp_path}/no is "
                                         f"not a writable folder"):
        mlx_moestream.save_trace(model, tmp_path / "no" / "t.npz")


CLI = [sys.executable, "-m", "mlx_moestream.cli"]


def _cli(*args, cwd):
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


def test_chat_saves_a_profile_by_name_on_a_fresh_install(tiny_model, tmp_path):
    """No ./profiles and no user profile folder yet: the folder is made, the profile saved."""
    user = tmp_path / "no" / "profiles-yet"
    out = subprocess.run([*CLI, "chat", "-m", str(tiny_model("qwen3_moe")), "--budget", "50%",
                          "-n", "3", "--prompt", "ciao", "--profile", "save", "fresh"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120,
                         env={**os.environ, "MLX_MOESTREAM_PROFILES": str(user)})
    assert out.returncode == 0, out.stderr
    assert Profile.load(user / "fresh.json").tokens > 0


def test_profile_show_and_diff_take_what_another_tool_may_write(tmp_path):
    """A profile whose `model` lacks fields, and a --top of 0: one-line answers, no traceback."""
    data = json.loads(find("english-chat").read_text())
    data["model"] = {"fingerprint": data["model"]["fingerprint"]}
    (tmp_path / "sparse.json").write_text(json.dumps(data))
    out = _cli("profile", "show", tmp_path / "sparse.json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "tokens on None (None MoE layers x None experts" in out.stdout
    out = _cli("profile", "diff", "english-chat", "italian-chat", "--top", 0, cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "Invalid value for '--top': 0 is not in the range x>=1" in out.stderr


def test_profile_record_runs_a_text_and_saves_its_profile(tiny_model, tmp_path):
    (tmp_path / "text.txt").write_text("one two three four five six seven eight nine ten")
    out = _cli("profile", "record", tmp_path / "p.json", "--text", tmp_path / "text.txt",
               "-m", tiny_model("qwen3_moe"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    profile = Profile.load(tmp_path / "p.json")
    assert profile.workload == "p" and profile.tokens > 0 and profile.counts.sum() > 0


def test_profile_record_streams_under_a_budget_and_counts_as_a_full_one(tiny_model, tmp_path):
    """A workload's profile of a model larger than memory: recorded at a budget that streams,
    its counts are those of a budget that holds every expert."""
    (tmp_path / "text.txt").write_text("one two three four five six seven eight nine ten")
    for budget in ("25%", "100%"):
        out = _cli("profile", "record", tmp_path / f"{budget[:-1]}.json", "--text",
                   tmp_path / "text.txt", "-m", tiny_model("qwen3_moe"), "-b", budget,
                   cwd=tmp_path)
        assert out.returncode == 0, out.stderr
    streamed, full = (Profile.load(tmp_path / f"{b}.json") for b in ("25", "100"))
    assert streamed.counts.sum() > 0 and (streamed.counts == full.counts).all()


@pytest.mark.parametrize("name, text, problem", [
    ("bad name!", "fine", "'bad name!' is neither a profile name"),
    ("p.json", b"\xff\xfe not utf-8", "text.txt: not UTF-8 text (invalid start byte at byte 0)"),
    ("p.json", " \n", "text.txt: no text, so nothing to profile"),  # saved an empty profile
])
def test_profile_record_checks_its_name_and_text_before_the_model_runs(tmp_path, name, text,
                                                                       problem):
    text_file = tmp_path / "text.txt"
    text_file.write_bytes(text if isinstance(text, bytes) else text.encode())
    out = _cli("profile", "record", name, "--text", text_file, "-m", tmp_path / "no-model",
               cwd=tmp_path)  # a model that cannot load: the checks come first
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert problem in out.stderr and "no-model" not in out.stderr


def test_chat_saves_then_loads_a_profile_by_name(tiny_model, tmp_path):
    (tmp_path / "profiles").mkdir()
    model = tiny_model("qwen3_moe")
    out = _cli("chat", "-m", model, "--prompt", PROMPT, "-n", 8, "-b", "50%",
               "--profile", "save", "fox-chat", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "profiles" / "fox-chat.json").exists()
    out = _cli("chat", "-m", model, "--prompt", PROMPT, "-n", 8, "-b", "50%",
               "--profile", "load", "fox-chat", "--profile", "save", "fox-chat-2", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "pre-warmed 8 experts from profile 'fox-chat'" in out.stdout
    assert (tmp_path / "profiles" / "fox-chat-2.json").exists()


def test_profile_cli_lists_shows_merges_and_diffs(tiny_model, tmp_path):
    (tmp_path / "profiles").mkdir()
    model = tiny_model("qwen3_moe")
    for name, prompt in (("a", PROMPT), ("b", "def f(x): return x * 2")):
        assert _cli("chat", "-m", model, "--prompt", prompt, "-n", 4, "--profile", "save", name,
                    cwd=tmp_path).returncode == 0
    listed = _cli("profile", "list", cwd=tmp_path).stdout
    assert "a " in listed and "b " in listed
    shown = _cli("profile", "show", "a", "--top", 2, cwd=tmp_path).stdout
    assert "layer   0: top-2 carry" in shown
    assert _cli("profile", "merge", "a", "b", "-o", "ab", cwd=tmp_path).returncode == 0
    merged = Profile.load(tmp_path / "profiles" / "ab.json")
    assert merged.tokens == sum(Profile.load(tmp_path / "profiles" / f"{n}.json").tokens
                                for n in "ab")
    diffed = _cli("profile", "diff", "a", "b", cwd=tmp_path).stdout
    assert "JS div" in diffed and len(diffed.splitlines()) == 3


def test_a_profile_diffed_with_itself_overlaps_fully_at_any_top(tmp_path):
    from mlx_moestream.profiles import diff

    profile = Profile.load(find("english-chat"))
    experts = profile.counts.shape[1]
    for top in (1, experts, 4 * experts):
        assert all(row["top_overlap"] == 1.0 for row in diff(profile, profile, top))


def test_a_profile_merged_to_a_path_is_named_for_its_file(tmp_path):
    out = _cli("profile", "merge", "english-chat", "italian-chat", "-o", tmp_path / "both.json",
               cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert Profile.load(tmp_path / "both.json").workload == "both"


def test_chat_trace_then_replay_reports_policy_lru_and_belady(tiny_model, tmp_path):
    out = _cli("chat", "-m", tiny_model("qwen3_moe"), "--prompt", PROMPT, "-n", 8,
               "--trace", tmp_path / "t.npz", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    out = _cli("replay", tmp_path / "t.npz", "--policy", "wlfu", "--capacity", "0.25", "--json",
               cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["capacity"] == 4
    assert result["belady_hit_rate"] >= max(result["hit_rate"], result["lru_hit_rate"])


def test_a_profile_saved_to_a_path_without_json_suffix_loads_from_that_path(tiny_model,
                                                                            tmp_path, monkeypatch):
    """A relative `Path("mine")` was looked up as the profile NAME mine."""
    path = tiny_model("qwen3_moe")
    monkeypatch.chdir(tmp_path)
    model, _ = _session(path, budget="50%")
    mlx_moestream.save_profile(model, Path("mine"))
    model, _ = mlx_moestream.load(path, budget="50%", profile=Path("mine"))
    assert mlx_moestream.stats(model)["prewarm"]["experts"] > 0


def test_replay_takes_policy_options_and_refuses_bad_ones(tiny_model, tmp_path):
    out = _cli("chat", "-m", tiny_model("qwen3_moe"), "--prompt", PROMPT, "-n", 8,
               "--trace", tmp_path / "t.npz", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    out = _cli("replay", tmp_path / "t.npz", "--policy", "slru:protected_share=0.5", "--json",
               cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["policy"] == "slru:protected_share=0.5"
    out = _cli("replay", tmp_path / "t.npz", "--policy", "slru:protected=0.5", cwd=tmp_path)
    assert out.returncode != 0
    assert "'slru' has no option 'protected'" in out.stderr and "Traceback" not in out.stderr


def test_replay_of_a_malformed_trace_is_a_clear_error(tmp_path):
    np.savez(tmp_path / "bad.npz", experts=np.zeros((4, 2), np.int16))
    out = _cli("replay", tmp_path / "bad.npz", cwd=tmp_path)
    assert out.returncode != 0
    assert "bad.npz" in out.stderr and "Traceback" not in out.stderr


def test_pinned_experts_are_never_evicted(tiny_model, tmp_path):
    path = tiny_model("qwen3_moe")
    profile_path = _saved_profile(path, tmp_path, "50%")
    model, tokenizer = mlx_moestream.load(path, budget="50%", profile=profile_path, pin_share=0.5)
    runtime = model.moestream
    pinned = {(l, e) for l, experts in enumerate(runtime.state().pinned) for e in experts}
    assert len(pinned) == 4
    assert sum(layer["pinned"] for layer in mlx_moestream.stats(model)["layers"]) == 4
    slots = {(l, e): runtime.residency.slot_map(l)[e] for l, e in pinned}
    assert mlx_lm.generate(model, tokenizer, "def f(x): return [x] * 9 " * 4, max_tokens=16)
    assert mlx_moestream.stats(model)["evictions"] > 0
    assert {(l, e): runtime.residency.slot_map(l)[e] for l, e in pinned} == slots


def test_a_full_budget_with_most_slots_pinned_counts_every_routed_token(tiny_model, tmp_path):
    """A prompt routing to more experts than the unpinned slots, every one resident: its
    routing went uncounted, and a profile saved then lacked it."""
    path = tiny_model("qwen3_moe")
    profile = _saved_profile(path, tmp_path, "50%")
    model, _ = mlx_moestream.load(path, budget="100%", profile=profile, pin_share=1.0)
    assert all(model.moestream.residency.capacity(layer) < 8 for layer in range(2))
    mx.eval(model(mx.array([list(range(64))])))
    stats = mlx_moestream.stats(model)
    counts = model.moestream.stats.activations
    assert stats["tokens"] == 64 and (counts.sum(axis=1) == 2 * 64).all()


def test_a_prewarm_on_a_full_pool_pins_the_hottest_experts_already_resident(tiny_model,
                                                                           tmp_path):
    path = tiny_model("qwen3_moe")
    profile = Profile.load(_saved_profile(path, tmp_path, "50%"))
    model, tokenizer = mlx_moestream.load(path, budget="50%")
    stock, _ = mlx_lm.load(str(path))
    mlx_lm.generate(model, tokenizer, PROMPT, max_tokens=16)
    state = model.moestream.state()
    assert not any(state.free_slots)  # the session filled the pool
    resident_hot = {(l, e) for l, e in profile.hottest(4) if e in state.resident[l]}
    info = mlx_moestream.prewarm(model, profile, pin_share=0.5)
    pinned = {(l, e) for l, experts in enumerate(model.moestream.state().pinned)
              for e in experts}
    assert resident_hot and pinned == resident_hot and info["pinned"] == len(pinned)
    assert (mlx_lm.generate(model, tokenizer, PROMPT, max_tokens=16)
            == mlx_lm.generate(stock, tokenizer, PROMPT, max_tokens=16))


@pytest.mark.parametrize("per_layer", [False, True])
def test_a_second_prewarm_counts_the_pins_of_the_first(tiny_model, tmp_path, per_layer):
    """Pre-warming again with another workload's profile must leave every layer room for one
    call's experts unpinned, and the pins within the share of the budget."""
    path = tiny_model("qwen3_moe")
    profile = Profile.load(_saved_profile(path, tmp_path, "50%"))
    other = dataclasses.replace(profile, workload="other",  # hot where the first is cold
                                counts=profile.counts.max() - profile.counts,
                                decayed=profile.decayed.max() - profile.decayed)
    model, tokenizer = mlx_moestream.load(path, budget="50%", per_layer=per_layer)
    mlx_moestream.prewarm(model, profile, share=0.5, pin_share=0.5)
    mlx_moestream.prewarm(model, other, share=1.0, pin_share=0.5)
    runtime = model.moestream
    assert sum(map(len, runtime.state().pinned)) <= 4
    assert all(runtime.residency.capacity(layer) >= runtime.plan.top_k for layer in range(2))
    stock, _ = mlx_lm.load(str(path))
    assert (mlx_lm.generate(model, tokenizer, PROMPT, max_tokens=16)
            == mlx_lm.generate(stock, tokenizer, PROMPT, max_tokens=16))


def test_a_prewarm_pins_no_expert_whose_read_is_still_in_flight(tiny_model, reference):
    """A decode step cut short by Ctrl-C leaves the next layer's prefetch reads in flight; a
    prewarm pinned those experts, and when the reads failed they stayed pinned without a slot:
    every later token computed from slot -1 (cyclic), or every call raised (lru)."""
    import threading

    import mlx.nn as nn
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_moestream.testing import PROMPT_IDS, greedy_logits

    path = tiny_model("qwen3_moe", num_layers=4, num_experts=16)
    model, _ = mlx_moestream.load(path, budget="40%", prefetch=True)
    runtime = model.moestream
    read, failing = runtime.store.read_expert, [False]

    def read_expert(layer, expert, destination):  # layer 2's reads on the I/O threads
        if failing[0] and layer == 2 and threading.current_thread() is not threading.main_thread():
            raise StoreError(f"injected read error of layer 2 expert {expert}")
        return read(layer, expert, destination)

    class CtrlC(nn.Module):  # in layer 2's attention: layer 1 has started its prefetch
        def __init__(self, inner):
            super().__init__()
            self.inner, self.armed = inner, False

        def __call__(self, *args, **kwargs):
            if self.armed:
                self.armed = False
                raise KeyboardInterrupt
            return self.inner(*args, **kwargs)

    runtime.store.read_expert = read_expert
    attention = model.model.layers[2].self_attn = CtrlC(model.model.layers[2].self_attn)
    cache = make_prompt_cache(model)
    token = mx.argmax(model(mx.array(PROMPT_IDS), cache=cache)[:, -1], axis=-1)
    failing[0] = attention.armed = True
    with pytest.raises(KeyboardInterrupt):
        model(token[:, None], cache=cache)
    failing[0] = False
    in_flight = sorted(runtime.state().reading)
    assert in_flight and {layer for layer, _ in in_flight} == {2}
    decayed = np.zeros((4, 16))
    for i, (layer, expert) in enumerate(in_flight):
        decayed[layer, expert] = 100 - i
    profile = Profile("hot", runtime.plan.identity, decayed.copy(), decayed, 100, 32,
                      [layer.path for layer in runtime.plan.layers])
    pinned = mlx_moestream.prewarm(model, profile, share=0.0, pin_share=0.5)["pinned"]
    assert pinned > 0
    got = greedy_logits(model)
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, reference(path)))
    assert mlx_moestream.stats(model)["layers"][2]["pinned"] == pinned  # read again, then pinned


def test_per_layer_split_follows_the_profile_and_stays_exact(tiny_model, tmp_path):
    path = tiny_model("qwen3_moe")
    first, text = _session(path, budget="50%")
    profile_path = mlx_moestream.save_profile(first, tmp_path / "p.json")
    model, tokenizer = mlx_moestream.load(path, budget="50%", profile=profile_path, per_layer=True)
    limits = model.moestream.residency.caches[0].limit
    assert sum(limits.values()) == 8 and min(limits.values()) >= 2
    assert mlx_lm.generate(model, tokenizer, PROMPT, max_tokens=16) == text


def test_replay_prewarms_the_experts_that_load_prewarms(tiny_model, tmp_path):
    path = tiny_model("qwen3_moe")
    profile_path = _saved_profile(path, tmp_path, "25%")
    model, _ = mlx_moestream.load(path, budget="25%", profile=profile_path)
    resident = model.moestream.state().resident
    # one token routed to exactly the experts that load() pre-warmed
    experts = np.full((1, 2, 4), -1, np.int16)
    for layer in range(2):
        warm = sorted(resident[layer])
        experts[0, layer, : len(warm)] = warm
    trace = Trace(experts, 8)
    slots = sum(map(len, resident))
    hits, accesses = token_hits(trace, "cyclic", 4, Profile.load(profile_path))
    assert slots == 4 and hits[0] == accesses[0] == slots
    assert token_hits(trace, "cyclic", 4)[0][0] == 0


def test_a_profile_of_another_shape_is_refused_even_with_the_right_fingerprint(tiny_model,
                                                                                tmp_path):
    path = tiny_model("qwen3_moe")
    model, _ = _session(path, budget="50%")
    saved = Profile.load(mlx_moestream.save_profile(model, tmp_path / "p.json"))
    saved.counts, saved.decayed = saved.counts[:, :3], saved.decayed[:, :3]
    with pytest.raises(ProfileError, match="counts for 2 layers x 3 experts, but this model has "
                                           "2 x 8"):
        mlx_moestream.load(path, budget="50%", profile=saved)


@pytest.mark.parametrize("share, pin_share", [(-1.0, 0.0), (1.5, 0.0), (1.0, -0.5),
                                              ("0.5", 0.0), (1.0, None)])
def test_prewarm_shares_outside_zero_to_one_are_refused(tiny_model, tmp_path, share, pin_share):
    path = tiny_model("qwen3_moe")
    profile_path = _saved_profile(path, tmp_path, "50%")
    with pytest.raises(ValueError, match=r"shares must be in \[0, 1\]"):
        mlx_moestream.load(path, budget="50%", profile=profile_path, prewarm_share=share,
                           pin_share=pin_share)


@pytest.mark.parametrize("name, problem", [
    ("../../evil", "is neither a profile name"),
    ("sub/name", "is neither a profile name"),
    ("missing/p.json", "no folder missing"),
    ("a" * 230, "its name is too long (at most 224 bytes in profiles)"),
])
def test_profile_save_takes_a_name_or_a_json_path_and_checks_it_before_the_session(
        tiny_model, tmp_path, name, problem):
    (tmp_path / "profiles").mkdir()
    out = _cli("chat", "-m", tiny_model("qwen3_moe"), "--prompt", PROMPT, "-n", 4,
               "--profile", "save", name, cwd=tmp_path)
    assert out.returncode != 0 and problem in out.stderr and "Traceback" not in out.stderr
    assert "hit rate" not in out.stdout  # refused before any answer
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["profiles"]


def test_profile_save_never_replaces_a_file_that_is_not_a_profile(tiny_model, tmp_path):
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": true}')
    notes.chmod(0o600)
    out = _cli("chat", "-m", tiny_model("qwen3_moe"), "--prompt", PROMPT, "-n", 4,
               "--profile", "save", notes, cwd=tmp_path)
    assert out.returncode != 0 and "refusing to replace" in out.stderr
    assert notes.read_text() == '{"mine": true}' and notes.stat().st_mode & 0o777 == 0o600


def test_profile_save_replaces_a_profile_of_another_version(tiny_model, tmp_path):
    """Another version of this tool wrote it: refused, it was said to be no profile at all."""
    from mlx_moestream.profiles import SCHEMA, VERSION

    target = tmp_path / "p.json"
    target.write_text(json.dumps({"schema": SCHEMA, "version": VERSION + 1}))
    out = _cli("chat", "-m", tiny_model("qwen3_moe"), "--prompt", PROMPT, "-n", 4,
               "--profile", "save", target, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert Profile.load(target).tokens > 0


def test_a_session_that_routed_nothing_leaves_an_earlier_profile_as_it_was(tiny_model,
                                                                             tmp_path):
    """Ctrl-D at once (stdin empty): the saved profile replaced the earlier one with an empty
    one, and the chat exited 0."""
    model = tiny_model("qwen3_moe")
    assert _cli("chat", "-m", model, "--prompt", PROMPT, "-n", 4, "--profile", "save",
                "p.json", cwd=tmp_path).returncode == 0
    before = (tmp_path / "p.json").read_text()
    out = subprocess.run([*CLI, "chat", "-m", str(model), "--profile", "save", "p.json"],
                         capture_output=True, text=True, cwd=tmp_path, stdin=subprocess.DEVNULL,
                         timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "profile p.json not saved: no token was routed in this session" in out.stderr
    assert (tmp_path / "p.json").read_text() == before


def test_a_trace_and_a_profile_given_one_file_are_refused_before_the_session(tiny_model,
                                                                           tmp_path):
    """The profile was written, then the trace refused to replace it: the trace was lost."""
    out = _cli("chat", "-m", tiny_model("qwen3_moe"), "--prompt", PROMPT, "-n", 4,
               "--trace", "same.json", "--profile", "save", "same.json", cwd=tmp_path)
    assert out.returncode == 2 and "need a file of their own" in out.stderr
    assert "hit rate" not in out.stdout and not (tmp_path / "same.json").exists()


def test_a_profile_saved_through_a_link_is_checked_where_the_link_points(tiny_model, tmp_path):
    """The link's folder was checked, the write went beside its target (a folder gone, or
    read-only): the session ran, and only then was the profile found unwritable."""
    (tmp_path / "link.json").symlink_to(tmp_path / "gone" / "mine.json")
    out = _cli("chat", "-m", tiny_model("qwen3_moe"), "--prompt", PROMPT, "-n", 4,
               "--profile", "save", "link.json", cwd=tmp_path)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert f"{tmp_path / 'gone'} is not a writable folder" in out.stderr
    assert "hit rate" not in out.stdout  # refused before any answer


def test_chat_trace_never_replaces_a_file_that_is_not_a_trace(tiny_model, tmp_path):
    notes = tmp_path / "notes.md"
    notes.write_text("my notes, not a trace")
    out = _cli("chat", "-m", tiny_model("qwen3_moe"), "--prompt", PROMPT, "-n", 4,
               "--trace", notes, cwd=tmp_path)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert f"refusing to replace {notes}: it is not a routing trace" in out.stderr
    assert "hit rate" not in out.stdout  # refused before any answer
    assert notes.read_text() == "my notes, not a trace"


def test_a_profile_that_cannot_be_written_does_not_lose_the_trace(tiny_model, tmp_path,
                                                                  monkeypatch):
    """The profile's folder turns read-only mid-session: the trace is still written."""
    folder = tmp_path / "out"
    folder.mkdir()
    code = (
        "import os, sys; from mlx_moestream import cli, session; "
        "session.save_profile = lambda *a: (_ for _ in ()).throw(OSError('disk full')); "
        "cli.main()")
    out = subprocess.run(
        [sys.executable, "-c", code, "chat", "-m", str(tiny_model("qwen3_moe")), "--prompt",
         PROMPT, "-n", "4", "--profile", "save", str(folder / "p.json"), "--trace",
         str(folder / "t.npz")], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode != 0 and "not saved: disk full" in out.stderr
    assert "Traceback" not in out.stderr
    assert Trace.load(folder / "t.npz").tokens > 0


def test_sigterm_ends_an_interactive_chat_saving_profile_and_trace_with_status_143(tiny_model,
                                                                                  tmp_path):
    """128 + SIGTERM, as a shell reports a command the signal ended."""
    chat = subprocess.Popen(
        [*CLI, "chat", "-m", str(tiny_model("qwen3_moe")), "-n", "4", "--profile", "save",
         str(tmp_path / "p.json"), "--trace", str(tmp_path / "t.npz")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    chat.stdin.write(PROMPT + "\n")
    chat.stdin.flush()
    while "hit rate" not in chat.stdout.readline():  # the first answer is done
        pass
    chat.send_signal(signal.SIGTERM)
    _, err = chat.communicate(timeout=60)
    assert chat.returncode == 128 + signal.SIGTERM and "Traceback" not in err, err
    assert Profile.load(tmp_path / "p.json").tokens > 0
    assert Trace.load(tmp_path / "t.npz").tokens > 0


def test_a_chat_whose_terminal_closed_saves_its_outputs_without_a_traceback(tiny_model,
                                                                             tmp_path):
    """The terminal closing sends SIGHUP, and from then on every write to it fails (EIO): the
    outputs are still saved, and the chat ends with status 129 (128 + SIGHUP) and no traceback
    (stderr here is a pipe, as when it is redirected to a log)."""
    import pty

    terminal, chat_side = pty.openpty()
    chat = subprocess.Popen(
        [*CLI, "chat", "-m", str(tiny_model("qwen3_moe")), "-n", "4", "--profile", "save",
         str(tmp_path / "p.json"), "--trace", str(tmp_path / "t.npz")],
        stdin=chat_side, stdout=chat_side, stderr=subprocess.PIPE, text=True)
    os.close(chat_side)
    os.write(terminal, (PROMPT + "\n").encode())
    shown = b""
    while b"hit rate" not in shown:  # the first answer is done
        shown += os.read(terminal, 4096)
    chat.send_signal(signal.SIGSTOP)  # both land before it reads again, as when the terminal
    os.waitpid(chat.pid, os.WUNTRACED)  # stopped, not still writing its prompt
    os.close(terminal)  # closes: its writes fail (EIO) and SIGHUP comes
    chat.send_signal(signal.SIGHUP)
    chat.send_signal(signal.SIGCONT)
    _, err = chat.communicate(timeout=60)
    assert chat.returncode == 128 + signal.SIGHUP and "Traceback" not in err, err
    assert Profile.load(tmp_path / "p.json").tokens > 0
    assert Trace.load(tmp_path / "t.npz").tokens > 0


def test_a_read_error_mid_chat_is_a_one_line_error(tiny_model, tmp_path):
    code = (
        "import errno, os; from mlx_moestream import cli; "
        "os.preadv = lambda *a: (_ for _ in ()).throw(OSError(errno.EIO, 'Input/output error')); "
        "cli.main()")
    out = subprocess.run(
        [sys.executable, "-c", code, "chat", "-m", str(tiny_model("qwen3_moe")), "--prompt",
         PROMPT, "-n", "4", "-b", "25%"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "Error: " in out.stderr and "Input/output error" in out.stderr


def test_merging_profiles_of_two_models_names_both(tiny_model, tmp_path):
    for name, arch in (("a", "qwen3_moe"), ("b", "mixtral")):
        model, _ = _session(tiny_model(arch), budget="50%")
        mlx_moestream.save_profile(model, tmp_path / f"{name}.json")
    out = _cli("profile", "merge", tmp_path / "a.json", tmp_path / "b.json", "-o",
               tmp_path / "ab.json", cwd=tmp_path)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert f"second profile 'b' ({tmp_path / 'b.json'}) was recorded on mixtral" in out.stderr
    assert "but the first profile's model is qwen3_moe" in out.stderr


@pytest.mark.parametrize("without", ["first", "second"])
def test_merging_a_profile_without_a_model_fingerprint_is_refused_clearly(tmp_path, without):
    for name in ("first", "second"):
        profile = Profile.load(find("italian-chat"))
        if name == without:
            del profile.model["fingerprint"]
        profile.save(tmp_path / f"{name}.json")
    out = _cli("profile", "merge", tmp_path / "first.json", tmp_path / "second.json", "-o",
               tmp_path / "both.json", cwd=tmp_path)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "fingerprint None" in out.stderr and not (tmp_path / "both.json").exists()


@pytest.mark.parametrize("command", [["show", "{name}"], ["diff", "english-chat", "{name}"],
                                     ["merge", "{name}", "english-chat", "-o", "both"]])
def test_a_profile_name_too_long_to_look_up_is_a_one_line_error(tmp_path, command):
    name = "c" * 300
    out = _cli("profile", *[part.format(name=name) for part in command], cwd=tmp_path)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert f"Error: profile '{name}': File name too long" in out.stderr


def test_a_merge_whose_sums_are_out_of_range_writes_nothing(tmp_path):
    profile = Profile.load(find("italian-chat"))
    profile.decayed[:] = 1e308
    profile.save(tmp_path / "huge.json")
    out = _cli("profile", "merge", tmp_path / "huge.json", tmp_path / "huge.json", "-o",
               tmp_path / "both.json", cwd=tmp_path)
    assert out.returncode == 1 and "Traceback" not in out.stderr and "Warning" not in out.stderr
    assert "decayed counts must be finite" in out.stderr
    assert not (tmp_path / "both.json").exists()


def test_replay_plot_without_sweep_is_a_usage_error(tmp_path):
    from mlx_moestream.trace import synthetic_trace

    synthetic_trace(20, 2, 8, 2).save(tmp_path / "t.npz")
    out = _cli("replay", tmp_path / "t.npz", "--plot", tmp_path / "p.png", cwd=tmp_path)
    assert out.returncode == 2 and "--plot draws the --sweep" in out.stderr


def test_progress_of_the_full_load_and_of_a_prewarm_runs_to_the_end(tiny_model, tmp_path):
    """A bar only reaches 100% when its iterable is asked past the last item."""
    from contextlib import contextmanager

    finished = []

    @contextmanager
    def progress(items, label):
        def walk():
            yield from items
            finished.append(label)
        yield walk()

    path = tiny_model("qwen3_moe")
    profile_path = _saved_profile(path, tmp_path, "50%")
    mlx_moestream.load(path, budget="100%", progress=progress)
    mlx_moestream.load(path, budget="50%", profile=profile_path, progress=progress)
    assert finished == ["read experts", "pre-warm p"]


def test_prewarm_reads_count_among_loads_and_bytes_read(tiny_model, tmp_path):
    path = tiny_model("qwen3_moe")
    profile_path = _saved_profile(path, tmp_path, "50%")
    warm, _ = mlx_moestream.load(path, budget="50%", profile=profile_path)
    stats = mlx_moestream.stats(warm)
    assert stats["loads"] == stats["prewarm"]["experts"] > 0
    assert stats["bytes_read"] == stats["prewarm"]["bytes"]


def test_replay_sweep_skips_capacities_below_one_token(tmp_path):
    from mlx_moestream.trace import synthetic_trace

    synthetic_trace(20, 2, 8, 2).save(tmp_path / "t.npz")  # 5% of 16 slots is below top-2
    out = _cli("replay", tmp_path / "t.npz", "--sweep", "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert min(r["capacity"] for r in json.loads(out.stdout)) == 2


def test_replay_plot_without_matplotlib_is_an_error_that_says_so(tmp_path):
    from mlx_moestream.trace import synthetic_trace

    synthetic_trace(20, 2, 8, 2).save(tmp_path / "t.npz")
    code = ("import sys; sys.modules['matplotlib'] = sys.modules['matplotlib.figure'] = None; "
            "from mlx_moestream.cli import main; main()")
    out = subprocess.run([sys.executable, "-c", code, "replay", str(tmp_path / "t.npz"),
                          "--sweep", "--plot", str(tmp_path / "p.png")],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 1 and "--plot needs matplotlib" in out.stderr
    assert not (tmp_path / "p.png").exists()
