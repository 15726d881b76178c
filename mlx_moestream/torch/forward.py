"""A streamed experts call: the module's own forward, run by `Runtime.call` on rows or slots."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from ..errors import BudgetError, ModelError
from ..runtime import Runtime
from .guards import _NoBackward, _refuse_saving
from .layout import _expert_params
from .pools import DeviceSlots

# Experts implementations that compute each routed (token, expert) row on its own: on CUDA their
# outputs do not depend on where an expert's slot is (measured; on the CPU, batched_mm's only).
ROW_WISE = ("grouped_mm", "batched_mm")


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
        self.trainable = runtime.residency.holds_all and slots is None

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
        """The routed ids and the prediction, once the experts are found unchanged (under the
        runtime's lock: another thread's call of this layer may swap its experts)."""
        self.check()
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
            f"({self.runtime.residency.capacity(self.layer)} of {num_experts}); raise the budget")

    def issued(self, output: torch.Tensor) -> None:
        """CUDA computes the output asynchronously; the slot copies wait for it (`DeviceSlots`)."""


def _stream(module: torch.nn.Module, layer: int, runtime: Runtime,
            next_router: tuple[Callable[[torch.Tensor], torch.Tensor], int] | None,
            slots: DeviceSlots | None) -> None:
    """Make each call of the experts module a streamed call (see `_StreamedExperts`)."""
    streamed = _StreamedExperts(module, layer, runtime, next_router, slots)
    module.register_state_dict_post_hook(_refuse_saving)
    # set before `forward`, a local function pickle cannot name: pickling the model
    # (`torch.save(model)`) reaches the runtime first, which refuses clearly (`Runtime.__reduce__`)
    module.moestream = runtime

    @torch.compiler.disable  # numpy bookkeeping and a lock, not a graph: it runs as is
    def streaming_forward(hidden_states, top_k_index, *args, **kwargs):
        return runtime.call(streamed, hidden_states, top_k_index, args, kwargs)

    module.forward = streaming_forward


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
