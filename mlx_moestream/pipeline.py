"""One load for every backend: open -> plan -> budget -> runtime -> attach -> pre-warm.

A backend's `ModelLoader` opens the model (its dense part, the tensor index, the plan of its
expert layers, no expert read) and attaches the runtime to it; everything between, and the
pre-warm after, is the same for MLX, torch and each host of a distributed load.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Protocol

from .backend import Backend
from .budget import resolve_budget
from .plan import ModelPlan
from .pools import minimum_budget
from .profiles import Profile
from .runtime import Runtime
from .store import ExpertStore


@dataclass
class Opened:
    """A model a backend opened, none of its experts read yet.

    Args:
        memory_bytes: the memory free for `auto` budgets, measured before the dense weights
            loaded (they count against it).
        whole_calls: the backend computes a call at once: every expert of a layer must fit.
    """

    plan: ModelPlan
    store: ExpertStore
    backend: Backend
    memory_bytes: int
    whole_calls: bool = False


class ModelLoader(Protocol):
    """A backend's two steps of a load."""

    def open(self, path: Path) -> Opened:
        """Build the model without its experts; on an error, close what it opened."""

    def attach(self, runtime: Runtime, prefetch: bool, progress: Callable | None) -> None:
        """Make the model's expert modules compute from the runtime's pools, reading every
        expert now when each has a slot of its own."""


def load_streamed(loader: ModelLoader, path: Path, budget: int | str | None, policy: str,
                  profile: Profile | None, *, prewarm_share: float, pin_share: float,
                  per_layer: bool, prefetch: bool, window_tokens: int,
                  progress: Callable | None, host: tuple[int, int] = (0, 1)) -> Runtime:
    """Open the model at `path`, size its budget, start its runtime and attach it; then
    pre-warm from `profile`. The options are those of `mlx_moestream.load`."""
    opened = loader.open(path)
    plan = opened.plan
    try:
        if profile is not None:
            profile.check_model(plan.identity)
        minimum = minimum_budget(plan, opened.whole_calls, per_layer)
        budget_bytes = resolve_budget("auto" if budget is None else budget, plan.expert_bytes,
                                      plan.dense_bytes, opened.memory_bytes, minimum)
        weights = profile.working_set() if per_layer and profile is not None else None
        runtime = Runtime(plan, opened.store, budget_bytes, opened.backend, policy,
                          window_tokens, per_layer, weights, whole_calls=opened.whole_calls,
                          host=host)
    except BaseException:
        opened.store.close()
        raise
    loader.attach(runtime, prefetch, progress)
    if prefetch:
        runtime.enable_prefetch()
    runtime.store.loaded()  # after every read of the load: it drops them from the page cache
    if profile is not None:
        runtime.prewarm(profile, prewarm_share, pin_share, progress)
    return runtime


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic collector while long-lived objects are made (a model's modules, lazy
    arrays and tensor index; the modules a backend imports). Their allocations trigger
    collections that walk them again and again: 30% of the load of a model of 24k experts.
    None of it is garbage."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
