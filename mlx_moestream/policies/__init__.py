"""Eviction policies: which resident expert leaves when the slot pool is full.

`ExpertCache` owns residency and asks a policy only to rank; the live runtime, trace replay and
every backend share the policies. Each registers its name (`Policy.registry`), from which
`make_policy` builds it. The modules of the compiled policies (`cyclic`, `age`) are imported
only when a name needs them, so the pure-Python policies run without the build.
"""

from __future__ import annotations

import inspect
from importlib import import_module

from .base import Policy
from .belady import Belady
from .classic import LFU, LRU, SLRU
from .future import Future
from .markov import LayerMarkov
from .nextcall import NextCall
from .wlfu import WindowLFU

__all__ = ["DEFAULT_POLICY", "LFU", "LRU", "POLICIES", "SLRU", "Belady", "Future",
           "LayerAge", "LayerCyclic", "LayerMarkov", "NextCall", "Policy", "WindowLFU",
           "make_policy", "parse_policy", "policy_class"]

DEFAULT_POLICY = "cyclic"
COMPILED = {"LayerCyclic": ".cyclic", "LayerAge": ".age"}  # the modules of the compiled ones


def __getattr__(name: str):
    """`POLICIES` (every policy by name), `LayerCyclic` and `LayerAge`, once the compiled part
    imports."""
    if name == "POLICIES":
        return _registry()
    if name in COMPILED:
        return getattr(import_module(COMPILED[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _registry(name: str | None = None) -> dict[str, type[Policy]]:
    """Every policy by name; the compiled policies' modules are imported unless `name` is a
    policy registered without them."""
    if name not in Policy.registry:
        for module in COMPILED.values():
            import_module(module, __name__)
    return Policy.registry


def make_policy(spec: str, capacity: int, num_keys: int, num_experts: int | None = None,
                **options) -> Policy:
    """The policy a spec names (see `parse_policy`); `options` add to the spec's own.

    Keys are `layer * num_experts + expert`; a `layered` policy is told `num_experts`.
    """
    name, spec_options = parse_policy(spec)
    cls = Policy.registry[name]
    if cls.layered:
        options["num_experts"] = num_experts
    return cls(capacity, num_keys, **spec_options, **options)


def policy_class(spec: str) -> type[Policy]:
    """The class of the policy a spec names, whose traits say how to build it."""
    return Policy.registry[parse_policy(spec)[0]]


def parse_policy(spec: str) -> tuple[str, dict]:
    """Split `NAME` or `NAME:OPTION=VALUE,...` (`wlfu:half_life=128`, `slru:protected_share=0.5`).

    Returns:
        The policy's name and its constructor options, typed like their defaults.
    """
    name, _, rest = str(spec).partition(":")
    policies = _registry(name)
    if name not in policies:
        raise ValueError(f"unknown policy {name!r}; choose one of: {', '.join(sorted(policies))}")
    params = {
        p.name: p.default for p in inspect.signature(policies[name]).parameters.values()
        if p.default is not inspect.Parameter.empty and p.default is not None
    }
    options = {}
    for item in filter(None, (i.strip() for i in rest.split(","))):
        key, _, value = (part.strip() for part in item.partition("="))
        if key not in params:
            known = ", ".join(sorted(params)) or "none"
            raise ValueError(f"policy {name!r} has no option {key!r} (its options: {known})")
        kind = type(params[key])
        try:
            options[key] = kind(value)
        except ValueError:
            wanted = "an integer" if kind is int else "a number"
            raise ValueError(f"policy option {name}:{key} takes {wanted}, got {value!r}") from None
    return name, options
