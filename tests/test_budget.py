import subprocess

import numpy as np
import pytest

import mlx_moestream
from mlx_moestream import budget
from mlx_moestream.budget import (auto_budget, available_memory_bytes, cgroup_headrooms,
                                  format_bytes, parse_size, resolve_budget, vm_stat_available)
from mlx_moestream.errors import BudgetError
from mlx_moestream.mlx import loading

GiB = 2**30


@pytest.mark.parametrize("text, expected", [
    ("8GB", 8 * 10**9), ("512MiB", 512 * 2**20), ("1.5GiB", int(1.5 * GiB)), ("4096", 4096),
    ("64 kb", 64_000),
])
def test_sizes_parse_with_decimal_and_binary_units(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["8 parsecs", "", "GB", "-3GB"])
def test_unparseable_sizes_are_rejected(text):
    with pytest.raises(BudgetError, match="cannot parse"):
        parse_size(text)


def test_percentage_is_a_share_of_all_expert_bytes():
    assert resolve_budget("35%", expert_bytes=1000, dense_bytes=0) == 350


def test_budget_is_capped_at_all_expert_bytes():
    assert resolve_budget("8GB", expert_bytes=1000, dense_bytes=0) == 1000


def test_auto_keeps_all_experts_when_they_fit():
    assert auto_budget(expert_bytes=4 * GiB, dense_bytes=GiB, memory_bytes=24 * GiB) == 4 * GiB


def test_auto_leaves_dense_weights_and_a_reserve_when_experts_do_not_fit():
    budget = auto_budget(expert_bytes=100 * GiB, dense_bytes=4 * GiB, memory_bytes=24 * GiB)
    assert budget == 24 * GiB - 4 * GiB - 6 * GiB


def test_auto_in_a_container_of_under_4_gib_reserves_half_its_memory():
    """The 2 GiB floor of the reserve would leave nothing in a 1.5 GiB container."""
    budget = auto_budget(expert_bytes=2 * GiB, dense_bytes=GiB // 8, memory_bytes=3 * GiB // 2)
    assert budget == 3 * GiB // 2 - GiB // 8 - 3 * GiB // 4


@pytest.mark.parametrize("spec, problem", [
    ("nan%", "cannot parse budget"), ("inf%", "cannot parse budget"),
    ("1e400%", "cannot parse budget"), ("150%", "in \\(0%, 100%\\]: got '150%'"),
    ("0%", "in \\(0%, 100%\\]"), (float("nan"), "finite"), (float("inf"), "finite"),
])
def test_a_budget_that_is_not_a_share_or_a_finite_size_is_a_clear_error(spec, problem):
    with pytest.raises(BudgetError, match=problem):
        resolve_budget(spec, expert_bytes=1000, dense_bytes=0)


def test_an_int_budget_beyond_every_float_holds_every_expert():
    """`math.isfinite` of such an int overflows (an OverflowError naming no budget)."""
    assert resolve_budget(2**1030, expert_bytes=1000, dense_bytes=0) == 1000


def test_a_budget_in_bytes_may_be_a_numpy_number():
    assert resolve_budget(np.int64(300), expert_bytes=1000, dense_bytes=0) == 300
    assert resolve_budget(np.float32(300), expert_bytes=1000, dense_bytes=0) == 300


def test_a_size_of_hundreds_of_digits_is_exact_then_capped():
    assert parse_size("1" * 400) == int("1" * 400)
    assert resolve_budget("9" * 400, expert_bytes=1000, dense_bytes=0) == 1000


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_auto_stays_within_the_memory_limits_of_the_process_cgroups(tmp_path, version):
    """A container's limit (here its parent's, the tighter one), not the host's free memory:
    the limit less the usage, plus the inactive file pages the kernel reclaims first."""
    if version == "v2":
        line, top = "0::/box/job", tmp_path
        files = ("memory.max", "memory.current", "inactive_file")
    else:
        line, top = "4:memory:/box/job", tmp_path / "memory"
        files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    limit, usage, inactive = files
    for folder, values in ((top / "box", (4 * GiB, 3 * GiB, GiB // 2)),
                           (top / "box" / "job", (8 * GiB, GiB, 0))):
        folder.mkdir(parents=True)
        (folder / limit).write_text(f"{values[0]}\n")
        (folder / usage).write_text(f"{values[1]}\n")
        (folder / "memory.stat").write_text(f"anon 1\n{inactive} {values[2]}\n")
    (tmp_path / "cgroup").write_text(f"1:cpu:/elsewhere\n{line}\n")
    headrooms = cgroup_headrooms(str(tmp_path / "cgroup"), str(tmp_path))
    assert sorted(headrooms) == [GiB + GiB // 2, 7 * GiB]


def test_a_cgroup_without_a_memory_limit_leaves_the_free_memory(tmp_path):
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "cgroup").write_text("0::/\n")
    assert cgroup_headrooms(str(tmp_path / "cgroup"), str(tmp_path)) == []


def test_auto_below_the_minimum_says_where_the_memory_went(tiny_model, monkeypatch):
    """Not "budget 0 B is below the minimum", which names a budget nobody gave."""
    monkeypatch.setattr(loading, "memory_bytes", lambda: 2**19)  # 512 KiB free
    with pytest.raises(BudgetError, match=r"budget auto: 512.0 KiB of usable memory, less .* of "
                       r"dense weights and a reserve of 256.0 KiB .* leaves .*, below the minimum"):
        mlx_moestream.load(tiny_model(), budget="auto")


def test_auto_below_the_minimum_of_a_per_layer_split_says_where_the_memory_went(tiny_model,
                                                                                 monkeypatch):
    """Auto was checked against the shared pool's minimum, then the split's refused the bytes
    it gave with no word of the memory they came from."""
    from mlx_moestream.mlx import load_lazy

    path = tiny_model()
    plan = load_lazy(path)[-1]
    split = plan.budget_holding(plan.top_k, per_layer=True)
    memory = 2 * (plan.dense_bytes + split) - 2**16  # auto leaves less than the split needs
    monkeypatch.setattr(loading, "memory_bytes", lambda: memory)
    assert plan.min_budget_bytes < memory // 2 - plan.dense_bytes < split
    with pytest.raises(BudgetError, match=r"budget auto: .* of usable memory, .* below the "
                                          rf"minimum {format_bytes(split)}"):
        mlx_moestream.load(path, budget="auto", per_layer=True)


VM_STAT = """Mach Virtual Memory Statistics: (page size of 16384 bytes)
Pages free:                               12345.
Pages active:                            500000.
Pages inactive:                          200000.
Pages speculative:                         3000.
Pages throttled:                              0.
Pages wired down:                        150000.
Pages purgeable:                           9000.
"""


def test_free_memory_on_macos_is_what_vm_stat_counts_reclaimable(monkeypatch):
    """Other apps' memory is not ours to take. This machine is not a Mac: the platform and
    vm_stat's output (its format) are stood in for."""
    monkeypatch.setattr(budget.sys, "platform", "darwin")
    monkeypatch.setattr(budget.subprocess, "run",
                        lambda *args, **kwargs: subprocess.CompletedProcess(args, 0, VM_STAT, ""))
    assert available_memory_bytes() == (12345 + 3000 + 200000) * 16384


def test_free_memory_on_macos_without_vm_stat_falls_back_to_physical_memory(monkeypatch):
    def missing(*args, **kwargs):
        raise FileNotFoundError("vm_stat")

    monkeypatch.setattr(budget.sys, "platform", "darwin")
    monkeypatch.setattr(budget.subprocess, "run", missing)
    assert available_memory_bytes() > 0
    assert vm_stat_available("vm_stat: command not found") is None
