"""Eviction policies: which resident expert leaves when the slot pool is full.

`ExpertCache` owns residency (slots, counts, partitions) and asks a policy only to rank. A key is
`layer * num_experts + expert`; every policy is built as `Policy(capacity, num_keys)`, where
`num_keys` bounds the keys (all layers' experts) so state can live in numpy arrays indexed by key.
Plain Python and numpy (no mlx), the default's core compiled (`_cyclic.pyx`): the live runtime,
trace replay and any other backend share them.
"""

from __future__ import annotations

import hashlib
import inspect
import math
from collections import OrderedDict
from pathlib import Path

import numpy as np

try:
    from mlx_moestream import _cyclic
except ModuleNotFoundError:  # a checkout used as it is
    raise ImportError("mlx_moestream's compiled part (_cyclic.pyx) is not built: run "
                      "`pip install -e .` in the checkout") from None

DEFAULT_POLICY = "cyclic"


def _check_build() -> None:
    """In a checkout, the compiled policy must be built from the source beside this file: after
    a pull that changed it, or with another checkout's build found through a shared
    environment, it would run other code than the source reads. A wheel has no source."""
    source = Path(__file__).with_name("_cyclic.pyx")
    if (source.exists()
            and hashlib.sha256(source.read_bytes()).hexdigest() != _cyclic.SOURCE_DIGEST):
        raise ImportError(f"{source} is not the source of mlx_moestream's compiled part "
                          f"({_cyclic.__file__}): run `pip install -e .` in this checkout")


_check_build()


class Policy:
    """Orders resident keys for eviction. The cache owns residency; a policy only ranks.

    Calls: `access(keys, new)` with the keys one call used (distinct, at least one, a list the
    policy may keep; the caller does not change it), `new` listing those that just became
    resident for it (its misses); `insert(keys)` when keys become resident without a use (a
    prefetch: ranked as unused until a call uses it, so a wrong prediction is the first to go);
    `victims(n, protected)` to remove and return the next `n` keys to evict (never one in
    `protected`, the keys of the current call); `remove(key)` when a key leaves without eviction;
    `tick(tokens)` to advance the token clock; `seed(counts)` to start from a saved activation
    profile (`{key: count}`). A call's misses come as one `victims` then one `access`, so a
    policy can choose them together and count the call in one update.
    """

    def __init__(self, capacity: int, num_keys: int):
        self.capacity = capacity
        self.num_keys = num_keys

    def access(self, keys: list[int], new: list[int] = ()) -> None:
        raise NotImplementedError

    def insert(self, keys: list[int]) -> None:
        raise NotImplementedError

    def victims(self, n: int, protected: set[int]) -> list[int]:
        raise NotImplementedError

    def remove(self, key: int) -> None:
        raise NotImplementedError

    def warm(self, keys: list[int]) -> None:
        """`keys` became resident by a pre-warm, on the strength of seeded counts."""
        for key in keys:
            self.access([key], [key])

    def tick(self, tokens: int) -> None:
        pass

    def seed(self, counts: dict[int, float]) -> None:
        pass


class LRU(Policy):
    """Evicts the least recently used key."""

    def __init__(self, capacity: int, num_keys: int):
        super().__init__(capacity, num_keys)
        self.order: OrderedDict[int, None] = OrderedDict()

    def access(self, keys: list[int], new: list[int] = ()) -> None:
        move = self.order.move_to_end
        for key in keys:
            if key not in new:
                move(key)
        self.order.update(dict.fromkeys(new))  # the misses, after the hits

    def insert(self, keys: list[int]) -> None:
        self.order.update(dict.fromkeys(keys))
        for key in keys:
            self.order.move_to_end(key, last=False)

    def victims(self, n: int, protected: set[int]) -> list[int]:
        return [_pop_oldest(self.order, protected) for _ in range(n)]

    def remove(self, key: int) -> None:
        del self.order[key]


class LFU(Policy):
    """Evicts the resident key used least often; the least recently used among equals.

    Counts are exact (one per call that used the key) and kept for keys that are not resident,
    so a returning expert is remembered. They never decay: see `WindowLFU` for that.
    """

    def __init__(self, capacity: int, num_keys: int):
        super().__init__(capacity, num_keys)
        self.count = np.zeros(num_keys)
        self.last_use = np.zeros(num_keys, np.int64)  # value of `uses` at the key's latest use
        self.uses = 0
        self.resident = _Resident(num_keys)

    def access(self, keys: list[int], new: list[int] = ()) -> None:
        self.uses += 1
        self.count[keys] += 1
        self.last_use[keys] = self.uses
        self.insert(new)

    def insert(self, keys: list[int]) -> None:
        for key in keys:
            self.resident.add(key)

    def victims(self, n: int, protected: set[int]) -> list[int]:
        resident = self.resident
        return [resident.pop_min(self.count[resident.active], protected, tie=self.last_use)
                for _ in range(n)]

    def remove(self, key: int) -> None:
        self.resident.drop(key)

    def seed(self, counts: dict[int, float]) -> None:
        _add_counts(self.count, counts)


MAX_RECENT_TOKENS = 1024  # WindowLFU's guard keeps a list this long, updated every token


class WindowLFU(Policy):
    """LFU over a sliding window, behind a short recency guard.

    Counts decay by half each time the token clock crosses a multiple of `half_life`, so a use
    `half_life` tokens ago weighs half a use now: the cache follows a workload that shifts
    mid-session, experts it stops using decay out, and counts of experts that left keep growing
    until they win a slot back. Seeded counts decay the same way. Among equal counts the least
    recently used goes first.

    Experts used in the last `recent_tokens` tokens (this one and the previous, by default) are
    evicted only when no other resident is left: consecutive tokens share many experts, and
    frequency alone would evict a just-used expert with a short history. When those experts
    fill more than `guard_share` of the capacity, only the current token's are guarded, so the
    policy does not decay into LRU at small budgets. On synthetic traces with strong
    token-to-token reuse the guard turns a 5-19 point loss to LRU into a gain.

    Cost (the default policy runs on every MoE layer call): nothing is rescanned per use.
    Instead of halving every count, a use adds `2 ** (tokens // half_life)`, which keeps the
    order (counts are rescaled rarely, to stay finite). Counts are read only to rank, so a
    call's uses are added to them in one batch per token (or at the next ranking). A use cannot
    make an expert evictable within its token, so the evictable experts are ranked once per
    token, least count first, and victims are read off that order; only the lowest
    `_RANK_SIZE` counts are sorted, more when a token evicts more, and a token's ranking reads
    only the keys counted below where the previous one stopped.
    """

    def __init__(self, capacity: int, num_keys: int, half_life: int = 64, recent_tokens: int = 2,
                 guard_share: float = 0.75):
        super().__init__(capacity, num_keys)
        if half_life < 1:
            raise ValueError(f"half_life must be at least 1 token, got {half_life}")
        if not 1 <= recent_tokens <= MAX_RECENT_TOKENS:  # a longer guard holds every key
            raise ValueError(f"recent_tokens must be in [1, {MAX_RECENT_TOKENS}], got "
                             f"{recent_tokens}")
        if not 0.0 <= guard_share <= 1.0:
            raise ValueError(f"guard_share must be in [0, 1], got {guard_share}")
        self.half_life = half_life
        self.guard_limit = capacity * guard_share
        self.count = np.zeros(num_keys)  # decayed uses, times `weight`, but for `pending`
        self.pending: list[np.ndarray] = []  # keys of the calls not yet added to `count`
        self.weight = 1.0  # what one use adds now
        self.rescaled = 0  # halvings already applied to `count`
        self.tokens = 0
        self.uses = 0  # calls to `access` so far
        self.now = np.zeros((), np.int64)  # `uses` as an array: numpy assigns it without converting
        self.last_use = np.zeros(num_keys, np.int64)  # `uses` at the key's latest use; 0: never
        self.starts = [0] * recent_tokens  # `uses` before each guarded token, oldest first
        self.resident = np.zeros(num_keys, np.bool_)
        # the same memory, read and written one key at a time at half numpy's cost per item
        self._last_use, self._resident = memoryview(self.last_use), memoryview(self.resident)
        self.guarded = 0  # guarded residents at the latest count, plus
        self.touched = 0  # keys used since then (a bound on the guarded ones added)
        self.evictable_below = 0  # keys used after `uses` reached this are guarded
        self.bound = np.inf  # a token's first ranking reads only the keys counted at most this
        self._forget_order()

    def access(self, keys: list[int], new: list[int] = ()) -> None:
        self.uses += 1
        self.now[()] = self.uses
        self.touched += len(keys)
        self.pending.append(keys)
        self.last_use[keys] = self.now
        resident = self._resident
        for key in new:
            resident[key] = True

    def insert(self, keys: list[int]) -> None:
        self.resident[keys] = True

    def remove(self, key: int) -> None:
        self._resident[key] = False
        self._forget_order()

    def victims(self, n: int, protected: set[int]) -> list[int]:
        if self.level == 0 and self.guarded + self.touched > self.guard_limit:
            self._forget_order()  # the guard may be over its share: rank again, counting
        chosen: list[int] = []
        resident, last_use = self._resident, self._last_use
        while True:
            order, below = self.order, self.evictable_below
            for i in range(self.next, len(order)):
                key = order[i]
                if last_use[key] <= below and key not in protected:
                    resident[key] = False
                    chosen.append(key)
                    if len(chosen) == n:
                        self.next = i + 1
                        return chosen
            self._rank(protected)

    def _rank(self, protected: set[int]) -> None:
        """Order the next candidates, least count first. Once all candidates are ranked, the
        next call widens them: the unguarded (guarding only the current token's experts when
        the guard is over its share), then all but the current token's, then every resident
        but `protected`.

        Only the lowest `_RANK_SIZE` counts are sorted, every key of the highest of them
        included, and that highest count is kept as `bound`. A token's first ranking reads only
        the candidates counted at most `bound`. Whatever the bound, those are a prefix of the
        full order; as counts only grow, they are about as many as the last ranking sorted (the
        evicted left, the low counts that left the guard joined), so the partition of every
        candidate is skipped. When they run out, the next ranking reads every candidate.
        """
        self._count_pending()
        first = self.level < 0  # the token's first ranking (or the first since a change)
        level = min(self.level + 1, 2) if self.complete else self.level
        resident, last_use, count = self.resident, self.last_use, self.count
        below = (self.starts[0], self.starts[-1], self.uses)[level]
        candidates = resident & (last_use <= below)
        if level == 0:
            self.guarded = int(np.count_nonzero(resident) - np.count_nonzero(candidates))
            self.touched = 0
            if self.guarded > self.guard_limit:
                level, below = 1, self.starts[-1]
                candidates = resident & (last_use <= below)
        bounded = first and self.bound < np.inf
        if bounded:
            eligible = (candidates & (count <= self.bound)).nonzero()[0]
            bounded = len(eligible) >= _RANK_SIZE // 2  # else too few to last the token
        if not bounded:
            eligible = candidates.nonzero()[0]
        self.complete = not bounded
        if level == 2:
            eligible = eligible[~np.isin(eligible, list(protected))]
            if not len(eligible):
                raise _cyclic.all_in_use()
        ranked = count[eligible]
        if len(eligible) > _RANK_SIZE:  # the lowest counts, every key of the highest of them
            self.complete = False
            self.bound = np.partition(ranked, _RANK_SIZE)[_RANK_SIZE]
            keep = ranked <= self.bound
            eligible, ranked = eligible[keep], ranked[keep]
        order = np.lexsort((last_use[eligible], ranked))
        self.order = eligible[order].tolist()
        self.next = 0
        self.level = level
        self.evictable_below = below

    def _forget_order(self) -> None:
        self.order: list[int] = []
        self.next = 0
        self.level = -1
        self.complete = True

    def _count_pending(self) -> None:
        """Add the pending uses to `count`: one numpy call per token instead of one per call."""
        if self.pending:
            np.add.at(self.count, np.concatenate(self.pending), self.weight)
            self.pending = []

    def tick(self, tokens: int) -> None:
        self._count_pending()  # at the weight of the token they were used in
        guarded = len(self.starts)
        self.starts = (self.starts + [self.uses] * min(tokens, guarded))[-guarded:]
        clock = self.tokens + tokens
        self.tokens = clock
        halvings = clock // self.half_life - self.rescaled
        if halvings > 512:  # rescale before the weight overflows; the order is unchanged
            self.count *= 0.5**halvings
            self.bound *= 0.5**halvings
            self.rescaled += halvings
            halvings = 0
        self.weight = 2.0**halvings
        self._forget_order()

    def seed(self, counts: dict[int, float]) -> None:
        self._count_pending()
        _add_counts(self.count, counts, self.weight)
        self._forget_order()


_RANK_SIZE = 256  # candidates sorted at once: more than a token evicts at common shapes


class LayerCyclic(_cyclic.CyclicCore, Policy):
    """Evicts the expert that promises the fewest uses per slot held until its layer's next call.

    Every token calls the MoE layers in order, so an expert of layer j cannot be used again
    before layer j's next call, `d` layer calls away (1 for the next layer, the number of layers
    for the layer just called). Holding it that long buys one use with probability `p`; the
    victim is the key of least `p / d`. A shared pool then behaves like a per-layer partition
    whose shares follow the uses, and when the budget holds less than one token's experts the
    layer just served gives its slots back, where LRU would lose every expert before its next
    call.

    `p` blends two estimates, `freq_share` of the first: the key's decayed use rate (each use
    counts 1, counts halve every `half_life` tokens, so the cache follows a workload that shifts
    and a wrong profile's seeded counts fade) and the rate at which keys of its group are used
    at their layer's next call, learned online (decayed alike): the keys used at their layer's
    latest call, since consecutive tokens share experts, and the others (read once a token).
    Prefetched keys that no call has used yet go first, so a wrong prediction costs a read, not
    a useful expert.

    Cost per call does not grow with the resident keys. A layer's other keys sit in a heap by
    count, one entry per key at most and never above its count (counts only grow): an entry
    that surfaces below its key's count is raised then, and one whose key came back to the
    latest call or left is dropped then, so a key that comes and goes costs no heap work in
    between. Each layer is ranked by a value at most its least, noted when it changes; victims
    are taken from the best layer in one pass, while they beat the next best layer. The state
    and the calls are compiled (`_cyclic.CyclicCore`): this runs on every MoE layer call.
    """

    layered = True  # takes `num_experts`: a key's layer is `key // num_experts`

    def __init__(self, capacity: int, num_keys: int, num_experts: int | None = None,
                 half_life: int = 32, freq_share: float = 0.5):
        if half_life < 1:
            raise ValueError(f"half_life must be at least 1 token, got {half_life}")
        if not 0.0 <= freq_share < 1.0:
            raise ValueError(f"freq_share must be in [0, 1), got {freq_share}")
        self.capacity = capacity
        # a use every token for long adds up to a count of `1 / per_token` (times `weight`)
        per_token = 1.0 - 0.5 ** (1.0 / half_life) or math.log(2) / half_life  # 0 past 2**53
        group_weight = (1.0 - freq_share) / max(freq_share, 1e-9) / per_token
        super().__init__(num_keys, num_experts or num_keys, half_life, group_weight)

    def seed(self, counts: dict[int, float]) -> None:
        count = self.count.copy()
        with np.errstate(over="ignore"):  # said below
            _add_counts(count, counts, self.weight)
        if not np.isfinite(count).all():  # a NaN count would make every comparison false
            raise ValueError("seed counts too large: the policy's counts overflow")
        self.count[:] = count
        self._rescale(1.0)


class SLRU(Policy):
    """Segmented LRU. A key enters probation; a hit on it promotes it to the protected segment
    (`protected_share` of the capacity), whose least recently used key falls back to probation
    when the segment overflows.

    The victim comes from probation: the key that entered it in the earliest token, the least
    used (counted like `LFU`) among keys that entered in the same token. Protected keys are
    evicted, least recently used first, only when probation has none to give.
    """

    def __init__(self, capacity: int, num_keys: int, protected_share: float = 0.8):
        super().__init__(capacity, num_keys)
        if not 0.0 <= protected_share <= 1.0:
            raise ValueError(f"protected_share must be in [0, 1], got {protected_share}")
        self.protected_slots = int(capacity * protected_share)
        self.probation = _Resident(num_keys)
        self.protected: OrderedDict[int, None] = OrderedDict()
        self.entered = np.zeros(num_keys)  # token in which the key entered probation
        self.count = np.zeros(num_keys)
        self.tokens = 0

    def access(self, keys: list[int], new: list[int] = ()) -> None:
        self.count[keys] += 1
        protected = self.protected
        for key in keys:
            if key in new:
                continue
            if key in protected:
                protected.move_to_end(key)
                continue
            self.probation.drop(key)
            protected[key] = None
            if len(protected) > self.protected_slots:
                self._enter_probation(protected.popitem(last=False)[0])
        for key in new:  # a miss enters probation; a hit promotes
            self._enter_probation(key)

    def insert(self, keys: list[int]) -> None:
        for key in keys:
            self._enter_probation(key)
            self.entered[key] = -1  # before every key that a call used

    def _enter_probation(self, key: int) -> None:
        self.probation.add(key)
        self.entered[key] = self.tokens

    def victims(self, n: int, protected: set[int]) -> list[int]:
        probation = self.probation
        chosen = []
        for _ in range(n):
            key = probation.pop_min(self.entered[probation.active], protected, tie=self.count,
                                    or_none=True)
            chosen.append(_pop_oldest(self.protected, protected) if key is None else key)
        return chosen

    def remove(self, key: int) -> None:
        if key in self.protected:
            del self.protected[key]
        else:
            self.probation.drop(key)

    def tick(self, tokens: int) -> None:
        self.tokens += tokens

    def seed(self, counts: dict[int, float]) -> None:
        _add_counts(self.count, counts)


class Future:
    """The keys a replay will pass to `access`/`insert`, in order (each call's distinct keys),
    indexed so that the next use of a key is one lookup. One `Future` serves every `Belady` of a
    replay (one per layer with a per-layer partition)."""

    def __init__(self, keys: np.ndarray, num_keys: int):
        keys = np.asarray(keys, np.int64)
        n = len(keys)
        self.keys = np.append(keys, -1)
        # next_at[i]: position of the next use of keys[i], n if none; first_at[key]: its first use
        self.next_at = np.full(n + 1, n, np.int64)
        self.first_at = np.full(num_keys, n, np.int64)
        order = np.argsort(keys, kind="stable")
        same = keys[order[1:]] == keys[order[:-1]]
        self.next_at[order[:-1][same]] = order[1:][same]
        starts = order[np.append(True, ~same)] if n else order
        self.first_at[keys[starts]] = starts


class Belady(Policy):
    """Belady's offline optimum: evicts the resident key whose next use is farthest away, keys
    never used again first. Replay only: `future` (a `Future`, or the key sequence to build one)
    must be exactly the keys the cache will pass to `access` and `insert`, in order.
    """

    def __init__(self, capacity: int, num_keys: int, future: Future | np.ndarray | None = None):
        super().__init__(capacity, num_keys)
        if future is None:
            raise ValueError("belady is offline, for replay only: it needs the future routing")
        self.future = future if isinstance(future, Future) else Future(future, num_keys)
        self.at = np.full(num_keys, -1, np.int64)  # position in the future of the latest use
        self.next_use = np.full(num_keys, float(len(self.future.keys)))
        self.resident = _Resident(num_keys)

    def _use(self, key: int) -> None:
        future, at = self.future, self.at[key]
        at = future.first_at[key] if at < 0 else future.next_at[at]
        if future.keys[at] != key:
            raise RuntimeError(f"key {key} is used out of the order belady was given")
        self.at[key] = at
        self.next_use[key] = future.next_at[at]

    def access(self, keys: list[int], new: list[int] = ()) -> None:
        for key in keys:
            self._use(key)
        self.insert(new)

    def insert(self, keys: list[int]) -> None:
        for key in keys:
            self.resident.add(key)

    def warm(self, keys: list[int]) -> None:
        """Resident before the replay (a profile's pre-warm), ranked by its first use: a use
        here would be one the future does not hold."""
        for key in keys:
            self.next_use[key] = self.future.first_at[key]
        self.insert(keys)

    def victims(self, n: int, protected: set[int]) -> list[int]:
        resident = self.resident
        return [resident.pop_min(-self.next_use[resident.active], protected) for _ in range(n)]

    def remove(self, key: int) -> None:
        self.resident.drop(key)


POLICIES: dict[str, type[Policy]] = {
    "lru": LRU,
    "lfu": LFU,
    "slru": SLRU,
    "wlfu": WindowLFU,
    "cyclic": LayerCyclic,
    "belady": Belady,
}


def make_policy(spec: str, capacity: int, num_keys: int, num_experts: int | None = None,
                **options) -> Policy:
    """The policy a spec names (see `parse_policy`); `options` add to the spec's own. Keys are
    `layer * num_experts + expert`; a policy that ranks by layer is told `num_experts`."""
    name, spec_options = parse_policy(spec)
    cls = POLICIES[name]
    if getattr(cls, "layered", False):
        options["num_experts"] = num_experts
    return cls(capacity, num_keys, **spec_options, **options)


def parse_policy(spec: str) -> tuple[str, dict]:
    """`NAME` or `NAME:OPTION=VALUE,...` (`wlfu:half_life=128`, `slru:protected_share=0.5`):
    the policy's name and its constructor options, typed like their defaults."""
    name, _, rest = str(spec).partition(":")
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of: {', '.join(sorted(POLICIES))}")
    params = {
        p.name: p.default for p in inspect.signature(POLICIES[name]).parameters.values()
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


def _pop_oldest(order: OrderedDict, protected: set[int]) -> int:
    """Remove and return the least recent key of `order` that is not in `protected`."""
    for key in order:
        if key not in protected:
            del order[key]
            return key
    raise _cyclic.all_in_use()


class _Resident:
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
        """Drop and return the key of least `score` (one float per `active` key, overwritten),
        skipping `protected`; among equal scores the least `tie[key]`. When every key is
        protected: None if `or_none`, else an error."""
        if protected:
            at = self.pos[list(protected)]
            score[at[at >= 0]] = np.inf
        i = int(score.argmin()) if len(score) else -1
        if i < 0 or score[i] == np.inf:
            if or_none:
                return None
            raise _cyclic.all_in_use()
        if tie is not None:
            equal = (score == score[i]).nonzero()[0]
            if len(equal) > 1:
                i = int(equal[tie[self.keys[equal]].argmin()])
        key = int(self.keys[i])
        self.drop(key)
        return key


def _add_counts(count: np.ndarray, counts: dict[int, float], weight: float = 1.0) -> None:
    keys = np.fromiter(counts.keys(), np.int64, len(counts))
    values = np.fromiter(counts.values(), np.float64, len(counts))
    if len(keys) and (keys.min() < 0 or keys.max() >= len(count)):
        raise ValueError(f"seed keys must be in [0, {len(count)}), got {keys.min()}..{keys.max()}")
    if not np.isfinite(values).all() or (values < 0).any():
        raise ValueError("seed counts must be finite and non-negative")
    np.add.at(count, keys, values * weight)

