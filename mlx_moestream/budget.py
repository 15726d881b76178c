"""Memory budget for resident experts: parsing `8GB`, `512MiB`, `35%`, `auto`. No mlx."""

from __future__ import annotations

import math
import numbers
import os
import re
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

from .errors import BudgetError

UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
# Kept free for the KV cache, activations and the OS when sizing `auto`.
AUTO_RESERVE_FRACTION = 0.25
AUTO_RESERVE_MIN_BYTES = 2 * 2**30



NUMBER = r"\s*([0-9]*\.?[0-9]+)\s*"  # plain decimals: no sign, exponent, nan or inf


def parse_size(text: str) -> int:
    """`8GB` -> 8e9 bytes, `512MiB` -> 512 * 2**20 bytes, `4096` -> 4096 bytes. Exact for any
    number of digits (no float rounding or overflow)."""
    m = re.fullmatch(NUMBER + r"([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in UNITS:
        raise BudgetError(f"cannot parse size '{text}' (use e.g. 8GB, 512MiB, 35%, auto)")
    try:
        return int(Fraction(m.group(1)) * UNITS[m.group(2).lower()])
    except ValueError:  # Python's limit on digits in a conversion (4300)
        raise BudgetError(f"size '{text[:20]}...' has too many digits") from None


def available_memory_bytes() -> int:
    """Memory the OS can give now: on Linux MemAvailable, within what the memory limits of the
    process's cgroups leave (a container's: the host's free memory is not ours to take); on
    macOS the free and inactive pages `vm_stat` counts (what other apps hold is not ours);
    physical memory where neither can be read."""
    if sys.platform == "darwin":
        try:
            text = subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            text = ""
        free = vm_stat_available(text)
        if free is not None:
            return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return min([int(line.split()[1]) * 1024, *cgroup_headrooms()])
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def vm_stat_available(text: str) -> int | None:
    """Bytes free, speculative or inactive (reclaimable without swapping) in macOS `vm_stat`
    output; None if the output is not vm_stat's."""
    page = re.search(r"page size of (\d+) bytes", text)
    counts = re.findall(r"^Pages (?:free|speculative|inactive):\s+(\d+)\.?$", text, re.MULTILINE)
    if not page or len(counts) < 3:
        return None
    return sum(map(int, counts)) * int(page.group(1))


def cgroup_headrooms(proc: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> list[int]:
    """What each memory limit over this process leaves (v2 and v1, its cgroup's and its
    ancestors'): the limit less the usage, plus the inactive file pages the kernel reclaims
    first."""
    try:
        lines = Path(proc).read_text().splitlines()
    except OSError:
        return []
    headrooms = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if not controllers:  # v2
            top, names = Path(root), ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            top = Path(root) / "memory"
            names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        folder = top / path.lstrip("/")
        while top == folder or top in folder.parents:
            headroom = _headroom(folder, *names)
            if headroom is not None:
                headrooms.append(headroom)
            folder = folder.parent
    return headrooms


def _headroom(folder: Path, limit_file: str, usage_file: str, inactive: str) -> int | None:
    try:
        limit = (folder / limit_file).read_text().strip()
        if limit == "max":
            return None
        usage = int((folder / usage_file).read_text())
        stat = dict(line.split() for line in (folder / "memory.stat").read_text().splitlines())
        return max(0, int(limit) - usage + int(stat.get(inactive, 0)))
    except (OSError, ValueError):
        return None


def auto_budget(expert_bytes: int, dense_bytes: int, memory_bytes: int) -> int:
    """All experts if they fit; otherwise what memory leaves after dense weights and a reserve."""
    return max(0, min(expert_bytes, memory_bytes - dense_bytes - auto_reserve(memory_bytes)))


def auto_reserve(memory_bytes: int) -> int:
    """What `auto` leaves free for the KV cache, activations and the OS: at most half the
    memory, so that a small container still runs a small model."""
    floor = min(AUTO_RESERVE_MIN_BYTES, memory_bytes // 2)
    return max(floor, int(memory_bytes * AUTO_RESERVE_FRACTION))


def resolve_budget(
    spec: int | float | str | None,
    expert_bytes: int,
    dense_bytes: int,
    memory_bytes: int | None = None,
    min_bytes: int = 0,
) -> int:
    """Bytes for resident experts. None means all experts (a fully resident model). `auto`
    below `min_bytes` (what the runtime needs) is an error that says where the memory went."""
    if spec is None:
        return expert_bytes
    if isinstance(spec, numbers.Real) and not isinstance(spec, bool):  # numpy's numbers too
        # an int is finite, and may exceed every float (isfinite then overflows)
        if not isinstance(spec, numbers.Integral) and not math.isfinite(spec):
            raise BudgetError(f"budget must be a finite number of bytes, got {spec!r}")
        budget = int(spec)
    elif isinstance(spec, str) and spec.strip().lower() == "auto":
        memory_bytes = memory_bytes or available_memory_bytes()
        budget = auto_budget(expert_bytes, dense_bytes, memory_bytes)
        if budget < min_bytes:
            raise BudgetError(
                f"budget auto: {format_bytes(memory_bytes)} of usable memory, less "
                f"{format_bytes(dense_bytes)} of dense weights and a reserve of "
                f"{format_bytes(auto_reserve(memory_bytes))} for the KV cache and activations, "
                f"leaves {format_bytes(budget)}, below the minimum {format_bytes(min_bytes)}: free "
                f"memory, or give a budget of at least the minimum (it may swap)")
    elif isinstance(spec, str) and spec.strip().endswith("%"):
        m = re.fullmatch(NUMBER + "%", spec.strip())
        if not m:
            raise BudgetError(f"cannot parse budget '{spec}' (a percentage is like 35%)")
        share = Fraction(m.group(1)) / 100
        if not 0 < share <= 1:
            raise BudgetError(f"a percentage budget is a share of all expert bytes, in (0%, "
                              f"100%]: got '{spec.strip()}'")
        budget = int(expert_bytes * share)
    elif isinstance(spec, str):
        budget = parse_size(spec)
    else:
        raise BudgetError(f"budget must be bytes, a size string, a percentage or 'auto', not {spec!r}")
    if budget < 0:
        raise BudgetError(f"budget must be positive, got {spec!r}")
    return min(budget, expert_bytes)


def format_bytes(n: float) -> str:
    if abs(n) < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}"
