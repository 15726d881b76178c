"""Residency of experts in a slot pool; the eviction policies live in `policies`.

Plain Python and numpy (no mlx): the live runtime, trace replay and any other backend all use
these same classes. A key is `layer * num_experts + expert`.
"""

from __future__ import annotations

import math
import numbers
from functools import partial
from typing import Callable, Sequence

import numpy as np

from .policies import DEFAULT_POLICY, Policy, make_policy
from .profiles import Profile

# A profile's hottest expert in a layer starts as if used this many times recently: enough to
# outweigh one-off live misses, few enough that a wrong profile's experts lose to the live
# workload's within a few dozen tokens.
SEED_USES = 4.0


def split_slots(
    total_slots: int, weights: Sequence[float], minimum: int, maximum: int | None = None
) -> list[int]:
    """Slots per layer, proportional to `weights`, each in [minimum, maximum], summing to at most
    `total_slots` (exactly, unless every layer is at `maximum`).

    Equal weights give a uniform partition; a profile (each layer's working-set size, routing
    entropy) gives more slots to the layers that spread over more experts. The ideal share of a
    layer is clip(scale * weight, minimum, maximum) with `scale` found so the shares fill the
    budget; shares are rounded down and the slots left over go to the largest remainders.
    """
    w = np.asarray(weights, np.float64)
    n = len(w)
    if n == 0 or not np.isfinite(w).all() or (w < 0).any():
        raise ValueError("weights must be one finite, non-negative number per layer")
    if maximum is not None and maximum < minimum:
        raise ValueError(f"maximum {maximum} is below minimum {minimum}")
    if total_slots < n * minimum:
        raise ValueError(
            f"{total_slots} slots cannot give each of {n} layers its minimum of {minimum}"
        )
    if w.sum() == 0:
        w = np.ones(n)
    high = np.inf if maximum is None else maximum

    def shares(scale: float) -> np.ndarray:
        return np.clip(scale * w, minimum, high)

    most = np.where(w > 0, high, minimum)
    if most.sum() <= total_slots:  # every weighted layer is at `maximum`: the rest, evenly, to
        unused = w == 0  # the layers the weights left at their minimum
        if unused.any():
            left = total_slots - int(most[~unused].sum())
            most[unused] = split_slots(left, np.ones(int(unused.sum())), minimum, maximum)
        return most.astype(np.int64).tolist()
    lo, hi = 0.0, total_slots / w[w > 0].min()  # shares(lo) sum below the budget, hi's not
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if shares(mid).sum() < total_slots else (lo, mid)
    ideal = shares(lo)
    slots = np.floor(ideal).astype(np.int64)
    spare = int(total_slots - slots.sum())
    order = np.argsort(slots - ideal, kind="stable")  # largest remainder first
    slots[order[:spare]] += 1
    return slots.tolist()


def make_held(held: list[tuple[Callable, tuple]]) -> None:
    """Make the calls `held` back (`(function, args)`) in order, each leaving the list once
    made: an error in one leaves the rest held."""
    while held:
        function, args = held[0]
        function(*args)
        del held[0]


def check_shares(share: float, pin_share: float) -> None:
    if not all(isinstance(x, numbers.Real) and not isinstance(x, bool) and 0.0 <= x <= 1.0
               for x in (share, pin_share)):
        raise ValueError(f"pre-warm and pin shares must be in [0, 1] of the budget, got "
                         f"{share!r} and {pin_share!r}")


class ExpertCache:
    """Maps (layer, expert) to slots of one pool of `num_slots`; evicts by policy when full.

    With one policy for all layers the budget is global; with `layer_slots` (see `split_slots`)
    each layer owns a policy and at most `layer_slots[layer]` slots. `policy` is a name from
    `POLICIES` or a factory taking the capacity (replay passes a `Belady` that knows the future).
    `num_layers` counts every layer of the model (keys are global); `layers` are this pool's.
    The cache counts nothing: each call reports its hits, loads and evicted keys to the caller.

    Policy updates that decide nothing for the call making them (its uses, a token's tick)
    are held until the next decision or `catch_up`, in order: the runtime catches up while the
    device computes the call, off the path from routing to compute.
    """

    def __init__(
        self,
        num_slots: int,
        layers: list[int],
        num_experts: int,
        num_layers: int,
        policy: str | Callable[[int], Policy] = DEFAULT_POLICY,
        layer_slots: list[int] | None = None,
    ):
        self.num_slots = num_slots
        self.num_experts = num_experts
        self.slot_of = np.full((num_layers, num_experts), -1, np.int32)
        # written one item at a time per call, as a memoryview: half numpy's cost
        self.slot_by_key = memoryview(self.slot_of.reshape(-1))  # slot_of, indexed by key
        self.key_of = np.arange(num_layers * num_experts).reshape(num_layers, num_experts)
        self.free = list(range(num_slots - 1, -1, -1))
        self.pinned = np.zeros(num_layers * num_experts, np.bool_)
        self._pinned = memoryview(self.pinned)  # read one key at a time
        self.pinned_count = np.zeros(num_layers, np.int64)
        self.pinned_total = 0  # in every layer
        self.per_layer = layer_slots is not None
        if isinstance(policy, str):
            new_policy = partial(make_policy, policy, num_keys=num_layers * num_experts,
                                 num_experts=num_experts)
        else:
            new_policy = policy
        if layer_slots is None:
            shared = new_policy(num_slots)
            self.policy_of = {layer: shared for layer in layers}
            self.limit = {layer: num_slots for layer in layers}
        else:
            self.policy_of = {l: new_policy(n) for l, n in zip(layers, layer_slots)}
            self.limit = dict(zip(layers, layer_slots))
        self.policies = list({id(p): p for p in self.policy_of.values()}.values())
        self.held: list[tuple[Callable, tuple]] = []  # policy updates not made yet, in order
        # every expert of these layers can have a slot of its own: no slot is ever reused
        self.holds_all = all(n >= num_experts for n in self.limit.values()) and (
            num_slots >= len(layers) * num_experts)

    def capacity(self, layer: int) -> int:
        """How many distinct experts one call of `layer` can have resident at once."""
        pinned = self.pinned_count[layer] if self.per_layer else self.pinned_total
        return self.limit[layer] - int(pinned)

    def request(self, layer: int, experts: list[int]) -> tuple[list[tuple[int, int]], int, list[int]]:
        """Make `experts` (distinct, at most `capacity(layer)`) resident.

        Returns the (expert, slot) pairs the caller must load before computing (its misses),
        the number of hits, and the keys evicted for the loads. A call names a handful of
        experts, so the work is on plain lists: each numpy call on a tiny array costs more
        than the Python loop it replaces, and more still right after the host waited for the
        device (its code and data have left the CPU caches).
        """
        policy = self.policy_of[layer]
        base = layer * self.num_experts
        keys = [base + e for e in experts]
        pinned_hits = 0
        if self.pinned_total:  # pinned keys are outside the policy
            pinned = self._pinned
            kept = [i for i, key in enumerate(keys) if not pinned[key]]
            pinned_hits = len(keys) - len(kept)
            keys, experts = [keys[i] for i in kept], [experts[i] for i in kept]
        slot_by_key = self.slot_by_key
        slots = [slot_by_key[key] for key in keys]
        if -1 not in slots:  # all resident: the hot path
            if keys:  # else every expert of the call is pinned: nothing for the policy
                self.held.append((policy.access, (keys,)))
            return [], pinned_hits + len(slots), []
        missing = [i for i, s in enumerate(slots) if s < 0]
        new = [keys[i] for i in missing]
        loads, evicted = self._place(layer, policy, [experts[i] for i in missing], new,
                                     set(keys))
        self.held.append((policy.access, (keys, new)))
        return loads, pinned_hits + len(slots) - len(missing), evicted

    def catch_up(self) -> None:
        """Make the policy updates held so far (see the class docstring)."""
        make_held(self.held)

    def prefetch(self, layer: int, experts: np.ndarray, protected: set[int]
                 ) -> tuple[list[tuple[int, int]], list[int]]:
        """Make predicted `experts` resident ahead of need, through the policy like any load.

        Leaves resident experts untouched; never evicts a key in `protected` (those a pending
        computation still reads). The policy ranks the new keys as unused until a call routes
        to them. Returns the loads to issue and the keys evicted for them.
        """
        experts = self.missing(layer, experts).tolist()
        keys = [layer * self.num_experts + e for e in experts]
        policy = self.policy_of[layer]
        placed = self._place(layer, policy, experts, keys, protected | set(keys))
        policy.insert(keys)
        return placed

    def _place(self, layer: int, policy: Policy, experts: list[int], keys: list[int],
               protected: set[int]) -> tuple[list[tuple[int, int]], list[int]]:
        """Give non-resident `experts` slots: free ones first, then the policy's victims (one
        batch for the whole call). Returns the (expert, slot) pairs to load and the victims."""
        n = len(experts)
        if not n:
            return [], []
        if self.held:
            self.catch_up()
        free = min(n, len(self.free))
        if self.per_layer:
            free = max(0, min(free, self.limit[layer] - self.resident_in(layer)))
        slots = [self.free.pop() for _ in range(free)]
        slot_by_key = self.slot_by_key
        victims = policy.victims(n - free, protected) if free < n else []
        for victim in victims:
            slots.append(slot_by_key[victim])
            slot_by_key[victim] = -1
        for key, slot in zip(keys, slots):
            slot_by_key[key] = slot
        return list(zip(experts, slots)), victims

    def slots(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """The slots of resident `experts` of `layer` (-1 where not resident). A decode call's
        handful are looked up one by one: right after a host sync, numpy's fancy indexing
        costs 10-25 us there, the list 1-3 (see `request`)."""
        if experts.size > 64:
            return self.slot_of[layer][experts]
        base, slot_by_key = layer * self.num_experts, self.slot_by_key
        return np.array([slot_by_key[base + e] for e in experts.reshape(-1).tolist()],
                        np.int32).reshape(experts.shape)

    def missing(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """Those of `experts` that are not resident."""
        return experts[self.slot_of[layer][experts] < 0]

    def holds_layer(self, layer: int) -> bool:
        """Whether every expert of `layer` is resident."""
        return bool((self.slot_of[layer] >= 0).all())

    def pinned_in(self, layer: int) -> int:
        return int(self.pinned_count[layer])

    def discard(self, layer: int, expert: int) -> bool:
        """Forget a resident expert whose load failed, so its slot is never read as valid;
        whether it was resident (a load may be finished twice, after an interrupt). A pinned
        one (pinned while its read was in flight) is unpinned: a pinned key counts as a hit."""
        slot = int(self.slot_of[layer, expert])
        if slot < 0:
            return False
        self.catch_up()
        key = int(self.key_of[layer, expert])
        if self.pinned[key]:  # out of its policy since it was pinned
            self.pinned[key] = False
            self.pinned_count[layer] -= 1
            self.pinned_total -= 1
        else:
            self.policy_of[layer].remove(key)
        self.slot_of[layer, expert] = -1
        self.free.append(slot)
        return True

    def tick(self, tokens: int) -> None:
        if self.held:  # at most one token's updates are held, whoever calls (replay: no one)
            self.catch_up()
        self.held += [(policy.tick, (tokens,)) for policy in self.policies]

    def admit(self, layer: int, expert: int) -> int | None:
        """Pre-warm: give an expert a free slot (never evicting); None when none is left."""
        if (self.slot_of[layer, expert] >= 0 or not self.free
                or self.resident_in(layer) >= self.limit[layer]):
            return None
        slot = self.free.pop()
        self.slot_of[layer, expert] = slot
        self.catch_up()
        self.policy_of[layer].warm([int(self.key_of[layer, expert])])
        return slot

    def admit_layer(self, layer: int) -> list[int]:
        """A full-budget load: give every expert of `layer` a free slot, in expert order, in
        one step (as many `admit`s would)."""
        if self.resident_in(layer) or len(self.free) < self.num_experts:
            raise ValueError(f"layer {layer} cannot take a slot for each of its experts")
        slots = [self.free.pop() for _ in range(self.num_experts)]
        self.slot_of[layer] = slots
        self.catch_up()
        self.policy_of[layer].warm(self.key_of[layer].tolist())
        return slots

    def prewarm_plan(self, profile: Profile, share: float, pin_share: float, call_experts: int
                     ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Seed the policies with `profile`'s counts (each layer's hottest expert counting
        `SEED_USES`) and choose what to pre-warm: the hottest experts that fit in `share` of
        the slots and the hottest to pin in `pin_share` (leaving each partition room for one
        call's `call_experts` unpinned), both in the first list, in file order (layer, expert).
        The caller `admit`s the first and loads them, then `pin`s the second, those that got a
        slot: the runtime and replay pre-warm alike. Mid-session, the hottest experts that are
        resident already are pinned as they are; the others are read into free slots, as
        many as each partition has room for."""
        check_shares(share, pin_share)
        layers = self.policy_of
        hot = profile.hottest(self.num_slots, [int(self.limit[l]) if l in layers else 0
                                               for l in range(len(self.slot_of))])
        soft = max(0, int(self.num_slots * share) - self.resident)
        # pins of an earlier pre-warm count: toward the share and the room left for a call
        pins, pinned = [], self.pinned_count.copy()
        unpinned = [(l, e) for l, e in hot if not self.pinned[self.key_of[l, e]]]
        for layer, expert in unpinned[: max(0, int(self.num_slots * pin_share) - self.pinned_total)]:
            used = pinned[layer] if self.per_layer else pinned.sum()
            if used + 1 <= self.limit[layer] - call_experts:
                pinned[layer] += 1
                pins.append((layer, expert))
        seed = profile.seed_counts(SEED_USES)
        self.seed({int(self.key_of[l, e]): float(seed[l, e])
                   for l in layers for e in np.flatnonzero(seed[l])})
        reads = {p for p in pins if self.slot_of[p] < 0}
        # the room left in each partition, pins read first (one shared pool: `soft` alone)
        room = {l: self.limit[l] - self.resident_in(l) if self.per_layer else math.inf
                for l in layers}
        for layer, _ in reads:
            room[layer] -= 1
        for pick in hot:
            if soft <= 0:
                break
            if self.slot_of[pick] >= 0:
                continue
            if pick in reads:  # a pin among the hottest counts toward the share
                soft -= 1
            elif room[pick[0]] > 0:
                reads.add(pick)
                soft -= 1
                room[pick[0]] -= 1
        return sorted(reads), pins

    def pin(self, layer: int, expert: int) -> None:
        """Keep a resident expert for good: it leaves its policy, so it is never a victim."""
        key = int(self.key_of[layer, expert])
        if self.slot_of[layer, expert] < 0:
            raise ValueError(f"layer {layer} expert {expert} is not resident: cannot pin it")
        if not self.pinned[key]:
            self.catch_up()
            self.policy_of[layer].remove(key)
            self.pinned[key] = True
            self.pinned_count[layer] += 1
            self.pinned_total += 1

    def seed(self, counts: dict[int, float]) -> None:
        """Start the policies' frequency state from a saved activation profile `{key: count}`."""
        self.catch_up()
        for policy in self.policies:
            policy.seed(counts)

    def resident_in(self, layer: int) -> int:
        """Experts of `layer` holding a slot, pinned ones included."""
        return int(np.count_nonzero(self.slot_of[layer] >= 0))

    @property
    def resident(self) -> int:
        return self.num_slots - len(self.free)
