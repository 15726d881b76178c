"""What a streamed model offers, whichever backend loaded it: statistics, profiles, traces."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from .profiles import Profile
from .profiles import find as find_profile
from .profiles import save_target as profile_target
from .runtime import Runtime
from .trace import Trace, TraceRecorder


def as_profile(profile: str | Path | Profile) -> Profile:
    """A profile given by name, path or as itself: a `Path` is a path, whatever its suffix
    (as `save_profile` takes it)."""
    if isinstance(profile, Profile):
        return profile
    return Profile.load(profile if isinstance(profile, Path) else find_profile(str(profile)))


def prewarm(model: Any, profile: str | Path | Profile, share: float = 1.0,
            pin_share: float = 0.0, progress: Callable | None = None) -> dict:
    """Load a profile's hottest experts into the free slots, up to `share` of the budget (a
    pool filled by a session has none: the seeded counts then act as the policy evicts), pin
    the hottest `pin_share` (those resident already as they are, the others once read into a
    free slot), and seed the policy with its counts. `stats()["prewarm"]`
    describes the latest pre-warm. `progress(items, label)` may wrap the loads."""
    return _single_host(model, "pre-warm from a profile").prewarm(as_profile(profile), share,
                                                                 pin_share, progress)


def profile(model: Any, workload: str) -> Profile:
    """This session's activation profile so far (what `save_profile` writes)."""
    runtime = _single_host(model, "record a profile")
    with runtime.lock:  # copied before another thread's layer call may count more
        runtime.count_all()
        return Profile.of(runtime.stats, workload, runtime.plan.identity)


def save_profile(model: Any, name: str | Path, workload: str | None = None) -> Path:
    """Save this session's activation profile as NAME (in ./profiles or the user directory) or
    a path (see `profiles.save_target`). A session that routed no token has none: saved, it
    would replace an earlier profile of that name with an empty one."""
    recorded = profile(model, workload or Path(name).stem)
    if not recorded.tokens:
        raise ValueError("no token was routed in this session: there is no profile to save")
    return recorded.save(profile_target(name))


def start_trace(model: Any) -> None:
    """Record the routing of every following forward call (see `save_trace`)."""
    runtime = _single_host(model, "record a trace")
    with runtime.lock:  # calls counted late (another thread's latest, all resident) stay out
        runtime.count_all()
        runtime.backend.begin_trace()
        runtime.recorder = TraceRecorder(runtime.plan.num_layers, runtime.plan.num_experts)


def save_trace(model: Any, path: str | Path) -> Trace:
    """Write the routing recorded since `start_trace` as a .npz trace (atomically)."""
    runtime = runtime_of(model)
    runtime.count_all()
    recorder = runtime.recorder
    if recorder is None:
        raise ValueError("no trace is being recorded: call start_trace(model) first")
    trace = recorder.to_trace()
    trace.save(path)
    return trace


def runtime_of(model: Any) -> Runtime:
    runtime = getattr(model, "moestream", None)
    if runtime is None:
        raise ValueError("this model was not loaded by mlx_moestream.load()")
    return runtime


def _single_host(model: Any, what: str) -> Runtime:
    """A host of a distributed run sees its own experts only, numbered from 0: its profile or
    trace would be another model's under this one's fingerprint."""
    runtime = runtime_of(model)
    if runtime.host[1] > 1:
        raise ValueError(f"cannot {what} on a distributed model yet (each host holds only its "
                         f"share of the experts)")
    return runtime


def stats(model: Any) -> dict:
    """Cache statistics in total and per MoE layer (see `Stats`), plus budget and residency."""
    return runtime_of(model).stats_dict()
