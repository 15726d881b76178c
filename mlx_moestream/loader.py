"""`load()`: an mlx-lm (model, tokenizer) pair whose experts stream from disk."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load as mlx_lm_load

from .budget import available_memory_bytes, resolve_budget
from .store import ExpertStore
from .streaming import ModelPlan, Runtime, plan_model

# Files a model needs; the hub may hold much more (other formats, originals).
HUB_PATTERNS = ["*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken",
                "*.txt", "*.jinja"]


class ModelError(ValueError):
    """A model that cannot be found, read by mlx-lm, or streamed."""


def resolve_model_path(model: str | Path, revision: str | None = None) -> Path:
    """A local model directory, or a Hugging Face repo id resolved through the local cache/hub."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ModelError(f"{path} is a file; give the model's directory")
    try:
        return Path(snapshot_download(str(model), revision=revision, allow_patterns=HUB_PATTERNS))
    except (LocalEntryNotFoundError, HfHubHTTPError, HFValidationError, OSError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelError(
            f"'{model}' is not a local directory and could not be resolved on the Hugging Face "
            f"hub or its local cache: {reason}"
        ) from None


def load_lazy(path: Path) -> tuple[nn.Module, TokenizerWrapper, dict, ExpertStore, ModelPlan]:
    """Index the files, then build the model without reading any weight."""
    store = ExpertStore(path)
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
    model: str | Path,
    budget: int | str | None = None,
    policy: str = "lru",
    *,
    revision: str | None = None,
    window_tokens: int = 32,
) -> tuple[nn.Module, TokenizerWrapper]:
    """Load an MoE model for `mlx_lm.generate` / `stream_generate`, streaming its experts.

    `budget` bounds resident expert bytes: bytes, `"8GB"`, `"512MiB"`, `"35%"` of all expert
    bytes, or `"auto"` (the default: everything that fits in free memory after the dense
    weights and a working reserve).
    """
    path = resolve_model_path(model, revision)
    lazy_model, tokenizer, _, store, plan = load_lazy(path)
    budget_bytes = resolve_budget(
        "auto" if budget is None else budget, plan.expert_bytes, plan.dense_bytes, memory_bytes()
    )
    runtime = Runtime(plan, store, budget_bytes, policy, window_tokens)
    runtime.attach(lazy_model)
    mx.eval(lazy_model.parameters())  # the dense weights; experts are no longer in the tree
    return lazy_model, tokenizer


def runtime_of(model: nn.Module) -> Runtime:
    runtime = getattr(model, "moestream", None)
    if runtime is None:
        raise ValueError("this model was not loaded by mlx_moestream.load()")
    return runtime


def stats(model: nn.Module) -> dict:
    """Cache statistics in total and per MoE layer (see `Stats`), plus budget and residency."""
    return runtime_of(model).stats_dict()
