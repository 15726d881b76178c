"""`load()`: an mlx-lm (model, tokenizer) pair whose experts stream from disk."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load as mlx_lm_load

from .budget import available_memory_bytes, resolve_budget
from .policies import DEFAULT_POLICY, make_policy
from .profiles import Profile
from .profiles import find as find_profile
from .profiles import save_target as profile_target
from .trace import Trace, TraceRecorder
from .mlx_backend import MLXSlotPool, attach, plan_model
from .plan import ModelPlan
from .runtime import Runtime
from .store import ExpertStore

# Files a model needs; the hub may hold much more (other formats, originals).
HUB_PATTERNS = ["*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken",
                "*.txt", "*.jinja"]


# A small trained bilingual (Italian/English) + Python MoE shipped with the package.
EMBEDDED_MODEL = Path(__file__).parent / "assets" / "embedded"


class ModelError(ValueError):
    """A model that cannot be found, read by mlx-lm, or streamed."""


def resolve_model_path(model: str | Path | None, revision: str | None = None) -> Path:
    """A local model directory, a Hugging Face repo id resolved through the local cache/hub, or
    None / "embedded" for the model shipped with the package."""
    if model is None or model == "embedded":
        if not (EMBEDDED_MODEL / "config.json").exists():
            raise ModelError(f"the embedded model is missing from {EMBEDDED_MODEL}")
        return EMBEDDED_MODEL
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ModelError(f"{path} is a file; give the model's directory")
    text = str(model)
    if isinstance(model, Path) or text.startswith(("/", ".", "~")) or text.count("/") > 1:
        raise ModelError(f"no such directory: {path} (a Hugging Face repo id is NAME or "
                         f"OWNER/NAME)")
    try:
        return Path(snapshot_download(str(model), revision=revision, allow_patterns=HUB_PATTERNS))
    except (LocalEntryNotFoundError, HfHubHTTPError, HFValidationError, OSError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelError(
            f"'{model}' is not a local directory and could not be resolved on the Hugging Face "
            f"hub or its local cache: {reason}"
        ) from None


def load_lazy(path: Path, drop_page_cache: bool = True, repacked: bool | None = None
              ) -> tuple[nn.Module, TokenizerWrapper, dict, ExpertStore, ModelPlan]:
    """Index the files, then build the model without reading any weight (`repacked`: see
    `ExpertStore`)."""
    store = ExpertStore(path, drop_page_cache, repacked)
    try:
        model, tokenizer, config = mlx_lm_load(str(path), lazy=True, return_config=True)
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise ModelError(f"{path}: mlx-lm cannot load this model: {e}") from None
    try:
        plan = plan_model(model, config)
    except ValueError as e:
        raise ModelError(f"{path}: {e}") from None
    return model, tokenizer, config, store, plan


def memory_bytes() -> int:
    """Memory MLX may use: the GPU working-set limit on Apple silicon, else what the OS has free."""
    info = mx.device_info()
    limit = info.get("max_recommended_working_set_size")
    return min(limit, available_memory_bytes()) if limit else available_memory_bytes()


def load(
    model: str | Path | None = None,
    budget: int | str | None = None,
    policy: str = DEFAULT_POLICY,
    profile: str | Path | Profile | None = None,
    *,
    prewarm_share: float = 1.0,
    pin_share: float = 0.0,
    per_layer: bool = False,
    prefetch: bool = False,
    drop_page_cache: bool = True,
    progress: Callable | None = None,
    revision: str | None = None,
    window_tokens: int = 32,
) -> tuple[nn.Module, TokenizerWrapper]:
    """Load an MoE model for `mlx_lm.generate` / `stream_generate`, streaming its experts.

    `model`: a local directory, a Hugging Face repo id, or None / "embedded" for the small
    bilingual model shipped with the package.
    `budget` bounds resident expert bytes: bytes, `"8GB"`, `"512MiB"`, `"35%"` of all expert
    bytes, or `"auto"` (the default: everything that fits in free memory after the dense
    weights and a working reserve). `profile` (a name, a path or a `Profile`) pre-warms the
    hottest experts of a saved workload into `prewarm_share` of the budget and pins the hottest
    `pin_share` for good. `per_layer` splits the budget per layer (by the profile's per-layer
    working set when one is given, else evenly) instead of sharing it across layers.
    `prefetch` predicts each next layer's experts with its router and reads them while the
    current layer computes (outputs never change: routing is always the real router's).
    `drop_page_cache` keeps the OS from caching expert reads on top of the budget. `policy` is a
    name from `policies.POLICIES`, with options as `NAME:OPTION=VALUE,...` (`wlfu:half_life=128`).
    `progress(items, label)`, a context manager, may wrap the reads at load (a progress bar):
    the pre-warm's, or every expert's when the budget holds them all.
    """
    make_policy(policy, capacity=1, num_keys=1)  # a bad name, option or value fails before any read
    path = resolve_model_path(model, revision)
    lazy_model, tokenizer, _, store, plan = load_lazy(path, drop_page_cache)
    budget_bytes = resolve_budget(
        "auto" if budget is None else budget, plan.expert_bytes, plan.dense_bytes, memory_bytes()
    )
    if profile is not None:
        profile = _as_profile(profile)
        profile.check_model(plan.identity)
    weights = profile.working_set() if per_layer and profile is not None else None
    runtime = Runtime(plan, store, budget_bytes, MLXSlotPool, policy, window_tokens, per_layer,
                      weights)
    attach(runtime, lazy_model, prefetch, progress)
    mx.eval(lazy_model.parameters())  # the dense weights; experts are no longer in the tree
    if profile is not None:
        runtime.prewarm(profile, prewarm_share, pin_share, progress)
    return lazy_model, tokenizer


def _as_profile(profile: str | Path | Profile) -> Profile:
    return profile if isinstance(profile, Profile) else Profile.load(find_profile(str(profile)))


def prewarm(model: nn.Module, profile: str | Path | Profile, share: float = 1.0,
            pin_share: float = 0.0, progress: Callable | None = None) -> dict:
    """Load a profile's hottest experts into `share` of the budget, pin the hottest `pin_share`
    and seed the policy with its counts. `progress(items, label)` may wrap the loads."""
    return runtime_of(model).prewarm(_as_profile(profile), share, pin_share, progress)


def profile(model: nn.Module, workload: str) -> Profile:
    """This session's activation profile so far (what `save_profile` writes)."""
    return runtime_of(model).profile(workload)


def save_profile(model: nn.Module, name: str | Path, workload: str | None = None) -> Path:
    """Save this session's activation profile as NAME (in ./profiles or the user directory) or
    a path (see `profiles.save_target`)."""
    return profile(model, workload or Path(name).stem).save(profile_target(name))


def run_text(model: nn.Module, tokenizer: TokenizerWrapper, text: str,
             window_tokens: int = 256) -> int:
    """Run `text` through the model in windows (no generation), so the session's routing
    statistics and profile describe that text; returns the number of tokens."""
    ids = tokenizer.encode(text)
    for start in range(0, len(ids), window_tokens):
        mx.eval(model(mx.array([ids[start : start + window_tokens]])))
    return len(ids)


def start_trace(model: nn.Module) -> None:
    """Record the routing of every following forward call (see `save_trace`)."""
    runtime = runtime_of(model)
    runtime.count_deferred()
    runtime.recorder = TraceRecorder(runtime.plan.num_layers, runtime.plan.num_experts)


def save_trace(model: nn.Module, path: str | Path) -> Trace:
    """Write the routing recorded since `start_trace` as a .npz trace (atomically)."""
    runtime = runtime_of(model)
    runtime.count_deferred()
    recorder = runtime.recorder
    if recorder is None:
        raise ValueError("no trace is being recorded: call start_trace(model) first")
    trace = recorder.to_trace()
    trace.save(path)
    return trace


def runtime_of(model: nn.Module) -> Runtime:
    runtime = getattr(model, "moestream", None)
    if runtime is None:
        raise ValueError("this model was not loaded by mlx_moestream.load()")
    return runtime


def stats(model: nn.Module) -> dict:
    """Cache statistics in total and per MoE layer (see `Stats`), plus budget and residency."""
    return runtime_of(model).stats_dict()
