"""`load()`: an mlx-lm (model, tokenizer) pair whose experts stream from disk."""

from __future__ import annotations

import gc
import hashlib
import math
import numbers
import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load as mlx_lm_load

from .budget import available_memory_bytes
from .errors import ModelError
from .hub import check_tokenizer, resolve_model_path
from .mlx_backend import MLXBackend, attach, plan_model
from .plan import ModelPlan
from .policies import DEFAULT_POLICY
from .profiles import Profile
from .pipeline import Opened, load_streamed
from .runtime import Runtime, check_options, check_tokens
from .session import as_profile, runtime_of
from .stats import hit_rate
from .store import ExpertStore


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
    try:
        model, tokenizer, config = mlx_lm_load(str(path), lazy=True, return_config=True)
    except (ValueError, KeyError, TypeError, AttributeError, FileNotFoundError,
            RuntimeError) as e:
        # TypeError / AttributeError: a config.json lacking fields or not an object;
        # RuntimeError: MLX's, of a tensor in a dtype it cannot load (F64, F8_E5M2)
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
    `budget`, and the hosts exchange each MoE layer's outputs (see `mlx_backend.HostExperts`);
    an exchange waiting longer than `timeout_seconds` ends the process with an error.
    """
    check_options(policy, prewarm_share, pin_share, window_tokens)
    if distributed and not (isinstance(timeout_seconds, numbers.Real)
                            and 0 < timeout_seconds < math.inf):
        raise ValueError(f"timeout_seconds must be a positive number, got {timeout_seconds!r}")
    group = _host_group() if distributed else None
    if group is not None and (profile is not None or prefetch or per_layer):
        raise ValueError("distributed loads take no profile, prefetch or per-layer split yet")
    host = (group.rank(), group.size()) if group is not None else (0, 1)
    loader = MLXLoader(drop_page_cache, group, timeout_seconds)
    with gc_paused():
        try:  # with other hosts, each ends its load in `_join`, failed or not
            path = resolve_model_path(model, revision)
            load_streamed(loader, path, budget, policy,
                          None if profile is None else as_profile(profile),
                          prewarm_share=prewarm_share, pin_share=pin_share,
                          per_layer=per_layer, prefetch=prefetch,
                          window_tokens=window_tokens, progress=progress, host=host)
        except Exception as e:
            if group is None:
                raise
            _join(group, None, e)
        if group is not None:
            _join(group, loader.digest)
        return loader.model, loader.tokenizer


class MLXLoader:
    """MLX's steps of a load (`pipeline.load_streamed`): an mlx-lm model built lazily, its
    experts modules swapped for streamed ones (`mlx_backend.attach`).

    Args:
        group: the hosts of a distributed load, each serving its share of every layer's
            experts; their checkpoints are compared once loaded (`digest`).
        timeout_seconds: how long an exchange between hosts may wait.
    """

    def __init__(self, drop_page_cache: bool, group=None, timeout_seconds: float = 120.0):
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
            self.digest = _checkpoint_digest(self.path, runtime.store)


@contextmanager
def gc_paused() -> Iterator[None]:
    """Building a model makes tens of thousands of long-lived objects (modules, lazy arrays,
    the tensor index), and the cyclic collector, triggered by those very allocations, walks
    them again and again: 30% of the load of a model of 24k experts. None of it is garbage."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# the files besides the weights that mlx-lm and the tokenizers read
CHECKPOINT_TEXTS = {".json", ".jinja", ".model", ".txt", ".tiktoken", ".py"}


def _checkpoint_digest(path: Path, store: ExpertStore) -> bytes:
    """What every host must have alike: the weights (`ExpertStore.fingerprint`), and the
    config and tokenizer files, which shape the computation and the tokens each host feeds."""
    digest = hashlib.sha256(store.fingerprint())
    for file in sorted(path.iterdir()):
        if file.suffix in CHECKPOINT_TEXTS and file.is_file():
            digest.update(file.name.encode() + b"\0" + file.read_bytes())
    return digest.digest()


def _join(group, digest: bytes | None, error: Exception | None = None) -> None:
    """Every host's load ends here, together (a collective: a slow load does not count
    against another host's exchange timeout). A host that failed raises its error, the others
    name it; hosts whose checkpoints differ (`_checkpoint_digest`) refuse to run: the sum of
    their experts' outputs would be another model's. Returns on every host or none, each
    seeding MLX's random generator with host 0's seed: hosts that sample (`temp` above 0)
    feed the same token, as their outputs' sum needs."""
    mine = np.zeros(10, np.int32)  # loaded, the digest's 32 bytes, then host 0's seed
    if error is None:
        mine[0], mine[1:9] = 1, np.frombuffer(digest, np.int32)
        if group.rank() == 0:
            mine[9] = int.from_bytes(os.urandom(3), "big")
    hosts = mx.distributed.all_gather(mx.array(mine), group=group)
    try:
        mx.eval(hosts)  # see `host_stats`
    except RuntimeError as lost:  # a host ended during its load (Ctrl-C, killed)
        if error is None:
            raise ModelError(f"a host ended before every host had loaded the model ({lost})"
                             ) from None
    if error is not None:
        raise error
    hosts = np.array(hosts).reshape(-1, 10)
    failed = [str(h) for h in range(len(hosts)) if not hosts[h, 0]]
    if failed:
        raise ModelError(f"host {', '.join(failed)} could not load the model (its error is in "
                         "its output)")
    other = [str(h) for h in range(len(hosts)) if (hosts[h, :9] != hosts[0, :9]).any()]
    if other:
        raise ModelError(f"host {', '.join(other)} has another checkpoint than host 0 (its "
                         "weights, config or tokenizer files differ): every host needs the "
                         "same model")
    mx.random.seed(int(hosts[0, 9]))


def _host_group():
    """This process's group of hosts; an error unless `mlx.launch` started two or more."""
    group = mx.distributed.init()
    if group.size() < 2:
        raise ValueError("distributed=True needs two or more processes started by mlx.launch "
                         "(e.g. mlx.launch --backend ring -n 2 script.py)")
    return group


HOST_COUNTERS = ("tokens", "hits", "misses", "loads", "evictions", "bytes_read")


def host_stats(model: nn.Module) -> dict:
    """Every host's statistics and their sums, on every host: a collective call, so every
    host must make it (as they make every forward call)."""
    runtime = runtime_of(model)
    mine = runtime.stats_dict()
    hosts = mx.distributed.all_gather(mx.array([int(mine[k]) for k in HOST_COUNTERS], mx.int64))
    with runtime.backend.watchdog:  # evaluated first: `np.array` of a collective a lost host made
        mx.eval(hosts)  # fail returns what it holds (zeros), where `mx.eval` raises
    rows = np.array(hosts).reshape(runtime.host[1], len(HOST_COUNTERS)).tolist()
    per_host = [dict(zip(HOST_COUNTERS, row)) for row in rows]
    total = {k: sum(h[k] for h in per_host) for k in HOST_COUNTERS[1:]}
    total["tokens"] = per_host[0]["tokens"]
    for counts in (*per_host, total):
        counts["hit_rate"] = hit_rate(counts["hits"], counts["misses"])
    return {"hosts": per_host, "combined": total}


def run_text(model: nn.Module, tokenizer: TokenizerWrapper, text: str,
             window_tokens: int = 256) -> int:
    """Run `text` through the model in windows (no generation), so the session's routing
    statistics and profile describe that text; returns the number of tokens."""
    check_tokens(window_tokens, "window_tokens")
    ids = tokenizer.encode(text)
    for start in range(0, len(ids), window_tokens):
        mx.eval(model(mx.array([ids[start : start + window_tokens]])))
    return len(ids)
