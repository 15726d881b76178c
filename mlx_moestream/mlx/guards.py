"""The guards every experts module computing from slot pools shares.

The experts live in the runtime's pools, not in the model's parameters: converting, training,
LoRA and pickling the model after load would not reach them, so each is refused instead.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import ModelError, NotCopyableError
from .model import dtype_name


class PooledExperts(nn.Module):
    """What every module computing an expert module from slot pools shares. Its experts live in
    the pools, outside the model's parameters (plain attributes, not children), where conversions
    of the model after load (`set_dtype`, `nn.quantize`) cannot reach them, though stock
    mlx-lm would convert them with the rest. Rather than compute with experts stock would not
    have, a converted model is refused: `expert_dtype`, a parameter in the experts' floating
    dtype, is converted (or changed, by `model.apply`, `update`) exactly when they would be,
    and every call checks it. It holds the least value above 1 and the least normal one, which
    a conversion through a dtype of less precision or range changes even when it converts back
    (stock's experts would be rounded then). Quantizing experts that are not quantized yet is
    refused at once."""

    def __init__(self, inner: nn.Module, path: str):
        super().__init__()
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "path", path)
        floats = [a.dtype for _, a in tree_flatten(inner.parameters())
                  if mx.issubdtype(a.dtype, mx.floating)]
        dtype = floats[0] if floats else mx.uint8  # none: nothing a conversion converts
        info = mx.finfo(dtype) if floats else None
        self.expert_dtype = (mx.array([1 + info.eps, info.smallest_normal], dtype) if floats
                             else mx.ones((2,), dtype))
        object.__setattr__(self, "stored_dtype", dtype)
        object.__setattr__(self, "stored_marker", self.expert_dtype.tolist())
        object.__setattr__(self, "checked", self.expert_dtype)  # the marker found unchanged

    def __reduce__(self):
        """Pickling the model reaches its experts modules before the runtime: they refuse as
        it does (their experts are in its slot pools)."""
        raise NotCopyableError()

    def start_routing(self, indices: mx.array) -> None:
        """Start computing a call's routed ids, which its host sync then waits for. MLX refuses
        to inside a function transformation (`mx.compile`, `mx.grad`, `mx.vmap`), where a
        streamed call cannot be right: later calls overwrite the slots its experts are read
        into, under the gradient that reads them again and the compiled graph that replays
        them."""
        try:
            mx.async_eval(indices)
        except ValueError:
            raise ModelError(
                f"{self.path}: a model streaming its experts cannot run under mx.compile, "
                f"mx.grad, mx.vmap or another function transformation (later calls overwrite "
                f"the slots its experts are read into); to compile or differentiate it, load it "
                f"with a budget that holds every expert") from None

    def check_unconverted(self) -> bool:
        """Refuse a converted model; whether the marker is new since the last check (changed
        by `update`, or a gradient's input: see `ResidentExperts`)."""
        marker = self.expert_dtype
        if marker is self.checked:
            return False
        if marker.dtype != self.stored_dtype:
            converted = dtype_name(marker.dtype)
            raise ModelError(
                f"{self.path}: the model was converted to {converted} after load (set_dtype), "
                f"which its experts cannot follow: they are read into the runtime's slots as "
                f"stored ({dtype_name(self.stored_dtype)}); convert the checkpoint instead "
                f"(mlx_lm.convert --dtype {converted}) and load that")
        try:
            values = marker.tolist()
        except ValueError:  # an input of `mx.compile`, as mlx-lm's trainer compiles its step
            return True  # only its dtype is known now: the next call outside checks the values
        if any(math.isnan(v) for v in values):
            raise ModelError(
                f"{self.path}: an optimizer step reached the experts (training the whole model), "
                f"which are not the model's parameters and cannot be trained: they are read "
                f"into the runtime's slots as stored; freeze them (model.freeze(), then "
                f"unfreeze what you train, as LoRA does) or train a model loaded by mlx_lm.load")
        if values != self.stored_marker:
            raise ModelError(
                f"{self.path}: the model's weights were changed after load (model.apply, "
                f"update, or set_dtype there and back), which cannot reach its experts: they "
                f"are read into the runtime's slots as stored; change the checkpoint instead "
                f"and load that")
        object.__setattr__(self, "checked", marker)
        return True

    def to_lora(self, **kwargs) -> nn.Module:
        """`linear_to_lora_layers` without keys: stock would put LoRA on the experts."""
        raise ModelError(f"{self.path}: LoRA cannot reach the experts (linear_to_lora_layers "
                         "takes them when given no keys), which are read into the runtime's "
                         "slots as stored; give keys that leave them out (attention, the "
                         "router), or train a model loaded by mlx_lm.load")

    @property
    def weight(self) -> mx.array:
        """What a predicate of `nn.quantize` or `mlx_lm.utils.quantize_model` reads of the
        layers it converts: stock's experts have one."""
        raise ModelError(f"{self.path}: the experts' weights are not the model's parameters "
                         "(they are read into the runtime's slots as stored), so a conversion "
                         "cannot reach them; convert the checkpoint instead (mlx_lm.convert) "
                         "and load that")

    def to_quantized(self, **kwargs) -> nn.Module:
        """`nn.quantize` of the model: stock would quantize the experts unless they are."""
        if not any(hasattr(m, "to_quantized") for _, m in self.inner.named_modules()):
            return self
        raise ModelError(f"{self.path}: quantizing the model after load cannot reach its "
                         "experts, which are read into the runtime's slots as stored; quantize "
                         "the checkpoint instead (mlx_lm.convert -q) and load that")
