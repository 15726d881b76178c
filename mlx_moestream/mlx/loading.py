"""`load()`: an mlx-lm (model, tokenizer) pair whose experts stream from disk."""

from __future__ import annotations

import math
import numbers
import re
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from huggingface_hub.errors import StrictDataclassError
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load as mlx_lm_load

from ..budget import available_memory_bytes
from ..errors import ModelError
from ..files import read_json
from ..hub import check_tokenizer, resolve_model_path
from ..pipeline import Opened, gc_paused, load_streamed
from ..plan import ModelPlan, check_layer_count
from ..policies import DEFAULT_POLICY
from ..profiles import Profile
from ..runtime import Runtime, check_options, check_tokens
from ..session import as_profile
from ..store import ExpertStore
from .attach import attach
from .hosts import checkpoint_digest, host_group, join_hosts
from .model import plan_model
from .pools import MLXBackend


def _cannot_load(path: Path, e: Exception) -> ModelError:
    """mlx-lm's error on one line, its list of tensors cut short (a real model's names
    hundreds), saying where transformers' fused expert tensors can be read instead."""
    text = " ".join(str(e).split())
    if len(text) > 300:
        text = text[:300] + " ..."
    if re.search(r"experts\.gate_up_proj\b", str(e)):
        text += ("; its experts are in transformers' fused layout (experts.gate_up_proj), which "
                 "mlx-lm does not read: load it with the torch backend "
                 "(mlx_moestream.torch.load, chat --backend torch)")
    return ModelError(f"{path}: mlx-lm cannot load this model: {text}")


def load_lazy(path: Path, drop_page_cache: bool = True, repacked: bool | None = None
              ) -> tuple[nn.Module, TokenizerWrapper, dict, ExpertStore, ModelPlan]:
    """Index the files, then build the model without reading any weight (`repacked`: see
    `ExpertStore`)."""
    store = ExpertStore(path, drop_page_cache, repacked)
    config = read_json(path / "config.json", "unreadable config", ModelError)
    if isinstance(config, dict):  # (else mlx-lm says what is wrong)
        try:
            check_layer_count(config, len(store.tensors))
        except ValueError as e:
            raise ModelError(f"{path}: {e}") from None
    try:
        model, tokenizer, config = mlx_lm_load(str(path), lazy=True, return_config=True)
    except (ValueError, KeyError, TypeError, AttributeError, FileNotFoundError,
            RuntimeError, StrictDataclassError) as e:
        # TypeError / AttributeError: a config.json lacking fields or not an object;
        # RuntimeError: MLX's, of a tensor in a dtype it cannot load (F64, F8_E5M2);
        # StrictDataclassError: transformers', of a field of the wrong type (a top-k of 2.5)
        raise _cannot_load(path, e) from None
    try:
        plan = plan_model(model, config)
    except ValueError as e:
        raise ModelError(f"{path}: {e}") from None
    return model, tokenizer, config, store, plan


def memory_bytes() -> int:
    """Memory MLX may use: what the OS has free (`available_memory_bytes`), within the GPU
    working-set limit on Apple silicon."""
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
    distributed: bool = False,
    timeout_seconds: float = 120.0,
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
    `distributed`, in a program started by `mlx.launch`, divides every layer's experts among
    the hosts (contiguous ranges; dense weights replicated): each streams its own under its own
    `budget`, and the hosts exchange each MoE layer's outputs (see `mlx.hosts.HostExperts`);
    an exchange waiting longer than `timeout_seconds` ends the process with an error.
    """
    check_options(policy, prewarm_share, pin_share, window_tokens)
    if distributed and not (isinstance(timeout_seconds, numbers.Real)
                            and 0 < timeout_seconds < math.inf):
        raise ValueError(f"timeout_seconds must be a positive number, got {timeout_seconds!r}")
    group = host_group() if distributed else None
    if group is not None and (profile is not None or prefetch or per_layer):
        raise ValueError("distributed loads take no profile, prefetch or per-layer split yet")
    host = (group.rank(), group.size()) if group is not None else (0, 1)
    loader = MLXLoader(drop_page_cache, group, timeout_seconds)
    with gc_paused():
        try:  # with other hosts, each ends its load in `join_hosts`, failed or not
            path = resolve_model_path(model, revision)
            load_streamed(loader, path, budget, policy,
                          None if profile is None else as_profile(profile),
                          prewarm_share=prewarm_share, pin_share=pin_share,
                          per_layer=per_layer, prefetch=prefetch,
                          window_tokens=window_tokens, progress=progress, host=host)
        except Exception as e:
            if group is None:
                raise
            join_hosts(group, None, e)
        if group is not None:
            join_hosts(group, loader.digest)
        return loader.model, loader.tokenizer


class MLXLoader:
    """MLX's steps of a load (`pipeline.load_streamed`): an mlx-lm model built lazily, its
    experts modules swapped for streamed ones (`mlx.attach`).

    Args:
        group: the hosts of a distributed load, each serving its share of every layer's
            experts; their checkpoints are compared once loaded (`digest`).
        timeout_seconds: how long an exchange between hosts may wait.
    """

    def __init__(self, drop_page_cache: bool, group: mx.distributed.Group | None = None,
                 timeout_seconds: float = 120.0):
        self.drop_page_cache, self.group, self.timeout_seconds = (drop_page_cache, group,
                                                                  timeout_seconds)
        self.path: Path | None = None
        self.model: nn.Module | None = None
        self.tokenizer: TokenizerWrapper | None = None
        self.digest: bytes | None = None

    def open(self, path: Path) -> Opened:
        self.path = path
        self.model, self.tokenizer, _, store, plan = load_lazy(path, self.drop_page_cache)
        check_tokenizer(path, self.tokenizer)  # inspect and repack need none
        if self.group is not None:
            try:
                plan = plan.host_share(self.group.rank(), self.group.size())
            except ValueError as e:
                raise ModelError(f"{path}: {e}") from None
        timeout = self.timeout_seconds if self.group is not None else None
        return Opened(plan, store, MLXBackend(timeout), memory_bytes())

    def attach(self, runtime: Runtime, prefetch: bool, progress: Callable | None) -> None:
        attach(runtime, self.model, prefetch, progress, self.group)
        mx.eval(self.model.parameters())  # the dense weights; experts left the tree
        if self.group is not None:  # before the load drops the files' pages
            self.digest = checkpoint_digest(self.path, runtime.store)


def run_text(model: nn.Module, tokenizer: TokenizerWrapper, text: str,
             window_tokens: int = 256) -> int:
    """Run `text` through the model in windows (no generation), so the session's routing
    statistics and profile describe that text; returns the number of tokens."""
    check_tokens(window_tokens, "window_tokens")
    ids = tokenizer.encode(text)
    for start in range(0, len(ids), window_tokens):
        mx.eval(model(mx.array([ids[start : start + window_tokens]])))
    return len(ids)
