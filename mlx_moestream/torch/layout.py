"""Where a fused experts module keeps its experts, and which checkpoint tensor fills which part."""

from __future__ import annotations

import mmap

import torch

from ..errors import ModelError
from ..store import ExpertStore

# safetensors dtype -> (torch dtype, its name in plans)
DTYPES = {"F32": (torch.float32, "float32"), "BF16": (torch.bfloat16, "bfloat16"),
          "F16": (torch.float16, "float16")}
# The per-expert checkpoint names of a fused gate_up row: gate first, then up.
GATE_UP = ("gate_proj", "up_proj")


class _Experts:
    """One fused experts module and where its checkpoint keeps its experts."""

    def __init__(self, module: str, parent: str, names: list[str], stored: str):
        self.module = module  # e.g. model.layers.3.mlp.experts
        self.parent = parent  # its block in the checkpoint, e.g. model.layers.3.block_sparse_moe
        self.names = names  # checkpoint names after `experts.` (and the expert id, if any)
        self.dtype, self.dtype_name = DTYPES[stored]
        self.path = f"{parent}.switch_mlp"  # the plan's name of its layer: mlx-lm's


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
