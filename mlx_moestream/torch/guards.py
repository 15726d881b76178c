"""Refusals that keep a streamed model correct after load, and the compile limits it needs.

Saving, converting, loading weights into the experts and gradients would each meet experts that
are read again from the checkpoint, so each is refused before it changes anything.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch

from ..errors import ModelError
from .layout import _expert_params


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
