"""The torch backend's load: a transformers model whose experts stream, and its plan."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from ..budget import available_memory_bytes
from ..errors import ModelError
from ..hub import check_tokenizer, resolve_model_path
from ..pipeline import Opened, load_streamed
from ..plan import ModelPlan
from ..policies import DEFAULT_POLICY
from ..profiles import Profile
from ..runtime import Runtime, check_options
from ..session import as_profile
from .build import _build
from .forward import _router, _stream
from .guards import (_compile_every_layer, _refuse_converting, _refuse_loading_experts,
                     _refuse_saving)
from .layout import _targets
from .pools import DeviceSlots, ExpertRows

# Devices whose experts live in `[E, ...]` rows by expert id (`ExpertRows`); on the others they
# live in slot pools (`DeviceSlots`).
ROW_DEVICES = ("cpu",)


def load(model: str | Path, budget: int | str | None = None, *, device: str = "cpu",
         policy: str = DEFAULT_POLICY, profile: str | Path | Profile | None = None,
         prewarm_share: float = 1.0, pin_share: float = 0.0, per_layer: bool = False,
         prefetch: bool = False, drop_page_cache: bool = True, revision: str | None = None,
         window_tokens: int = 32, progress: Callable | None = None,
         experts_implementation: str | None = None
         ) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    """Load a transformers MoE model whose experts stream from its safetensors under `budget`;
    returns (model, tokenizer), the model's `generate()` unchanged. `budget`, `policy`,
    `profile`, `prewarm_share`, `pin_share`, `per_layer` and `prefetch` are those of
    `mlx_moestream.load`, within this backend's rule that every call fits at once: pins leave
    room for a whole layer, and a per-layer split must give each layer all its experts.
    `experts_implementation` is transformers' (default: its own choice). On `device="cuda"`
    (or "cuda:N") the budget is GPU memory for experts, `auto` sized from the GPU's free
    memory; the model's inputs go to that device, as for any transformers model on it."""
    device = _device(device)
    check_options(policy, prewarm_share, pin_share, window_tokens)
    path = _model_path(model, revision)
    loader = TorchLoader(device, drop_page_cache, experts_implementation)
    load_streamed(loader, path, budget, policy, None if profile is None else as_profile(profile),
                  prewarm_share=prewarm_share, pin_share=pin_share, per_layer=per_layer,
                  prefetch=prefetch, window_tokens=window_tokens, progress=progress)
    return loader.model, loader.tokenizer


class TorchLoader:
    """torch's steps of a load (`pipeline.load_streamed`): a transformers model rebuilt with
    its dense weights only, its experts modules made to stream (`_stream`) and guarded."""

    def __init__(self, device: torch.device, drop_page_cache: bool,
                 experts_implementation: str | None):
        self.device, self.drop_page_cache = device, drop_page_cache
        self.experts_implementation = experts_implementation
        self.rows = device.type in ROW_DEVICES  # experts placed by id, in rows
        self.model: torch.nn.Module | None = None
        self.tokenizer = None

    def open(self, path: Path) -> Opened:
        device = self.device
        # before the dense weights load: `auto` counts them
        memory = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else \
            available_memory_bytes()
        lm, store, experts, plan = _build(path, self.drop_page_cache,
                                          self.experts_implementation, self.rows)
        try:  # before any expert is read
            self.tokenizer = _tokenizer(path)
        except ModelError:
            store.close()
            raise
        # generate()'s defaults (eos ids, sampling) from generation_config.json, as from_pretrained
        lm.adjust_generation_fn(None, True, False, str(path), cache_dir=None,
                                force_download=False, proxies=None, local_files_only=True,
                                token=None, revision=None, subfolder="",
                                trust_remote_code=False)
        self.model, self.experts = lm, experts
        self.modules = dict(lm.named_modules())
        layers = [(self.modules[e.module], e, _targets(self.modules[e.module], e, layer.specs))
                  for e, layer in zip(experts, plan.layers)]
        self.placed = ExpertRows(layers, store) if self.rows else DeviceSlots(layers, device)
        return Opened(plan, store, self.placed, memory, whole_calls=True)

    def attach(self, runtime: Runtime, prefetch: bool, progress: Callable | None) -> None:
        lm, experts, modules = self.model, self.experts, self.modules
        if not self.rows:
            self.placed.attach(runtime)
            lm.to(self.device)  # the dense weights; the experts are in the slot pools already
        for i, e in enumerate(experts):
            nxt = experts[i + 1] if prefetch and i + 1 < len(experts) else None
            router = nxt and _router(modules[nxt.module.rsplit(".", 1)[0]],
                                     runtime.plan.num_experts)
            _stream(modules[e.module], i, runtime, router, None if self.rows else self.placed)
        lm.moestream = runtime
        lm.save_pretrained = _refuse_saving
        streamed = [modules[e.module] for e in experts]
        _refuse_converting(lm, streamed)
        _compile_every_layer(len(experts))
        # with every expert in its row for good, none is read again: a load into them lasts
        if not (runtime.residency.holds_all and self.rows):
            _refuse_loading_experts(lm, streamed)
        if runtime.residency.holds_all:
            runtime.read_all(progress)


def _tokenizer(path: Path):
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ModelError(f"{path}: transformers cannot load its tokenizer: {e}") from None
    check_tokenizer(path, tokenizer)
    return tokenizer


def _device(name: str | torch.device) -> torch.device:
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):  # no such device; not a device name (None, 1.5)
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"device '{name}': the torch backend streams on cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device '{name}': this torch sees no CUDA device")
    return device


def plan_of(model: str | Path, revision: str | None = None, device: str = "cpu") -> ModelPlan:
    """The plan `load` makes of this model for `device` (its dense weights are loaded on the
    CPU to measure them)."""
    rows = _device(device).type in ROW_DEVICES
    return _build(_model_path(model, revision), False, None, rows)[3]


def _model_path(model: str | Path | None, revision: str | None) -> Path:
    if model is None or model == "embedded":  # the package's model, which is an MLX one
        raise ModelError("the torch backend needs a transformers model: the embedded model "
                         "is an MLX model")
    return resolve_model_path(model, revision)


def min_budget_bytes(model: str | Path, revision: str | None = None, device: str = "cpu") -> int:
    """The smallest budget `load` takes for this model on `device`: every expert of one
    layer (on the CPU, with the pages its rows share)."""
    return plan_of(model, revision, device).budget_holding()
