"""Wiring: swap an mlx-lm model's expert modules for ones that compute from slot pools."""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..runtime import Runtime
from .hosts import HostExperts
from .resident import DeferredRouting, ResidentExperts
from .streaming import StreamingExperts, slot_ids


def attach(runtime: Runtime, model: nn.Module, prefetch: bool = False,
           progress: Callable | None = None, group: mx.distributed.Group | None = None) -> None:
    """Swap every expert module of `model` for one that computes from the runtime's slot pools
    (its lazy experts drop out of the model). When every expert has a slot, read them all now,
    as stock mlx-lm reads its weights, and compute without host syncs (`ResidentExperts`);
    else stream (`StreamingExperts`), predicting each next layer's experts with that layer's
    router when `prefetch`. `progress(items, label)` may wrap the reads. With a distributed
    `group`, the runtime serves this host's experts (`ModelPlan.host_share`) and each module is
    wrapped in `HostExperts`, whose exchanges the backend's watchdog times."""
    found = [(layer.path, _get_path(model, layer.path)) for layer in runtime.plan.layers]
    for i, (path, module) in enumerate(found):
        for name, array in runtime.residency.layer_pool[i].arrays.items():
            _set_path(module, name, array)
    if runtime.residency.holds_all:
        runtime.read_all(progress)
        deferred = runtime.backend.deferred = DeferredRouting(runtime)
    streamed = []
    for i, (path, module) in enumerate(found):
        parent_path, attr = path.rsplit(".", 1)
        parent = _get_path(model, parent_path)
        if runtime.residency.holds_all:
            row = runtime.residency.slot_map(i)
            slot_map = slot_ids(np.append(row, row[0]))  # masked ids: expert 0's slot
            experts = ResidentExperts(module, i, slot_map, deferred)
        else:
            experts = StreamingExperts(module, i, runtime)
            streamed.append((experts, _router(parent, runtime.plan.layers[i].num_experts)))
        if group is not None:
            layer = runtime.plan.layers[i]
            experts = HostExperts(experts, layer.first_expert, layer.num_experts, group, runtime,
                                  checks_inputs=i == 0)
        setattr(parent, attr, experts)
    model.moestream = runtime
    if prefetch:
        for (experts, _), (_, router) in zip(streamed, streamed[1:]):
            object.__setattr__(experts, "next_router", router)  # None where none was found


def _router(block: nn.Module, num_experts: int):
    """The routing logits of a MoE block (its Linear with one output per expert: a child, or a
    child's, as Hunyuan's `gate.wg`) and the width of the input it takes, or None."""
    children = list(block.children().values())
    grandchildren = [c for child in children if isinstance(child, nn.Module)
                     for c in child.children().values()]
    for child in children + grandchildren:
        if isinstance(child, (nn.Linear, nn.QuantizedLinear)):
            out, width = child.weight.shape
            if out == num_experts:
                return child, width * 32 // getattr(child, "bits", 32)  # packed when quantized
        weight = getattr(child, "weight", None) if isinstance(child, nn.Module) else None
        if isinstance(weight, mx.array) and weight.ndim == 2 and weight.shape[0] == num_experts:
            return (lambda x, w=weight: x @ w.T), weight.shape[1]
    return None


def _get_path(root: nn.Module, path: str):
    obj = root
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def _set_path(root: nn.Module, path: str, value) -> None:
    parent, attr = path.rsplit(".", 1)
    setattr(_get_path(root, parent), attr, value)
