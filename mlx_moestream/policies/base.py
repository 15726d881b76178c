"""The interface every eviction policy implements, its registry, and the helpers policies share.

Plain Python and numpy, so the pure-Python policies import without the compiled module.
"""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np


def all_in_use() -> RuntimeError:
    """The error of a `victims` call that finds every resident key protected."""
    return RuntimeError("every resident expert is in use by the current call")


class Policy:
    """Orders resident keys for eviction. The cache owns residency; a policy only ranks.

    A key is `layer * num_experts + expert`, below `num_keys`, so state can live in numpy
    arrays indexed by key. A call's misses come as one `victims` then one `access`, so a policy
    can choose them together and count the call in one update. A subclass given `name=`
    registers under that name, for `make_policy`; its traits tell callers how to build it.
    """

    registry: ClassVar[dict[str, type[Policy]]] = {}
    layered: ClassVar[bool] = False  # takes `num_experts`: a key's layer is `key // num_experts`
    offline: ClassVar[bool] = False  # takes `future`, the keys a replay will use: replay only

    def __init_subclass__(cls, name: str | None = None, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if name is not None:
            Policy.registry[name] = cls

    def __init__(self, capacity: int, num_keys: int):
        self.capacity = capacity
        self.num_keys = num_keys

    def access(self, keys: list[int], new: list[int] = ()) -> None:
        """`keys` were used by one call: distinct, at least one, a list the policy may keep (the
        caller leaves it unchanged); `new` lists those that just became resident (its misses)."""
        raise NotImplementedError

    def insert(self, keys: list[int]) -> None:
        """`keys` became resident without a use (a prefetch): ranked as unused until a call uses
        them, so a wrong prediction is the first to go."""
        raise NotImplementedError

    def victims(self, n: int, protected: set[int]) -> list[int]:
        """Remove and return the next `n` keys to evict, never one of `protected` (the keys of
        the current call)."""
        raise NotImplementedError

    def remove(self, key: int) -> None:
        """`key` left without an eviction."""
        raise NotImplementedError

    def warm(self, keys: list[int]) -> None:
        """`keys` became resident by a pre-warm, on the strength of seeded counts."""
        for key in keys:
            self.access([key], [key])

    def tick(self, tokens: int) -> None:
        """Advance the token clock by `tokens`."""

    def seed(self, counts: dict[int, float]) -> None:
        """Start from a saved activation profile, `{key: count}`."""


class Resident:
    """Resident keys packed at the front of an array, so choosing a victim is one argmin."""

    def __init__(self, num_keys: int):
        self.keys = np.zeros(num_keys, np.int64)
        self.pos = np.full(num_keys, -1, np.int64)  # index of the key in `keys`, -1 if absent
        self.n = 0

    @property
    def active(self) -> np.ndarray:
        return self.keys[: self.n]

    def add(self, key: int) -> None:
        if self.pos[key] >= 0:
            raise KeyError(f"key {key} is already resident")
        self.keys[self.n] = key
        self.pos[key] = self.n
        self.n += 1

    def drop(self, key: int) -> None:
        i = self.pos[key]
        if i < 0:
            raise KeyError(f"key {key} is not resident")
        self.n -= 1
        moved = self.keys[self.n]
        self.keys[i] = moved
        self.pos[moved] = i
        self.pos[key] = -1

    def pop_min(self, score: np.ndarray, protected: set[int], tie: np.ndarray | None = None,
                or_none: bool = False) -> int | None:
        """Drop and return the key of least `score`, skipping `protected`.

        Args:
            score: one float per `active` key, overwritten.
            tie: among equal scores, the key of least `tie[key]` goes.
            or_none: when every key is protected, return None rather than raise.
        """
        if protected:
            at = self.pos[list(protected)]
            score[at[at >= 0]] = np.inf
        i = int(score.argmin()) if len(score) else -1
        if i < 0 or score[i] == np.inf:
            if or_none:
                return None
            raise all_in_use()
        if tie is not None:
            equal = (score == score[i]).nonzero()[0]
            if len(equal) > 1:
                i = int(equal[tie[self.keys[equal]].argmin()])
        key = int(self.keys[i])
        self.drop(key)
        return key


def check_tokens(value: int, option: str = "half_life") -> None:
    """Refuse a policy option counted in tokens below 1."""
    if value < 1:
        raise ValueError(f"{option} must be at least 1 token, got {value}")


def check_blend(half_life: int, freq_share: float) -> None:
    """Refuse options of a blend of use rate and learned rate (`cyclic`, `age`) out of range."""
    check_tokens(half_life)
    if not 0.0 <= freq_share < 1.0:
        raise ValueError(f"freq_share must be in [0, 1), got {freq_share}")


def decay_per_token(half_life: int) -> float:
    """The share a count halving every `half_life` tokens loses per token: steady use, one per
    token, adds up to `1 / it`."""
    return 1.0 - 0.5 ** (1.0 / half_life) or math.log(2) / half_life  # exact form: 0 past 2**53


def add_counts(count: np.ndarray, counts: dict[int, float], weight: float = 1.0) -> None:
    """Add seeded `counts` ({key: count}), times `weight`, to `count`, refusing bad ones and
    any sum a float cannot hold (a NaN count makes every comparison false)."""
    keys = np.fromiter(counts.keys(), np.int64, len(counts))
    values = np.fromiter(counts.values(), np.float64, len(counts))
    if len(keys) and (keys.min() < 0 or keys.max() >= len(count)):
        raise ValueError(f"seed keys must be in [0, {len(count)}), got {keys.min()}..{keys.max()}")
    if not np.isfinite(values).all() or (values < 0).any():
        raise ValueError("seed counts must be finite and non-negative")
    added = count.copy()
    with np.errstate(over="ignore"):  # an overflow is refused below, not warned of
        np.add.at(added, keys, values * weight)
    if not np.isfinite(added).all():
        raise ValueError("seed counts too large: the policy's counts overflow")
    count[:] = added


class ScoredCyclic(Policy):
    """`cyclic`'s rule in numpy over a `p` a subclass predicts for every key (`markov`):
    the victims are the keys of least `p / d`, prefetched keys that no call used first. A victim
    search reads every key, which suits replay."""

    layered = True

    def __init__(self, capacity: int, num_keys: int, num_experts: int | None = None):
        super().__init__(capacity, num_keys)
        self.experts = num_experts or num_keys
        self.layers = -(-num_keys // self.experts)
        self.state = np.zeros(self.layers * self.experts, np.int8)  # 0 out, 1 unused, 2 used
        self.position = 0  # layer of the current call

    def use_chances(self) -> np.ndarray:
        """`[layers, experts]`: each key's predicted chance of a use at its layer's coming call."""
        raise NotImplementedError

    def insert(self, keys: list[int]) -> None:
        self.state[keys] = 1

    def warm(self, keys: list[int]) -> None:
        self.state[keys] = 2

    def remove(self, key: int) -> None:
        self.state[key] = 0

    def victims(self, n: int, protected: set[int]) -> list[int]:
        distance = (np.arange(self.layers) - self.position - 1) % self.layers + 1
        score = (self.use_chances() / distance[:, None]).ravel()
        score[self.state == 0] = np.inf
        score[self.state == 1] = -1.0
        if protected:
            score[list(protected)] = np.inf
        order = np.argsort(score, kind="stable")[:n]  # among equals, the least key
        if len(order) < n or score[order[-1]] == np.inf:
            raise all_in_use()
        self.state[order] = 0
        return order.tolist()
