"""The torch backend: transformers MoE models whose experts stream from the checkpoint.

`load()` builds the transformers model without touching its weights' memory (transformers'
`no_init_weights`), copies in the dense weights, and gives each fused experts module
(`@use_experts_implementation`: Qwen2/3-MoE, Mixtral, OLMoE, DeepSeek-V3, gpt-oss) `[E, ...]`
tensors over anonymous memory maps. Rows of resident experts are read from the store, an evicted
expert's pages go back to the OS (`MADV_DONTNEED`), untouched rows cost no memory. The module
then computes exactly as in the fully loaded model, on the same expert ids and the same bytes,
with whatever experts implementation the model uses (eager, grouped_mm, batched_mm): its
outputs are the same bit for bit. Before each call the runtime makes its routed experts
resident. A call is never split (that would change the implementation's sums), so the budget
must hold one layer's experts.

On a GPU (`device="cuda"`) the experts cannot stay indexed by id (that needs memory for all of
them), so each group of layers with one expert shape shares a `[slots, ...]` pool in device
memory (`DeviceSlots`), the routed ids are remapped to slots, and reads land in pinned host
buffers copied to their slots on a side stream the compute waits for. Measured on H100 and
H200 GPUs (`scripts/check_cuda.py`): grouped_mm and batched_mm compute each routed row alone,
so a plain remap is bit-exact; eager adds the experts' outputs in expert order, so its call
gets the used slots gathered in expert-id order (an order-preserving remap).
"""

from __future__ import annotations

import inspect
import json
import mmap
import queue
import re
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import partial
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers import initialization as init

from .backend import Backend, SlotPool
from .budget import available_memory_bytes
from .errors import BudgetError, ModelError, StoreError
from .hub import check_tokenizer, resolve_model_path
from .plan import ExpertLayer, ModelPlan, config_hash, path_key, read_config, top_k_of
from .policies import DEFAULT_POLICY
from .profiles import Profile
from .pipeline import Opened, load_streamed
from .runtime import Runtime, check_options
from .session import as_profile
from .store import ExpertStore

# safetensors dtype -> (torch dtype, its name in plans)
DTYPES = {"F32": (torch.float32, "float32"), "BF16": (torch.bfloat16, "bfloat16"),
          "F16": (torch.float16, "float16")}
# The per-expert checkpoint names of a fused gate_up row: gate first, then up.
GATE_UP = ("gate_proj", "up_proj")
# Devices whose experts live in `[E, ...]` rows by expert id (`ExpertRows`); on the others they
# live in slot pools (`DeviceSlots`).
ROW_DEVICES = ("cpu",)
# Experts implementations that compute each routed (token, expert) row on its own: on CUDA their
# outputs do not depend on where an expert's slot is (measured; on the CPU, batched_mm's only).
ROW_WISE = ("grouped_mm", "batched_mm")


def load(model: str | Path, budget: int | str | None = None, *, device: str = "cpu",
         policy: str = DEFAULT_POLICY, profile: str | Path | Profile | None = None,
         prewarm_share: float = 1.0, pin_share: float = 0.0, per_layer: bool = False,
         prefetch: bool = False, drop_page_cache: bool = True, revision: str | None = None,
         window_tokens: int = 32, progress: Callable | None = None,
         experts_implementation: str | None = None):
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
        if not (runtime.holds_all and self.rows):
            _refuse_loading_experts(lm, streamed)
        if runtime.holds_all:
            runtime.read_all(progress)


def _tokenizer(path: Path):
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ModelError(f"{path}: transformers cannot load its tokenizer: {e}") from None
    check_tokenizer(path, tokenizer)
    return tokenizer


def _refuse_saving(*args, **kwargs) -> None:
    """`save_pretrained`, and the state dict of an experts module (`state_dict`, `torch.save`)."""
    raise ModelError("a streamed model holds only its resident experts: saving it would write "
                     "the others as zeros; copy the checkpoint it was loaded from")


def _compile_every_layer(moe_layers: int) -> None:
    """Raise dynamo's recompile limits (never lower them) so that `torch.compile` compiles
    the model as a whole, as stock's: the code after each experts call (a graph break)
    compiles once per layer and shape, 3 times a layer in `generate`, and past the limit
    (8) the rest ran eagerly, its logits off stock compiled's by ~1e-7."""
    import torch._dynamo.config as dynamo

    dynamo.recompile_limit = max(dynamo.recompile_limit, 4 * moe_layers)
    dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit,
                                             8 * moe_layers)


def _refuse_converting(lm: torch.nn.Module, experts: list[torch.nn.Module]) -> None:
    """`model.to(dtype or device)`, `.half()` and the like, on the model or on a module holding
    experts, are refused before anything converts: they would copy every expert out of the
    memory reads land in, all at once whatever the budget (on a real model, out of memory
    before the next call could refuse the copies), and leave the model half converted."""
    kinds = {(param.dtype, param.device) for module in experts
             for _, param in _expert_params(module)}
    for module in [lm, *experts]:
        module._apply = partial(_guarded_apply, module._apply, kinds)


def _guarded_apply(apply: Callable, kinds: set[tuple[torch.dtype, torch.device]], fn: Callable,
                   *args, **kwargs):
    for dtype, device in kinds:  # what `fn` makes of an empty tensor like the experts'
        probe = fn(torch.empty(0, dtype=dtype, device=device))
        if probe.dtype != dtype or probe.device != device:
            raise ModelError(
                f"the streamed experts cannot be converted to {probe.dtype} on {probe.device} "
                f"(model.to, .half, ...): they are read in the checkpoint's dtype ({dtype}) to "
                f"the device they were loaded on ({device}); load the model on the device "
                f"wanted, and convert nothing")
    return apply(fn, *args, **kwargs)


def _refuse_loading_experts(lm: torch.nn.Module, experts: list[torch.nn.Module]) -> None:
    """`load_state_dict` of expert weights, from any module above them, before it copies
    anything: an evicted expert is read again from the checkpoint (and on a GPU they compute
    from the slot pools), so the new weights would not last and the model would mix them
    with the checkpoint's. (A partial of a named function: pickling the model must reach the
    runtime, which refuses clearly, not fail on a local function.)"""
    streamed = frozenset(id(p) for module in experts for _, p in _expert_params(module))
    for module in lm.modules():
        if any(id(p) in streamed for p in module.parameters()):
            module.register_load_state_dict_pre_hook(partial(_refuse_loading, streamed))


def _refuse_loading(streamed: frozenset[int], module: torch.nn.Module, state_dict: dict,
                    prefix: str, *args) -> None:
    for name, param in module.named_parameters():
        if id(param) in streamed and prefix + name in state_dict:
            raise ModelError(
                f"{prefix + name}: weights loaded into a streamed model's experts would not "
                f"last (evicted experts are read again from the checkpoint): save them as a "
                f"checkpoint and load that, or load on the CPU with a budget that holds every "
                f"expert")


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


def _build(path: Path, drop_page_cache: bool, experts_implementation: str | None, rows: bool):
    """The model with its dense weights and untouched expert parameters, its store, its
    experts modules and its plan (`rows`: for `ExpertRows`, else for `DeviceSlots`)."""
    store = ExpertStore(path, drop_page_cache)
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, TypeError, KeyError, StrictDataclassError) as e:
        # StrictDataclassError: a field of the wrong type (transformers 5 checks them)
        raise ModelError(f"{path}: transformers cannot read its config.json: {e}") from None
    if experts_implementation:
        config._experts_implementation = experts_implementation
    _refuse_quantized(path, config)
    files = _stock_files(path, store)
    _refuse_conversions(path, config, store)
    experts = _experts_modules(path, config, store)
    wanted = _stock_dtype(path, config, files)
    if isinstance(wanted, torch.dtype) and wanted != experts[0].dtype:
        said = "config.json's dtype" if config.dtype else "the dtype transformers infers"
        raise ModelError(f"{path}: {said} is {str(wanted).split('.')[-1]} but the experts are "
                         f"stored as {experts[0].dtype_name}: the torch backend computes in the "
                         "stored dtype; convert the checkpoint or set its config's dtype")
    with init.no_init_weights():  # no weight is written, so none takes memory yet
        lm = AutoModelForCausalLM.from_config(config, dtype=experts[0].dtype)
    lm.eval()
    modules = dict(lm.named_modules())
    plan = _plan(path, config, store, experts, modules, _load_dense(lm, store, experts), rows)
    return lm, store, experts, plan


def _refuse_quantized(path: Path, config) -> None:
    """transformers dequantizes a quantized checkpoint (fp8, mxfp4, ...) or runs its kernels at
    load; copied and read as stored, its weights would be wrong without a word."""
    for part in {id(c): c for c in (config, config.get_text_config())}.values():
        quantization = getattr(part, "quantization_config", None)
        if quantization:
            method = (quantization.get("quant_method", "unnamed") if isinstance(quantization, dict)
                      else getattr(quantization, "quant_method", "unnamed"))
            raise ModelError(f"{path}: config.json has a quantization_config ({method}); the "
                             "torch backend streams unquantized checkpoints only")


def _stock_files(path: Path, store: ExpertStore) -> list[str]:
    """The files `from_pretrained` reads, in its order: model.safetensors, else the shards its
    index lists. The store reads every model*.safetensors, as mlx-lm does: a file that only it
    would read (a shard an earlier download left) would give the model tensors stock's lacks."""
    index = path / "model.safetensors.index.json"
    if (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    elif index.exists():  # the store has checked it
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        raise ModelError(f"{path}: no model.safetensors or model.safetensors.index.json, which "
                         "transformers loads from")
    extra = [f.name for f in store.files if f.suffix == ".safetensors" and f.name not in files]
    if extra:
        reads = "model.safetensors alone" if len(files) == 1 else "only the shards its index lists"
        raise ModelError(f"{path / extra[0]}: not a file transformers loads (it reads {reads}); "
                         "move it away")
    return files


def _stock_dtype(path: Path, config, files: list[str]) -> torch.dtype | None:
    """What `from_pretrained` computes in by default (dtype "auto"): config.json's dtype, else
    the shard index's, else the first floating tensor's of the first file it reads."""
    from transformers.modeling_utils import get_state_dict_dtype, load_state_dict

    wanted = config.dtype
    index = path / "model.safetensors.index.json"
    if wanted is None and files != ["model.safetensors"]:
        wanted = (json.loads(index.read_text()).get("metadata") or {}).get("dtype")
    if wanted is None:
        try:
            wanted = get_state_dict_dtype(load_state_dict(str(path / files[0]),
                                                          map_location="meta"))
        except SafetensorError as e:
            raise ModelError(f"{path / files[0]}: safetensors cannot read it: {e}") from None
    return getattr(torch, wanted, None) if isinstance(wanted, str) else wanted


def _dtype_plan(lm: torch.nn.Module, dtype: torch.dtype) -> Callable[[str], torch.dtype | None]:
    """The dtype `from_pretrained` gives a loaded tensor instead of `dtype`, by name (None: no
    other): its `_keep_in_fp32_modules` keep gpt-oss's norms in float32 under float16, and
    some models' routers under any half precision."""
    from transformers.core_model_loading import build_glob_alternation

    plan = lm._get_dtype_plan(dtype)
    if not plan:
        return lambda name: None
    pattern, glob_of, _ = build_glob_alternation(list(plan))

    def planned(name: str) -> torch.dtype | None:
        match = pattern.search(name)
        return plan[glob_of[match.lastgroup]] if match else None

    return planned


class _Experts:
    """One fused experts module and where its checkpoint keeps its experts."""

    def __init__(self, module: str, parent: str, names: list[str], stored: str):
        self.module = module  # e.g. model.layers.3.mlp.experts
        self.parent = parent  # its block in the checkpoint, e.g. model.layers.3.block_sparse_moe
        self.names = names  # checkpoint names after `experts.` (and the expert id, if any)
        self.dtype, self.dtype_name = DTYPES[stored]
        self.path = f"{parent}.switch_mlp"  # the plan's name of its layer: mlx-lm's


def _renamings(config) -> list[tuple[str, str]]:
    """transformers' own checkpoint -> module renamings for the model type (Mixtral's
    `block_sparse_moe` -> `mlp`); the experts' conversions are done here instead."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    return [(t.source_patterns[0], t.target_patterns[0])
            for t in get_checkpoint_conversion_mapping(config.model_type) or []
            if isinstance(t, WeightRenaming)]


# The conversions transformers makes at load that are done here: per-expert tensors stacked,
# gate and up joined.
MERGES = {"MergeModulelist", "Concatenate"}


def _refuse_conversions(path: Path, config, store: ExpertStore) -> None:
    """Refuse a checkpoint with a tensor transformers converts at load other than the
    `MERGES` of expert tensors done here (a transpose, an interleave, a dense concatenation):
    the dense weights are copied and the experts read as stored, so it would compute wrongly,
    with no error where its matrix is square."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    renamings = _renamings(config)
    for t in get_checkpoint_conversion_mapping(config.model_type) or []:
        if not isinstance(t, WeightConverter):
            continue
        ops = [type(op).__name__ for op in t.operations]
        merges = not set(ops) - MERGES  # done here for expert tensors only (Kimi-Linear
        for key in store.tensors:  # concatenates its q/k/v convolutions)
            if t.compiled_sources.search(key) and not (merges and _as_loaded(key, renamings)):
                raise ModelError(f"{path}: transformers converts '{key}' at load "
                                 f"({', '.join(ops)}), which the torch backend does not: "
                                 f"{config.model_type} checkpoints are not supported")


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a tensor `safe_open` maps from its file (the file may change under a mapping)
    at the same address modulo 64 bytes: float32 CPU matmul kernels round differently by
    alignment, and `from_pretrained` computes from the mapped tensors."""
    raw = torch.empty(tensor.nbytes + 64, dtype=torch.uint8)
    skip = (tensor.data_ptr() - raw.data_ptr()) % 64
    if skip % tensor.element_size():  # mapped below its dtype's alignment: any copy will do
        return tensor.clone()
    out = raw[skip : skip + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
    return out.copy_(tensor)


def _module_name(key: str, renamings: list[tuple[str, str]]) -> str:
    for source, target in renamings:
        key = re.sub(source, target, key)
    return key


EXPERT_KEY = re.compile(r"^(?P<parent>.+)\.experts\.(?:(?P<expert>\d+)\.)?(?P<name>.+)$")


def _as_loaded(key: str, renamings: list[tuple[str, str]]) -> re.Match | None:
    """`EXPERT_KEY`'s match of a checkpoint key as transformers loads it (renamed): None for
    a tensor that is not an expert's (Laguna's router bias, stored among the experts)."""
    return EXPERT_KEY.match(_module_name(key, renamings))


def _experts_modules(path: Path, config, store: ExpertStore) -> list[_Experts]:
    """Every fused experts module the model will have, from the checkpoint's names, in call
    order: the per-expert layout (`experts.{e}.gate_proj.weight`, Mixtral's w1/w3/w2) or the
    fused one transformers saves (`experts.gate_up_proj`)."""
    renamings = _renamings(config)
    found: dict[str, dict] = {}
    for key, info in store.tensors.items():
        renamed = _as_loaded(key, renamings)
        if not renamed or renamed["expert"] not in (None, "0"):
            continue  # not expert 0's tensor
        # the name the module takes: a stacked tensor transformers renames (Granite's
        # input_linear) is found by the store under its stored name (`STACKED_ALIASES`)
        match = EXPERT_KEY.match(key) or renamed
        parent, name = match["parent"], (renamed if renamed["expert"] is None else match)["name"]
        if renamed["expert"] is None and store.stacked_key(parent, name) != key:
            raise ModelError(f"{path}: transformers renames '{key}' to '{renamed.string}' at "
                             f"load, which the torch backend does not read")
        module = f"{renamed['parent']}.experts"
        entry = found.setdefault(module, {"parent": parent, "names": [], "dtypes": set()})
        entry["names"].append(name)
        entry["dtypes"].add(info.dtype)
    if not found:
        mlx_layout = next((key for key in store.tensors if ".switch_mlp." in key), None)
        if mlx_layout:  # mlx-lm's stacked experts: an mlx-community conversion
            raise ModelError(f"{path}: its experts are in mlx-lm's layout ('{mlx_layout}'), "
                             f"which transformers does not read: load it with the MLX backend "
                             f"(mlx_moestream.load, chat without --backend torch)")
        raise ModelError(f"{path}: no expert tensors named as transformers' fused experts "
                         f"modules take them ('...experts.gate_up_proj' or "
                         f"'...experts.0.gate_proj.weight'): not a Mixture-of-Experts "
                         f"checkpoint")
    out = []
    for module, entry in sorted(found.items(), key=lambda item: path_key(item[0])):
        dtypes = sorted(entry["dtypes"])
        if len(dtypes) != 1 or dtypes[0] not in DTYPES:
            raise StoreError(f"{path}: the experts of {module} are stored as {dtypes}: one of "
                             f"{sorted(DTYPES)} is needed")
        out.append(_Experts(module, entry["parent"], entry["names"], dtypes[0]))
    if len({e.dtype for e in out}) != 1:
        raise StoreError(f"{path}: the experts are stored in several dtypes")
    return out


@contextmanager
def _opened(file: Path):
    """`safe_open` of a shard, its errors naming the file (it refuses offsets that overlap or
    leave gaps, which the store's index takes, as `mx.load` does)."""
    try:
        with safe_open(str(file), framework="pt") as f:
            yield f
    except SafetensorError as e:
        raise ModelError(f"{file}: safetensors cannot read it: {e}") from None


def _load_dense(lm: torch.nn.Module, store: ExpertStore, experts: list[_Experts]) -> int:
    """Give the model every checkpoint tensor that is not an expert's; returns the dense bytes.
    Parameters become the tensors safetensors maps from the files, as `from_pretrained` does:
    their addresses (alignment) then match the loaded model's, and CPU kernels round alike.
    They require grad, as `from_pretrained`'s do: torch.matmul folds a non-contiguous 3-D input
    one way or another by that flag, even under no_grad, and the two ways round differently.
    A parameter the checkpoint lacks is an error (tied ones excepted)."""
    renamings = _renamings(lm.config)
    planned = _dtype_plan(lm, experts[0].dtype)
    params = dict(lm.named_parameters(remove_duplicate=False))  # a tied one under each name
    buffers = dict(lm.named_buffers())
    known = params.keys() | buffers.keys()
    expert_params = {n for n in params if any(n.startswith(e.module + ".") for e in experts)}
    by_file: dict[int, list[str]] = {}
    for key, info in store.tensors.items():
        by_file.setdefault(info.file, []).append(key)
    loaded, nbytes = set(), 0
    with torch.no_grad():
        for file, keys in by_file.items():
            if store.files[file].suffix != ".safetensors":
                continue  # a repacked copy of the experts
            with _opened(store.files[file]) as f:
                for key in keys:
                    name = _module_name(key, renamings)
                    if name not in known:  # as transformers: a key the model has is not
                        name = key  # renamed (no `mlp.mlp.` of `mlp.`)
                    if name in expert_params or name not in known:
                        continue
                    target = params.get(name, buffers.get(name))
                    tensor = _copy(f.get_tensor(key)).to(planned(name) or target.dtype)
                    if tensor.shape != target.shape:
                        raise ModelError(f"{store.files[file]}: tensor '{key}' has shape "
                                         f"{list(tensor.shape)}, the model's {name} "
                                         f"{list(target.shape)}")
                    owner, attr = name.rsplit(".", 1)
                    if name in params:
                        setattr(lm.get_submodule(owner), attr, torch.nn.Parameter(tensor))
                    elif tensor.dtype != target.dtype:  # kept in float32
                        setattr(lm.get_submodule(owner), attr, tensor)
                    else:
                        target.copy_(tensor)
                    loaded.add(name)
                    nbytes += tensor.nbytes
    # as `from_pretrained` ties: what the checkpoint lacks to what it has; both there and
    # different (a config saying "tied" of a checkpoint that is not) stay apart
    lm.tie_weights(missing_keys=set(params) - loaded)
    missing = [n for n, _ in lm.named_parameters() if n not in loaded and n not in expert_params]
    if missing:
        raise ModelError(f"{store.model_dir}: the checkpoint has no tensor for {missing[0]}"
                         + (f" and {len(missing) - 1} more parameters" if len(missing) > 1 else ""))
    return nbytes


def _plan(path: Path, config, store: ExpertStore, experts: list[_Experts], modules: dict,
          dense_bytes: int, rows: bool) -> ModelPlan:
    """The plan the MLX backend makes of the same checkpoint: its layer paths name the
    checkpoint's blocks as mlx-lm does (`PARENT.switch_mlp`), so a profile fits both. In rows
    (`rows`), an expert holds the pages its rows touch; in a slot pool, its bytes."""
    layers = []
    for e in experts:
        module = modules.get(e.module)
        if module is None or not hasattr(module, "down_proj"):
            raise ModelError(f"{path}: {e.module} is not a fused experts module of "
                             f"{type(modules.get(e.module.rsplit('.', 1)[0])).__name__}")
        kind = type(module).__name__
        if len(inspect.signature(module.forward).parameters) < 2:  # (hidden states, ids, ...)
            raise ModelError(f"{path}: {e.module} ({kind}) computes every expert for every "
                             "token, not the routed ones: nothing can stream")
        num = getattr(module, "num_experts", None)
        held_rows = {p.shape[0] for _, p in _expert_params(module)}
        if not isinstance(num, int) or held_rows != {num}:  # LongCat's identity experts
            raise ModelError(f"{path}: {e.module} ({kind}) holds {sorted(held_rows)} rows of "
                             f"experts where num_experts is {num}: not supported")
        specs = {}
        for name in e.names:
            fused = store.tensors.get(store.stacked_key(e.parent, name))
            if fused is not None:  # [E, ...]
                spec = (fused.shape[1:], e.dtype_name, fused.nbytes // fused.shape[0])
            else:
                info = store.tensors[f"{e.parent}.experts.0.{name}"]
                spec = (info.shape, e.dtype_name, info.nbytes)
            specs[_canonical(name)] = (tuple(spec[0]), *spec[1:])
        held = sum(_pages_touched(p.nbytes // p.shape[0], _row_offset(store, e, name))
                   for name, p in _expert_params(module)) if rows else 0
        layers.append(ExpertLayer(e.path, num, specs, held_bytes=held))
    raw = read_config(path)
    return ModelPlan(config.model_type, top_k_of(raw), layers, dense_bytes, config_hash(raw))


EXPERT_PARAMS = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias",
                 "down_proj_bias")


def _expert_params(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n in EXPERT_PARAMS
            if isinstance(p := getattr(module, n, None), torch.nn.Parameter)]


def _row_offset(store: ExpertStore, experts: "_Experts", name: str) -> int:
    """Where row 0 of a module parameter starts in its first page: where `from_pretrained`
    has it, in the file's map (fused checkpoints: the file offset), or in memory of its own
    (the per-expert tensors it merges), aligned as torch aligns."""
    fused = store.tensors.get(store.stacked_key(experts.parent, name))
    return fused.offset % mmap.PAGESIZE if fused is not None else 0


def _pages_touched(row_bytes: int, offset: int) -> int:
    """The most memory one row may hold: its pages, with those it shares with neighbours."""
    page = mmap.PAGESIZE
    if offset % page == 0 and row_bytes % page == 0:
        return row_bytes
    return ((row_bytes - 1) // page + 2) * page


PER_EXPERT_ALIASES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _canonical(name: str) -> str:
    """The store's name of a per-expert tensor (Mixtral's `w1.weight` -> `gate_proj.weight`)."""
    proj, _, param = name.partition(".")
    return f"{PER_EXPERT_ALIASES.get(proj, proj)}.{param}" if param else name


def _targets(module: torch.nn.Module, experts: _Experts, specs: dict
             ) -> dict[str, tuple[str, slice]]:
    """Which expert parameter of the module each stored tensor fills, and which part of its
    row (a fused gate_up row: the gate half, then the up half). Every parameter must be filled
    exactly by the checkpoint's tensors (else a one-line error)."""
    params = dict(_expert_params(module))
    out, filled = {}, dict.fromkeys(params, 0)
    for stored, (shape, _, nbytes) in specs.items():
        proj, _, kind = stored.partition(".")
        part = slice(None)
        if not kind:  # the fused layout: one module parameter per stored tensor
            target = stored
        elif proj in GATE_UP and kind == "weight" and "gate_up_proj" in params:
            if module.is_transposed or not module.is_concatenated:
                raise ModelError(f"{experts.module}: per-expert checkpoints of a transposed or "
                                 f"interleaved gate_up layout are not supported")
            target = "gate_up_proj"
            half = params[target].shape[1] // 2
            part = slice(0, half) if proj == "gate_proj" else slice(half, None)
        else:
            target = proj if kind == "weight" else f"{proj}_bias"
        row = params[target][0][part] if target in params else None
        if row is None or tuple(shape) != tuple(row.shape) or row.nbytes != nbytes:
            raise ModelError(f"{experts.parent}.experts: the checkpoint's '{stored}' "
                             f"{list(shape)} fills no expert parameter of {experts.module}"
                             + (f" (it needs {list(row.shape)})" if row is not None else ""))
        out[stored] = (target, part)
        filled[target] += nbytes
    for name, param in params.items():
        if filled[name] != param.nbytes // param.shape[0]:
            raise ModelError(f"{experts.parent}.experts: the checkpoint does not fill "
                             f"{experts.module}.{name} (no tensor, or only part of it)")
    return out


def _landing(rows: dict[str, np.ndarray], targets: dict[str, tuple[str, slice]]
             ) -> dict[str, np.ndarray]:
    """Per stored tensor, the byte view its read lands in: `rows` are byte views of a module's
    expert parameters (all experts' `[E, ...]` rows, or one expert's row), `targets` says which
    part of a row each stored tensor fills."""
    return {stored: rows[target][..., part, :] if part != slice(None) else rows[target]
            for stored, (target, part) in targets.items()}


def _bytes(tensor: torch.Tensor) -> np.ndarray:
    """A tensor's bytes as a numpy array shaped as the tensor (the last axis in bytes)."""
    return tensor.view(torch.uint8).numpy()


def _mapped(shape: torch.Size, dtype: torch.dtype, offset: int) -> tuple[torch.Tensor, mmap.mmap]:
    """A zero tensor over an anonymous map, starting `offset` bytes into its first page (CPU
    kernels round by alignment: it must be the loaded model's); pages are backed once written.
    Private: a shared anonymous map (mmap's default) lives in shmem, which keeps pages that
    MADV_DONTNEED hands back, so evicted experts would hold their memory for good. Without
    huge pages (Linux's transparent ones, on by default in some kernels): a read into one row
    would back the 2 MiB page around it, other experts' rows too, which no MADV_DONTNEED of
    an evicted row gives back."""
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    buffer = mmap.mmap(-1, offset + max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux
        buffer.madvise(mmap.MADV_NOHUGEPAGE)
    raw = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offset)
    return raw.view(dtype).view(shape), buffer


class ExpertRows(Backend):
    """The expert tensors of every layer, indexed by expert id: a read of (layer, expert) lands
    in that expert's row, wherever the cache put its slot; the cache's slots only count."""

    def __init__(self, layers: list[tuple[torch.nn.Module, _Experts, dict]], store: ExpertStore):
        """Give each module's expert parameters anonymous `[E, ...]` memory maps."""
        self.views, self.maps = [], []  # maps: (memory map, offset of row 0, bytes of a row)
        for module, experts, targets in layers:
            rows, maps = {}, []
            for name, param in _expert_params(module):
                offset = _row_offset(store, experts, name)
                tensor, buffer = _mapped(param.shape, param.dtype, offset)
                maps.append((buffer, offset, tensor.nbytes // param.shape[0]))
                setattr(module, name, torch.nn.Parameter(tensor))
                rows[name] = _bytes(tensor)
            self.views.append(_landing(rows, targets))
            self.maps.append(maps)

    def new_pool(self, like: ExpertLayer, num_slots: int) -> SlotPool:
        return _RowPool(self, like, num_slots)


class _RowPool(SlotPool):
    """The slots of one group of layers as the cache counts them; the bytes live in the
    layers' rows (`ExpertRows`), placed by expert id, and a slot costs `slot_bytes`."""

    releases = True

    def __init__(self, rows: ExpertRows, like: ExpertLayer, num_slots: int):
        self.rows, self.num_slots = rows, num_slots
        self.views = {}  # no slot memory of its own
        self._nbytes = num_slots * like.slot_bytes

    def landing(self, layer: int, expert: int, slot: int
                ) -> AbstractContextManager[dict[str, np.ndarray]]:
        """The expert's own rows, whatever its slot."""
        return nullcontext({name: view[expert] for name, view in self.rows.views[layer].items()})

    def layer_destination(self, layer: int, slots: list[int]) -> dict[str, np.ndarray] | None:
        """Every row of the layer, whatever the slots (they only count)."""
        views = self.rows.views[layer]
        return views if all(v.flags.c_contiguous for v in views.values()) else None

    def release(self, layer: int, expert: int, resident: np.ndarray) -> None:
        """Hand back the expert's pages: those inside its rows, and a page it shares with a
        neighbour once no expert on that page is `resident`."""
        page = mmap.PAGESIZE
        for buffer, offset, size in self.rows.maps[layer]:
            start = offset + expert * size
            first, last = start // page, (start + size - 1) // page

            def alone(p: int) -> bool:  # no resident expert has bytes on page p
                lo = max(0, (p * page - offset) // size)
                return not resident[lo : ((p + 1) * page - 1 - offset) // size + 1].any()

            first += not alone(first)
            last -= last >= first and not alone(last)
            if last >= first:
                end = min((last + 1) * page, len(buffer))
                buffer.madvise(mmap.MADV_DONTNEED, first * page, end - first * page)

    @property
    def nbytes(self) -> int:
        return self._nbytes


class DeviceSlots(Backend):
    """Slot pools in device memory, one per group of layers with one expert shape, each shared
    by the group's experts modules as their expert parameters (`attach`). A read lands in one
    of a few pinned host buffers (`STAGING`) and is copied to its slot on a side stream; a call
    computes once the copies issued so far are done (`ready`), and a copy starts once the
    computations queued before it are done, so it never overwrites a slot one of them reads."""

    # host buffers: one per read in flight (the runtime's 4 reader threads and the caller's
    # own), and a few more, so that a read rarely waits for an earlier copy to end
    STAGING = 8

    def __init__(self, layers: list[tuple[torch.nn.Module, _Experts, dict]],
                 device: torch.device):
        self.device = device
        self.layers = {e.path: (module, targets) for module, e, targets in layers}
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.free: queue.SimpleQueue = queue.SimpleQueue()
        largest = max(sum(p[0].nbytes for _, p in _expert_params(module))
                      for module, _, _ in layers)
        for _ in range(self.STAGING):
            staged = torch.empty(largest, dtype=torch.uint8, pin_memory=cuda)
            self.free.put((staged, torch.cuda.Event() if cuda else None))
        self.pending = False  # copies issued since the compute last waited for them
        self.compute = torch.cuda.current_stream(device) if cuda else None  # the calls' stream

    def new_pool(self, like: ExpertLayer, num_slots: int) -> SlotPool:
        module, targets = self.layers[like.path]
        return _DevicePool(self, module, targets, num_slots)

    def attach(self, runtime: Runtime) -> None:
        """Make each layer's pool its module's expert parameters, numbered by slot."""
        for i, layer in enumerate(runtime.plan.layers):
            module, _ = self.layers[layer.path]
            pool = runtime.layer_pool[i]
            for name, param in pool.params.items():
                setattr(module, name, param)
            module.num_experts = pool.num_slots

    @contextmanager
    def landing(self, pool: "_DevicePool", slot: int):
        """A staging buffer's views to read one expert into; once read, it is copied to
        `slot` of `pool`. A buffer is written again only once its last copy is done."""
        staged, copied = self.free.get()
        try:
            if copied is not None:
                copied.synchronize()
            rows, start = {}, 0
            for name, (shape, dtype, nbytes) in pool.rows.items():
                rows[name] = staged[start : start + nbytes].view(dtype).view(shape)
                start += nbytes
            yield _landing({name: _bytes(row) for name, row in rows.items()}, pool.targets)
            if self.stream is None:  # on the CPU (tests): plain copies
                for name, row in rows.items():
                    pool.params[name].data[slot].copy_(row)
            else:
                with torch.cuda.stream(self.stream):
                    self.stream.wait_stream(self.compute)
                    try:
                        for name, row in rows.items():
                            pool.params[name].data[slot].copy_(row, non_blocking=True)
                    finally:  # a copy cut short still reads the buffer
                        copied.record(self.stream)
            self.pending = True  # after the copies were issued: a `ready` seeing it covers them
        finally:
            self.free.put((staged, copied))

    def ready(self) -> None:
        """The compute stream waits for the copies issued so far."""
        if self.stream is not None:
            current = torch.cuda.current_stream(self.device)
            if current != self.compute:  # calls moved streams: later copies wait for both
                current.wait_stream(self.compute)
                self.compute = current
        if self.pending:
            self.pending = False  # first: a copy issued meanwhile sets it again
            if self.stream is not None:
                self.compute.wait_stream(self.stream)


class _DevicePool(SlotPool):
    """One group's `[num_slots, ...]` expert parameters in device memory (see `DeviceSlots`)."""

    def __init__(self, slots: DeviceSlots, module: torch.nn.Module, targets: dict,
                 num_slots: int):
        self.slots, self.targets, self.num_slots = slots, targets, num_slots
        # per parameter, one expert's row: (shape, dtype, bytes)
        self.rows = {name: (param.shape[1:], param.dtype, param[0].nbytes)
                     for name, param in _expert_params(module)}
        self.params = {name: torch.nn.Parameter(torch.zeros((num_slots, *shape), dtype=dtype,
                                                            device=slots.device))
                       for name, (shape, dtype, _) in self.rows.items()}
        self.views = {}  # no host views: reads land in staging buffers
        self._nbytes = sum(p.nbytes for p in self.params.values())

    def landing(self, layer: int, expert: int, slot: int):
        return self.slots.landing(self, slot)

    def layer_destination(self, layer: int, slots: list[int]) -> None:
        return None  # every read goes through a staging buffer

    @property
    def nbytes(self) -> int:
        return self._nbytes


class _StreamedExperts:
    """The streamed side of one transformers experts module (`Runtime.call` drives it): its
    calls run under the runtime's lock, so no other thread's call evicts their experts
    meanwhile. With `next_router` (prefetch), a one-token call predicts the next layer's experts
    from its own input and reads them while it computes. With `slots`, a call computes on the
    slot pool, its ids remapped (`_on_slots`)."""

    computes_parts = False  # a call computes at once: every expert of it must fit

    def __init__(self, module: torch.nn.Module, layer: int, runtime: Runtime,
                 next_router: tuple[Callable[[torch.Tensor], torch.Tensor], int] | None,
                 slots: DeviceSlots | None):
        self.module, self.layer, self.runtime = module, layer, runtime
        self.next_router, self.slots = next_router, slots
        self.forward = module.forward
        self.params = _expert_params(module)  # the memory reads land in
        # reads land through numpy, which leaves torch's version counters as they are: a counter
        # that moved is the user's in-place edit, which an evicted expert would lose
        self.where = [(name, param.data_ptr(), param._version) for name, param in self.params]
        self.waits = self.params[0][1].device.type != "cpu"  # reading ids from a GPU: a sync
        # a gradient reaches the experts only when none ever leaves its memory and the module
        # computes from it (not from a gathered copy)
        self.trainable = runtime.holds_all and slots is None

    def check(self) -> None:
        """Refuse experts moved, converted or changed in place since load."""
        for name, address, version in self.where:
            param = getattr(self.module, name)
            if param.data_ptr() != address:
                raise ModelError(
                    f"layer {self.layer}: the experts' '{name}' was moved or converted after "
                    "load (model.to, .half, ...), which streaming cannot follow: the experts "
                    "are read in the checkpoint's dtype to the device they were loaded on")
            if param._version != version and not self.trainable:  # else they stay, as trained
                raise ModelError(
                    f"layer {self.layer}: the experts' '{name}' was changed in place after load, "
                    "which streaming cannot keep: an evicted expert is read again from the "
                    "checkpoint; save the changed weights as a checkpoint and load that")

    def predicts(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, *rest) -> bool:
        """One-token calls predict, where the next layer's router takes this input (a latent
        MoE's experts take less)."""
        return (self.next_router is not None and top_k_index.numel() == top_k_index.shape[-1]
                and hidden_states.shape[-1] == self.next_router[1])

    def routed(self, predict: bool, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
               *rest) -> tuple[np.ndarray, np.ndarray | None]:
        ids = top_k_index.detach().to("cpu").numpy()
        if self.waits:
            self.runtime.count_sync()
        if not predict:
            return ids, None
        with torch.no_grad():
            picks = self.next_router[0](hidden_states).topk(self.runtime.plan.top_k, dim=-1)
        if self.waits:
            self.runtime.count_sync()
        return ids, np.unique(picks.indices.to("cpu").numpy())

    def compute(self, ids: np.ndarray, placed: np.ndarray, hidden_states: torch.Tensor,
                top_k_index: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        if self.slots is None:
            out = self.forward(hidden_states, top_k_index, *args, **kwargs)
        else:
            self.slots.ready()
            out = _on_slots(self.module, self.forward, hidden_states, ids, placed, top_k_index,
                            *args, **kwargs)
        return _NoBackward.apply(out, self.layer) if out.requires_grad and not self.trainable \
            else out

    def compute_rounds(self, ids: np.ndarray, rounds, *inputs) -> torch.Tensor:
        num_experts = self.runtime.plan.layers[self.layer].num_experts
        raise BudgetError(
            f"layer {self.layer}: a call routes to more experts than the budget holds at once "
            f"({self.runtime.capacity(self.layer)} of {num_experts}); raise the budget")

    compute_chunks = compute_rounds  # never called: `computes_parts` is False

    def issued(self, output: torch.Tensor) -> None:
        """CUDA computes the output asynchronously; the slot copies wait for it (`DeviceSlots`)."""


def _stream(module: torch.nn.Module, layer: int, runtime: Runtime,
            next_router: tuple[Callable[[torch.Tensor], torch.Tensor], int] | None,
            slots: DeviceSlots | None) -> None:
    """Make each call of the experts module a streamed call (see `_StreamedExperts`)."""
    streamed = _StreamedExperts(module, layer, runtime, next_router, slots)
    module.register_state_dict_post_hook(_refuse_saving)
    # set before `forward`, a local function pickle cannot name: pickling the model (`torch.save
    # (model)`) reaches the runtime first, which refuses clearly (`Runtime.__reduce__`)
    module.moestream = runtime

    @torch.compiler.disable  # numpy bookkeeping and a lock, not a graph: it runs as is
    def streaming_forward(hidden_states, top_k_index, *args, **kwargs):
        with runtime.lock:  # another thread's call of this layer may swap its experts (eager)
            streamed.check()
            return runtime.call(streamed, hidden_states, top_k_index, args, kwargs)

    module.forward = streaming_forward


class _NoBackward(torch.autograd.Function):
    """The experts' output as it is, refusing a gradient: later calls evict the experts it
    was computed from or read others over them (around autograd), and an optimizer step would
    update experts that are read again from the checkpoint."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, layer: int) -> torch.Tensor:
        ctx.layer = layer
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        raise ModelError(f"layer {ctx.layer}: no gradient flows through streamed experts (later "
                         f"calls evict or overwrite the experts it would be computed from); to "
                         f"train, load on the CPU with a budget that holds every expert")


def _on_slots(module: torch.nn.Module, forward: Callable, hidden_states: torch.Tensor,
              ids: np.ndarray, placed: np.ndarray, top_k_index: torch.Tensor, *args, **kwargs
              ) -> torch.Tensor:
    """Compute a call on the slot pool its module holds: the routed ids become the slots
    `placed`. Where the implementation adds the experts' outputs in expert order (eager), the
    used slots are gathered in expert-id order and the ids become ranks, so that order holds."""
    device, dtype = top_k_index.device, top_k_index.dtype
    if module.config._experts_implementation in ROW_WISE:
        return forward(hidden_states, torch.from_numpy(placed).to(device, dtype), *args,
                       **kwargs)
    used, first = np.unique(ids, return_index=True)
    order = torch.from_numpy(placed.reshape(-1)[first]).to(device)
    ranks = torch.from_numpy(np.searchsorted(used, ids)).to(device, dtype)
    pool = {name: module._parameters[name] for name, _ in _expert_params(module)}
    num_slots = module.num_experts
    try:
        for name, param in pool.items():
            module._parameters[name] = torch.nn.Parameter(param.data.index_select(0, order))
        module.num_experts = len(used)
        return forward(hidden_states, ranks, *args, **kwargs)
    finally:
        module._parameters.update(pool)
        module.num_experts = num_slots


def _router(block: torch.nn.Module, num_experts: int
            ) -> tuple[Callable[[torch.Tensor], torch.Tensor], int] | None:
    """The routing logits of a MoE block (its child with one weight row per expert, and the
    bias it adds, if any) and the width of the input it takes, or None. Used to predict only:
    the model routes as it always does. Computed in the weight's dtype: some models keep their
    router in float32 (DeepSeek-V3)."""
    for child in block.children():
        weight = getattr(child, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.ndim == 2 and len(weight) == num_experts:
            bias = getattr(child, "bias", None)
            return (lambda x, w=weight, b=bias: torch.nn.functional.linear(x.to(w.dtype), w, b),
                    weight.shape[1])
    return None
