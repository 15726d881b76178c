"""What streaming a model involves: its MoE layers, their expert shapes, pools and budgets.

Backend neutral (no mlx, no torch): each backend reads the expert layers off its own model and
builds a `ModelPlan`; everything derived from it (slot pools, minimum budget, the identity a
profile records) is the same arithmetic on every backend.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from .files import read_json

TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token", "num_experts_per_token", "moe_topk",
              "moe_top_k", "moe_k", "top_k_experts", "top_k")

# Settings that change how weights are stored, not which experts a token routes to: a profile
# recorded on the float model applies to its quantized versions, and on either backend.
STORAGE_KEYS = {"quantization", "quantization_config", "torch_dtype", "dtype", "_name_or_path",
                "transformers_version"}


@dataclass
class ExpertLayer:
    path: str  # the checkpoint's name prefix of the layer's experts, e.g. model.layers.3.mlp.switch_mlp
    num_experts: int
    # Per-expert parameter name (`gate_proj.weight`, ...) -> (shape, dtype name, bytes) of one expert.
    specs: dict[str, tuple[tuple[int, ...], str, int]]
    # A host's share (expert parallelism): its experts 0..num_experts-1 are the layer's
    # first_expert.. of all `total_experts` (0: the layer has just these)
    first_expert: int = 0
    total_experts: int = 0
    # Memory one resident expert may hold, when more than its bytes (a backend whose rows share
    # pages with their neighbours): what a slot costs the budget (0: `expert_bytes`)
    held_bytes: int = 0

    @property
    def signature(self) -> tuple:
        return tuple((n, shape, dtype) for n, (shape, dtype, _) in sorted(self.specs.items()))

    @property
    def expert_bytes(self) -> int:
        return sum(nbytes for _, _, nbytes in self.specs.values())

    @property
    def slot_bytes(self) -> int:
        return self.held_bytes or self.expert_bytes


@dataclass
class ModelPlan:
    """The expert layers of a model, in call order, and the bytes of everything else."""

    model_type: str
    top_k: int
    layers: list[ExpertLayer]
    dense_bytes: int
    config_hash: str
    num_layers: int = field(init=False)

    def __post_init__(self):
        self.num_layers = len(self.layers)
        fewest = min((l.total_experts or l.num_experts for l in self.layers), default=self.top_k)
        if self.top_k > fewest:  # else the router's top-k fails at the first token
            raise ValueError(f"model_type '{self.model_type}': config.json routes each token to "
                             f"{self.top_k} experts (top-k) but a layer has only {fewest}")

    @property
    def num_experts(self) -> int:
        return max(l.num_experts for l in self.layers)

    @property
    def expert_bytes(self) -> int:
        """Bytes of all experts of all layers."""
        return sum(l.expert_bytes * l.num_experts for l in self.layers)

    def layer_groups(self) -> list[list[int]]:
        """Layer indices grouped by identical expert shapes: each group shares one slot pool."""
        groups: dict[tuple, list[int]] = {}
        for i, layer in enumerate(self.layers):
            groups.setdefault(layer.signature, []).append(i)
        return list(groups.values())

    def _group_bytes(self, group: list[int]) -> int:
        layer = self.layers[group[0]]
        return layer.expert_bytes * layer.num_experts * len(group)

    def pool_slots(self, budget_bytes: int) -> list[int]:
        """Slots per group: the budget is split in proportion to each group's expert bytes
        (integer arithmetic, so `budget_holding` is exact). A share that holds all of its
        group's expert bytes holds every expert (rows then share no page with a stranger)."""
        slots = []
        for group in self.layer_groups():
            layer, all_slots = self.layers[group[0]], self.layers[group[0]].num_experts * len(group)
            share = budget_bytes * self._group_bytes(group) // self.expert_bytes
            full = share >= self._group_bytes(group)
            slots.append(all_slots if full else min(share // layer.slot_bytes, all_slots))
        return slots

    @property
    def min_budget_bytes(self) -> int:
        """The smallest budget that gives every pool room for one token's top-k experts."""
        return self.budget_holding(self.top_k)

    def budget_holding(self, experts: int | None = None, per_layer: bool = False) -> int:
        """The smallest budget that gives every pool room for `experts` at once (default: all
        the experts of one of its layers), for each of its layers if `per_layer` (a split)."""
        need = 0
        for group in self.layer_groups():
            layer, group_bytes = self.layers[group[0]], self._group_bytes(group)
            n = min(experts or layer.num_experts, layer.num_experts)  # a host's share may
            slots = n * (len(group) if per_layer else 1)  # hold fewer than top-k
            need = max(need, -(-self.pool_bytes(group, slots) * self.expert_bytes // group_bytes))
        return need

    def pool_bytes(self, group: list[int], experts: int) -> int:
        """The memory `experts` resident experts of a group may hold: a slot's bytes each, and
        no more than the whole group's (whose rows then share no page with a stranger)."""
        return min(experts * self.layers[group[0]].slot_bytes, self._group_bytes(group))

    @property
    def identity(self) -> dict:
        """What a profile records to refuse being applied to another model."""
        shapes = [(l.path, l.num_experts) for l in self.layers]
        digest = hashlib.sha256(json.dumps([self.config_hash, shapes]).encode()).hexdigest()
        return {"model_type": self.model_type, "moe_layers": self.num_layers,
                "experts": self.num_experts, "top_k": self.top_k, "fingerprint": digest[:16]}

    def host_share(self, host: int, hosts: int) -> ModelPlan:
        """The plan of one host of `hosts` that each serve a contiguous range of every layer's
        experts (expert parallelism): its budget, pools and caches cover its experts alone."""
        layers = []
        for l in self.layers:
            first, end = host * l.num_experts // hosts, (host + 1) * l.num_experts // hosts
            if end == first:
                raise ValueError(f"{l.path} has {l.num_experts} experts: too few for {hosts} hosts")
            layers.append(ExpertLayer(l.path, end - first, l.specs, first, l.num_experts,
                                      l.held_bytes))
        return ModelPlan(self.model_type, self.top_k, layers, self.dense_bytes, self.config_hash)

    def describe(self) -> dict:
        """What `inspect` shows. Layers quantized apart have experts of other sizes: the
        largest (which the minimum budget holds) and the smallest."""
        sizes = [layer.expert_bytes for layer in self.layers]
        smallest = {"smallest_expert_bytes": min(sizes)} if min(sizes) < max(sizes) else {}
        return {
            "model_type": self.model_type,
            "moe_layers": self.num_layers,
            "experts": self.num_experts,
            "top_k": self.top_k,
            "expert_bytes": max(sizes),
            **smallest,
            "all_expert_bytes": self.expert_bytes,
            "dense_bytes": self.dense_bytes,
            "min_budget_bytes": self.min_budget_bytes,
            "min_budget_bytes_per_layer": self.budget_holding(self.top_k, per_layer=True),
        }


def read_config(model_dir: Path) -> dict:
    """config.json with generation_config.json's eos_token_id, as mlx-lm reads it: the config a
    profile's identity hashes, the same on every backend."""
    config = read_json(model_dir / "config.json", "unreadable config")
    try:
        generation = read_json(model_dir / "generation_config.json", "unreadable config")
    except ValueError:  # none, or one mlx-lm ignores too
        generation = {}
    if eos := generation.get("eos_token_id"):
        config["eos_token_id"] = eos
    return config


def check_layer_count(config: dict, tensors: int) -> None:
    """Refuse more layers in config.json than the checkpoint has tensors (a layer has at least
    one): mlx-lm and transformers would build every layer, gigabytes, before failing."""
    for source in (config, config.get("text_config")):
        layers = source.get("num_hidden_layers") if isinstance(source, dict) else None
        if isinstance(layers, int) and layers > tensors:
            raise ValueError(f"config.json has num_hidden_layers = {layers} but the checkpoint "
                             f"holds {tensors} tensors (a layer has at least one)")


def config_hash(config: dict) -> str:
    kept = {k: v for k, v in config.items() if k not in STORAGE_KEYS}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()


def path_key(path: str) -> list:
    """Sort key of a module path: numbered parts in numeric order (layers.10 after layers.9)."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.split(".")]


def top_k_of(config: dict) -> int:
    """Experts per token, from whichever key the model's config.json uses; the most of any
    layer where it is listed per layer (Hunyuan)."""
    model_type = config.get("model_type", "?")
    for source in (config, config.get("text_config", {})):
        for key in TOP_K_KEYS:
            value = source.get(key)
            values = value if isinstance(value, list) and value else [value]
            if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
                if min(values) < 1:
                    raise ValueError(f"model_type '{model_type}': config.json has {key} = "
                                     f"{value}: a token must use at least one expert")
                return max(values)
    raise ValueError(f"model_type '{model_type}': config.json names no experts-per-token (top-k)")
