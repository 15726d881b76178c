"""The plan of an mlx-lm model: its SwitchGLU / SwitchMLP expert modules and their tensors."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

from ..plan import ExpertLayer, ModelPlan, config_hash, path_key, top_k_of

EXPERT_MODULES = (SwitchGLU, SwitchMLP)


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of each SwitchGLU / SwitchMLP, in call order."""
    found = [(p, m) for p, m in model.named_modules() if isinstance(m, EXPERT_MODULES)]
    return sorted(found, key=lambda item: path_key(item[0]))


def plan_model(model: nn.Module, config: dict) -> ModelPlan:
    """Find the expert modules of an mlx-lm model and measure experts vs. dense weights."""
    model_type = config.get("model_type", "?")
    layers = []
    for path, module in expert_modules(model):
        proj = module.gate_proj if isinstance(module, SwitchGLU) else module.fc1
        num_experts = proj.num_experts
        specs = {
            n: (a.shape[1:], dtype_name(a.dtype), a.nbytes // num_experts)
            for n, a in tree_flatten(module.parameters())
            if a.ndim and a.shape[0] == num_experts
        }
        layers.append(ExpertLayer(path, num_experts, specs))
    if not layers:
        raise ValueError(
            f"model_type '{model_type}' has no SwitchGLU/SwitchMLP expert layers: "
            "not a Mixture-of-Experts model"
        )
    total = sum(a.nbytes for _, a in tree_flatten(model.parameters()))
    dense = total - sum(l.expert_bytes * l.num_experts for l in layers)
    return ModelPlan(model_type, top_k_of(config), layers, dense, config_hash(config))


def dtype_name(dtype: mx.Dtype) -> str:
    """An MLX dtype's short name, as plans record it and `getattr(mx, name)` reads it back."""
    return str(dtype).rsplit(".", 1)[-1]  # mlx.core.bfloat16 -> bfloat16
