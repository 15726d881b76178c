"""Rebuild a transformers model as `from_pretrained` does, its dense weights only, and plan it.

It follows transformers' own loading steps (renamings, dtype plans, tying) so that the model
computes as the loaded one bit for bit; a checkpoint transformers would convert at load (other
than merging experts) is refused, since its weights are copied and read as stored.
"""

from __future__ import annotations

import inspect
import mmap
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoModelForCausalLM
from transformers import initialization as init

from ..errors import ModelError, StoreError
from ..files import read_json
from ..plan import (ExpertLayer, ModelPlan, check_layer_count, config_hash, path_key, read_config,
                    top_k_of)
from ..store import ExpertStore
from .layout import DTYPES, _Experts, _expert_params, _row_offset


def _build(path: Path, drop_page_cache: bool, experts_implementation: str | None, rows: bool):
    """The model with its dense weights and untouched expert parameters, its store, its
    experts modules and its plan (`rows`: for `ExpertRows`, else for `DeviceSlots`)."""
    store = ExpertStore(path, drop_page_cache)
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, TypeError, KeyError, StrictDataclassError) as e:
        # StrictDataclassError: a field of the wrong type (transformers 5 checks them)
        raise ModelError(f"{path}: transformers cannot read its config.json: {e}") from None
    try:
        check_layer_count(read_config(path), len(store.tensors))
    except ValueError as e:
        raise ModelError(f"{path}: {e}") from None
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
        files = sorted(set(read_json(index, "corrupt shard index", ModelError)["weight_map"]
                           .values()))
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
        wanted = (read_json(index, "corrupt shard index", ModelError).get("metadata")
                  or {}).get("dtype")
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
        # done here for expert tensors only (Kimi-Linear concatenates its q/k/v convolutions)
        merges = not set(ops) - MERGES
        for key in store.tensors:
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
                    # as transformers: a key the model has is not renamed (no `mlp.mlp.` of `mlp.`)
                    if name not in known:
                        name = key
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
    try:
        return ModelPlan(config.model_type, top_k_of(raw), layers, dense_bytes, config_hash(raw))
    except ValueError as e:
        raise ModelError(f"{path}: {e}") from None


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
