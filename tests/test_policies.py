"""Eviction policies through the cache that owns residency: each ranks victims as documented."""

import itertools
import os
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import numpy as np
import pytest

import mlx_moestream
from mlx_moestream.cache import ExpertCache, split_slots
from mlx_moestream.policies import (
    DEFAULT_POLICY,
    LFU,
    LRU,
    POLICIES,
    SLRU,
    Belady,
    Future,
    NextCall,
    Policy,
    WindowLFU,
    make_policy,
    wlfu,
)
from mlx_moestream.policies.base import ScoredCyclic
from mlx_moestream.policies.cyclic import LayerCyclic
from mlx_moestream.replay import replay, sweep
from mlx_moestream.trace import Trace, synthetic_trace

ONLINE = ["lru", "lfu", "slru", "wlfu", "markov", "age", "cyclic"]


def _cache(num_slots, layers=2, num_experts=4, policy="wlfu", layer_slots=None):
    return ExpertCache(num_slots, list(range(layers)), num_experts, layers, policy, layer_slots)


def _request(cache, layer, experts):
    """The (expert, slot) loads of one call."""
    return cache.request(layer, [int(e) for e in experts])[0]


def _resident(cache):
    layer, expert = np.nonzero(cache.slot_of >= 0)
    return set(zip(layer.tolist(), expert.tolist()))


def random_trace(seed, tokens=10, layers=2, num_experts=4, top_k=2) -> Trace:
    """Uniformly random distinct experts per token and layer, some positions empty (-1)."""
    rng = np.random.default_rng(seed)
    experts = np.array([[rng.permutation(num_experts)[:top_k] for _ in range(layers)]
                        for _ in range(tokens)])
    experts[rng.random(experts.shape) < 0.1] = -1
    return Trace(experts.astype(np.int16), num_experts)


def _requests(trace):
    """(layer, sorted distinct keys) per request, in replay order."""
    out = []
    for t in range(trace.tokens):
        for layer in range(trace.layers):
            ids = sorted({int(e) for e in trace.experts[t, layer] if e >= 0})
            if ids:
                out.append([layer * trace.num_experts + e for e in ids])
    return out


def lru_by_list(trace, capacity) -> int:
    """Misses of a direct LRU simulation: a list, least recent first."""
    order, misses = [], 0
    for keys in _requests(trace):
        for key in keys:
            if key in order:
                order.remove(key)
                order.append(key)
        for key in keys:
            if key in order:
                continue
            misses += 1
            if len(order) == capacity:
                order.remove(next(k for k in order if k not in keys))
            order.append(key)
    return misses


def optimal_misses(trace, capacity) -> int:
    """Fewest misses over every possible choice of evictions (exhaustive search)."""
    requests = _requests(trace)

    @cache
    def best(i, resident):
        if i == len(requests):
            return 0
        keys = set(requests[i])
        missing = keys - resident
        excess = len(resident) + len(missing) - capacity
        if excess <= 0:
            return len(missing) + best(i + 1, resident | missing)
        choices = itertools.combinations(sorted(resident - keys), excess)
        return len(missing) + min(best(i + 1, (resident - set(out)) | missing) for out in choices)

    return best(0, frozenset())


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("capacity", [2, 3, 5])
def test_lru_misses_equal_a_direct_list_simulation(seed, capacity):
    trace = random_trace(seed, tokens=30)
    assert replay(trace, "lru", capacity)["misses"] == lru_by_list(trace, capacity)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("capacity", [2, 3, 5])
def test_belady_misses_equal_the_exhaustive_optimum(seed, capacity):
    trace = random_trace(seed, tokens=8)
    assert replay(trace, "belady", capacity)["misses"] == optimal_misses(trace, capacity)


@pytest.mark.parametrize(
    "trace",
    [random_trace(s, tokens=200, layers=3, num_experts=16, top_k=4) for s in range(3)]
    + [synthetic_trace(600, 3, 32, 4, skew=s, repeat=r, seed=i)
       for i, (s, r) in enumerate([(1.0, 0.1), (0.6, 0.3), (1.2, 0.0)])],
)
@pytest.mark.parametrize("capacity", [0.15, 0.3, 0.6])
def test_belady_hits_at_least_every_policy(trace, capacity):
    for result in sweep(trace, ONLINE, [capacity]):
        assert result["belady_hit_rate"] >= result["hit_rate"], result["policy"]


@pytest.mark.parametrize("name", ONLINE + ["belady"])
@pytest.mark.parametrize("per_layer", [False, True])
def test_when_all_experts_fit_every_policy_has_only_compulsory_misses(name, per_layer):
    trace = synthetic_trace(300, 3, 32, 4, seed=1)
    result = replay(trace, name, 1.0, per_layer=per_layer)
    compulsory = int((trace.usage() > 0).sum())
    assert result["misses"] == compulsory
    assert result["evictions"] == 0
    assert result["hit_rate"] == result["lru_hit_rate"] == result["belady_hit_rate"]


def test_a_cache_whose_calls_all_hit_holds_at_most_one_tokens_policy_updates():
    """Uses are held until the next decision (see ExpertCache): replay, which never tallies,
    must not pile up a whole trace of them when nothing misses."""
    cache = _cache(8, layers=2, num_experts=4, policy="cyclic")
    for _ in range(100):
        cache.tick(1)
        for layer in (0, 1):
            _request(cache, layer, [0, 1, 2, 3])
    assert len(cache.held) <= 3  # the latest token's tick and its two calls

@pytest.mark.parametrize("name", ONLINE)
def test_victim_is_never_an_expert_of_the_current_call(name):
    cache = _cache(3, policy=name)
    _request(cache, 0, [0, 1, 2])
    _request(cache, 0, [0, 1])
    loads = _request(cache, 0, [0, 1, 3])
    assert [expert for expert, _ in loads] == [3]
    assert _resident(cache) == {(0, 0), (0, 1), (0, 3)}


@pytest.mark.parametrize("name", ONLINE)
def test_a_call_with_every_slot_protected_raises(name):
    policy = make_policy(name, 2, 8)
    _miss(policy, 0)
    _miss(policy, 1)
    with pytest.raises(RuntimeError, match="in use"):
        _victim(policy, {0, 1})


@pytest.mark.parametrize("name", ONLINE)
def test_a_prefetched_expert_that_no_call_used_is_evicted_first(name):
    cache = _cache(3, layers=1, num_experts=8, policy=name)
    for expert in (0, 1):
        _request(cache, 0, [expert])
        cache.tick(1)
    cache.prefetch(0, np.array([2]), set())
    cache.tick(3)  # every expert is past the recency guard
    _request(cache, 0, [3])
    assert _resident(cache) == {(0, 0), (0, 1), (0, 3)}


def test_lfu_evicts_the_least_used_expert():
    cache = _cache(3, policy="lfu")
    _request(cache, 0, [0, 1, 2])
    _request(cache, 0, [0, 1])
    _request(cache, 0, [2, 1])
    _request(cache, 0, [3])  # 0 and 2 were used twice, 1 three times: 0 is older
    assert _resident(cache) == {(0, 1), (0, 2), (0, 3)}


def test_lfu_breaks_count_ties_by_recency():
    policy = LFU(4, 8)
    for key in (5, 6, 7):
        _miss(policy, key)
    policy.access([5])
    policy.access([7])  # 5 and 7 used twice, 6 once
    assert _victim(policy, set()) == 6
    assert _victim(policy, set()) == 5


def test_lfu_remembers_counts_of_experts_that_left():
    policy = LFU(2, 8)
    _miss(policy, 1)
    policy.access([1])
    policy.access([1])
    _victim(policy, set())
    _miss(policy, 1)  # returns with its earlier uses
    _miss(policy, 2)
    policy.access([2])
    assert _victim(policy, set()) == 2


def test_wlfu_weighs_a_use_one_half_life_ago_as_half_a_use_now():
    policy = WindowLFU(2, 8, half_life=4, recent_tokens=1)
    _miss(policy, 0, 1)
    policy.access([0])
    policy.access([0])  # 0: three uses at token 0; 1: one
    policy.tick(4)
    policy.access([1])  # 1: 0.5 + 1 now, 0: 1.5 now; 0 is the least recent
    policy.tick(1)
    assert _victim(policy, set()) == 0


@pytest.mark.parametrize("policy", ["cyclic", "wlfu", "age"])
def test_a_half_life_past_what_a_float_resolves_is_taken(policy):
    """`half_life=10**20`, "never decay", rounded the cyclic policy's rate per token to 0 (a
    ZeroDivisionError)."""
    result = replay(synthetic_trace(64, 4, 16, 2, seed=0), f"{policy}:half_life={10**20}", 0.5)
    assert 0 < result["hit_rate"] < 1


def test_wlfu_lets_a_formerly_hot_expert_go_once_it_decays():
    policy = WindowLFU(2, 8, half_life=4)
    _miss(policy, 0)
    for _ in range(8):
        policy.access([0])
    _miss(policy, 1)
    assert _victim(policy, set()) == 1  # 0 is hot
    _miss(policy, 1)
    for _ in range(5):
        policy.tick(4)  # 9 uses of 0 halve to 0.28
        policy.access([1])
    assert _victim(policy, set()) == 0


def test_wlfu_keeps_an_expert_of_the_previous_token_over_a_more_frequent_older_one():
    policy = WindowLFU(2, 8, half_life=64, recent_tokens=2)
    _miss(policy, 0)
    for _ in range(5):
        policy.access([0])
    policy.tick(1)
    policy.tick(1)  # expert 0 was last used two tokens ago
    _miss(policy, 1)  # used once, in this token
    policy.tick(1)  # next token: 1 is from the previous token, 0 is older
    assert _victim(policy, set()) == 0


def test_wlfu_evicts_a_recent_expert_when_no_other_is_left():
    policy = WindowLFU(2, 8, recent_tokens=2)
    _miss(policy, 0)
    policy.access([0])
    _miss(policy, 1)
    assert _victim(policy, set()) == 1  # both recent: the least used goes


@pytest.mark.parametrize("rank_size, slots", [(256, 512), (16, 256)])  # 16: rankings run out
def test_wlfu_evicts_as_a_full_ranking_does_when_it_ranks_only_keys_below_its_bound(
        monkeypatch, rank_size, slots):
    class FullRanking(WindowLFU):
        def _rank(self, protected):
            self.bound = np.inf  # every ranking reads every candidate
            super()._rank(protected)

    monkeypatch.setattr(wlfu, "_RANK_SIZE", rank_size)
    trace = synthetic_trace(300, 8, 128, 8, seed=6)
    caches = [_cache(slots, 8, 128, lambda n: WindowLFU(n, 8 * 128)),
              _cache(slots, 8, 128, lambda n: FullRanking(n, 8 * 128))]
    for t in range(trace.tokens):
        for cache in caches:
            cache.tick(1)
        for layer in range(trace.layers):
            experts = np.unique(trace.experts[t, layer])
            bounded, full = (_request(cache, layer, experts) for cache in caches)
            assert bounded == full
    assert caches[0].policies[0].bound < np.inf  # partitioned, so later rankings were bounded


def test_wlfu_rejects_a_half_life_below_one_token():
    with pytest.raises(ValueError, match="half_life"):
        WindowLFU(4, 8, half_life=0)


def test_slru_evicts_probation_before_protected():
    policy = SLRU(3, 8, protected_share=0.7)  # 2 protected slots
    for key in (0, 1, 2):
        _miss(policy, key)
    policy.access([0, 1])  # promoted
    assert _victim(policy, set()) == 2
    _miss(policy, 3)
    assert _victim(policy, set()) == 3


def test_slru_demotes_the_least_recent_protected_key_when_the_segment_overflows():
    policy = SLRU(4, 8, protected_share=0.5)  # 2 protected slots
    for key in (0, 1, 2, 3):
        _miss(policy, key)
    policy.tick(1)
    policy.access([0])
    policy.access([1])
    policy.access([2])  # protected holds 1, 2; 0 falls back to probation
    assert list(policy.protected) == [1, 2]
    assert _victim(policy, set()) == 3  # entered probation in token 0, before 0 came back
    assert _victim(policy, set()) == 0


def test_slru_breaks_ties_among_keys_entering_in_one_token_by_frequency():
    policy = SLRU(4, 8)
    policy.seed({5: 3.0})
    for key in (5, 6, 7):
        _miss(policy, key)
    assert _victim(policy, set()) in (6, 7)
    assert _victim(policy, set()) in (6, 7)
    assert _victim(policy, set()) == 5


class SlowCyclic:
    """`LayerCyclic`'s rule, by brute force over every resident key: the victim is a key of
    least value / distance, value = decayed count + its group's learned use rate as a count."""

    def __init__(self, layers, experts, half_life=32, freq_share=0.5):
        self.layers, self.experts, self.half_life = layers, experts, half_life
        self.scale = (1 - freq_share) / freq_share / (1 - 0.5 ** (1 / half_life))
        self.count, self.tokens, self.position = {}, 0, 0
        self.latest = {layer: [] for layer in range(layers)}
        self.resident, self.uses, self.chances = set(), [1.0, 1.0], [2.0, 2.0]

    def weight(self):
        return 2.0 ** (self.tokens / self.half_life)

    def tick(self):
        """A token starts: the group rates hold for all of it."""
        self.tokens += 1
        self.rates = [self.uses[0] / self.chances[0], self.uses[1] / self.chances[1]]

    def access(self, keys):
        layer, w = keys[0] // self.experts, self.weight()
        previous = self.latest[layer]
        reused = len(set(keys) & set(previous))
        self.uses = [self.uses[0] + reused * w, self.uses[1] + (len(keys) - reused) * w]
        self.chances = [self.chances[0] + len(previous) * w,
                        self.chances[1] + (self.experts - len(previous)) * w]
        for key in keys:
            self.count[key] = self.count.get(key, 0.0) + w
        self.resident |= set(keys)
        self.latest[layer] = list(keys)
        self.position = (layer + 1) % self.layers

    def score(self, key):
        layer = key // self.experts
        latest = key in self.latest[layer] and layer != self.position
        rate = self.rates[0] if latest else self.rates[1]
        value = self.count[key] + self.scale * self.weight() * rate
        return ((layer - self.position - 1) % self.layers + 1) / value  # calls until its next

    def best(self, protected):
        return max(self.score(k) for k in self.resident if k not in protected)


@pytest.mark.parametrize("slots", [10, 24, 48, 90])
def test_cyclic_evicts_a_key_of_least_use_probability_per_layer_call_held(slots):
    layers, experts = 6, 16
    trace = synthetic_trace(150, layers, experts, 4, repeat=0.4, seed=5)
    fast = make_policy("cyclic", slots, layers * experts, num_experts=experts)
    slow = SlowCyclic(layers, experts)
    resident, checked = set(), 0
    for t in range(trace.tokens):
        fast.tick(1)
        slow.tick()
        for layer in range(layers):
            keys = sorted({layer * experts + int(e) for e in trace.experts[t, layer]})
            new = [k for k in keys if k not in resident]
            free = slots - len(resident)
            if len(new) > free:
                for victim in fast.victims(len(new) - free, set(keys)):
                    assert slow.score(victim) == pytest.approx(slow.best(set(keys)), rel=1e-9)
                    resident.discard(victim)
                    slow.resident.discard(victim)
                    checked += 1
            resident |= set(new)
            fast.access(keys, new)
            slow.access(keys)
    assert checked > 20
    assert set(fast.victims(len(resident), set())) == resident  # it lost track of none


def test_cyclic_keeps_its_rule_through_prefetches_failed_loads_and_unsorted_calls():
    """A prefetched key goes before any used one until a call uses it, then ranks like the rest;
    a failed load (`remove`) leaves no trace; a call's keys may come in any order."""
    layers, experts, slots = 4, 8, 12
    trace = synthetic_trace(150, layers, experts, 3, repeat=0.4, seed=7)
    rng = np.random.default_rng(7)
    fast = make_policy("cyclic", slots, layers * experts, num_experts=experts)
    slow = SlowCyclic(layers, experts)
    resident, unused, checked = set(), [], 0

    def evict(n, protected):
        nonlocal checked
        for victim in fast.victims(n, protected):
            waiting = [k for k in unused if k not in protected]
            if waiting:
                assert victim == waiting[0]
                unused.remove(victim)
            else:
                assert slow.score(victim) == pytest.approx(slow.best(protected), rel=1e-9)
            resident.discard(victim)
            slow.resident.discard(victim)
            checked += 1

    for t in range(trace.tokens):
        fast.tick(1)
        slow.tick()
        for layer in range(layers):
            keys = [layer * experts + int(e) for e in rng.permutation(trace.experts[t, layer])]
            new = [k for k in keys if k not in resident]
            if len(new) > slots - len(resident):
                evict(len(new) - slots + len(resident), set(keys))
            resident |= set(new)
            unused = [k for k in unused if k not in keys]
            fast.access(keys, new)
            slow.access(keys)
            after = (layer + 1) % layers  # prefetch for the next layer, or a load fails
            if rng.random() < 0.3:
                guess = [after * experts + int(e) for e in rng.choice(experts, 2, replace=False)]
                guess = [k for k in guess if k not in resident]
                if len(guess) > slots - len(resident):
                    evict(len(guess) - slots + len(resident), set(guess))
                fast.insert(guess)
                resident |= set(guess)
                unused += guess
            elif rng.random() < 0.1 and resident:
                key = int(rng.choice(sorted(resident)))
                fast.remove(key)
                resident.discard(key)
                slow.resident.discard(key)
                unused = [k for k in unused if k != key]
    assert checked > 100
    assert set(fast.victims(len(resident), set())) == resident  # it lost track of none


class SlowAge(ScoredCyclic):
    """`LayerAge`'s rule in numpy over every key: `p` blends the decayed use rate with the rate
    per age as it was when the token started."""

    def __init__(self, layers, experts, half_life=32, freq_share=0.5):
        super().__init__(layers * experts, layers * experts, experts)
        self.half_life, self.freq_share = half_life, freq_share
        self.ages = int(np.log2(4 * half_life)) + 2
        self.count = np.zeros((layers, experts))
        self.last = np.full((layers, experts), -1)
        self.calls = np.zeros(layers, np.int64)
        self.uses, self.offers = np.ones(self.ages), np.full(self.ages, 2.0)
        self.tokens = 0

    def _age(self, layers, ahead):
        calls_ago = (self.calls[layers] + ahead)[..., None] - self.last[layers]
        age = np.log2(calls_ago).astype(np.int64).clip(max=self.ages - 2)
        return np.where(self.last[layers] < 0, self.ages - 1, age)

    def tick(self, tokens):
        self.tokens += tokens
        self.weight = 2.0 ** (self.tokens / self.half_life)
        self.by_age = self.uses / self.offers

    def access(self, keys, new=()):
        layer = keys[0] // self.experts
        used = np.asarray(keys) - layer * self.experts
        age = self._age(layer, 1)
        self.offers += self.weight * np.bincount(age, minlength=self.ages)
        self.uses += self.weight * np.bincount(age[used], minlength=self.ages)
        self.calls[layer] += 1
        self.last[layer, used] = self.calls[layer]
        self.count[layer, used] += self.weight
        self.state[keys] = 2
        self.position = (layer + 1) % self.layers

    def use_chances(self):
        ahead = np.ones(self.layers, np.int64)
        ahead[self.position] = 2
        rate = self.count * ((1 - 0.5 ** (1 / self.half_life)) / self.weight)
        return (self.freq_share * rate
                + (1.0 - self.freq_share) * self.by_age[self._age(slice(None), ahead)])


@pytest.mark.parametrize("slots", [10, 24, 48, 90])
def test_age_evicts_the_keys_of_least_use_chance_per_layer_call_held(slots):
    """The compiled policy against its rule over every key, through prefetches (unused, they go
    first, least key first), failed loads and calls in any order: the same victims, in order."""
    layers, experts = 6, 16
    trace = synthetic_trace(200, layers, experts, 4, repeat=0.4, seed=3)
    rng = np.random.default_rng(3)
    fast = make_policy("age", slots, layers * experts, num_experts=experts)
    slow = SlowAge(layers, experts)
    resident, checked = set(), 0

    def make_room(keys, protected):
        nonlocal checked
        new = [k for k in keys if k not in resident]
        if len(new) > slots - len(resident):
            victims = fast.victims(len(new) - slots + len(resident), protected)
            assert victims == slow.victims(len(victims), protected)
            resident.difference_update(victims)
            checked += len(victims)
        resident.update(new)
        return new

    for t in range(trace.tokens):
        fast.tick(1)
        slow.tick(1)
        for layer in range(layers):
            keys = [layer * experts + int(e) for e in rng.permutation(trace.experts[t, layer])]
            new = make_room(keys, set(keys))
            fast.access(keys, new)
            slow.access(keys, new)
            if rng.random() < 0.3:  # a prefetch of the next layer
                after = (layer + 1) % layers
                guess = [after * experts + int(e) for e in rng.choice(experts, 2, replace=False)]
                guess = make_room([k for k in guess if k not in resident], set(guess))
                fast.insert(guess)
                slow.insert(guess)
            elif rng.random() < 0.1 and resident:  # a failed load
                key = int(rng.choice(sorted(resident)))
                fast.remove(key)
                slow.remove(key)
                resident.discard(key)
    assert checked > 50
    assert fast.victims(len(resident), set()) == slow.victims(len(resident), set())


@pytest.mark.parametrize("call", [[0, 16], [-1], [32]])
def test_cyclic_refuses_a_call_outside_its_keys_or_across_layers(call):
    """Its compiled state is indexed by key: a key of no slot there is an error, not a write
    past the end, and the refused call changes nothing."""
    policy = make_policy("cyclic", 8, 32, num_experts=16)
    with pytest.raises((IndexError, ValueError), match="key|layer"):
        policy.access(call, call)
    assert not policy.count.any()
    policy.access([1, 2], [1, 2])  # and it works on
    assert policy.victims(2, set()) == [1, 2]


def test_cyclic_refuses_a_call_of_no_keys():
    policy = make_policy("cyclic", 8, 32, num_experts=16)
    with pytest.raises(ValueError, match="got 0"):
        policy.access([])


def test_cyclic_reads_each_key_of_a_call_once():
    """`new` may be an iterator, and what it runs may change the caller's list of keys: the
    policy keeps what it read and checked first."""
    policy = make_policy("cyclic", 8, 32, num_experts=16)
    keys = [1, 2]

    def fresh():
        yield 1
        keys[:] = [10**9]  # out of every array
        yield 2

    policy.access(keys, fresh())
    assert policy.victims(2, set()) == [1, 2]


def test_cyclic_counts_a_call_whose_key_objects_call_the_policy_meanwhile():
    """A key object's `__index__` that calls the policy (a hook, a debugger) runs before the
    call's keys are written where the policy keeps them, and changes none of them."""
    policy = make_policy("cyclic", 8, 32, num_experts=16)

    class Calling:
        def __index__(self):
            policy.access([5, 6])
            return 2

    policy.access([1, Calling()])
    assert policy.count[[1, 2, 5, 6]].tolist() == [1.0, 1.0, 1.0, 1.0]


def test_cyclic_victims_with_a_bad_protected_key_leave_every_key_evictable():
    policy = make_policy("cyclic", 8, 32, num_experts=16)
    policy.access([1, 2], [1, 2])
    policy.insert([3])  # a prefetch: the first to go
    with pytest.raises(TypeError):
        policy.victims(1, [1, "x"])
    assert policy.victims(3, set()) == [3, 1, 2]


@pytest.mark.parametrize("name", ["lfu", "slru", "wlfu", "markov", "age", "cyclic"])
def test_a_policy_refuses_seed_counts_that_overflow(name):
    """An infinite count, halved to nothing by a long tick, is NaN, which no comparison
    orders: `cyclic` took keys from an empty heap, the numpy policies found every key in use."""
    policy = make_policy(name, 4, 4, num_experts=4)
    policy.seed({1: 1e308})
    with pytest.raises(ValueError, match="overflow"):
        policy.seed({1: 1e308})
    assert np.isfinite(policy.count).all()


def test_cyclic_is_initialized_once():
    """Its compiled state is sized once: sizes and arrays cannot part."""
    policy = make_policy("cyclic", 8, 32, num_experts=16)
    with pytest.raises(RuntimeError, match="once"):
        LayerCyclic.__init__(policy, 8, 64, 16)


def test_cyclic_victims_of_an_uninitialized_policy_is_an_error():
    with pytest.raises(RuntimeError, match="initialized"):
        LayerCyclic.__new__(LayerCyclic).victims(1, set())


def test_a_compiled_policy_built_from_another_source_refuses_to_load():
    """After a pull that changed `_core.pyx` or a file it includes, or with another checkout's
    build found through a shared environment, the build is not of the sources beside it: the
    import says so, rather than run other code than the sources read. (The build at hand is of
    its sources: every other test imports it.)"""
    load = ("from mlx_moestream.policies import _core; _core.SOURCE_DIGEST = 'another'; "
            "import mlx_moestream.policies.cyclic")
    done = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "_core.pyx and the files it includes are not the source" in last
    assert "pip install -e ." in last


def test_the_program_says_in_one_line_that_the_compiled_policy_is_stale():
    """`mlx-moestream` (its console script runs `__main__.main`) in a checkout not rebuilt after
    a pull: the refused import is one line, not a traceback."""
    run = ("import sys; from mlx_moestream.policies import _core; "
           "_core.SOURCE_DIGEST = 'another'; "
           "from mlx_moestream.__main__ import main; sys.argv = ['mlx-moestream', '--help']; main()")
    done = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True)
    assert done.returncode == 1
    assert done.stderr.startswith("mlx-moestream: ") and done.stderr.count("\n") == 1
    assert "_core.pyx and the files it includes are not the source" in done.stderr
    assert "pip install -e ." in done.stderr


def test_the_program_says_in_one_line_that_the_compiled_policies_are_not_built(tmp_path):
    """A checkout used without `pip install -e .`: the package has no compiled module."""
    package = Path(mlx_moestream.__file__).parent
    shutil.copytree(package, tmp_path / "mlx_moestream",
                    ignore=shutil.ignore_patterns("*.so", "*.pyd", "assets", "__pycache__"))
    run = ("import sys; from mlx_moestream.__main__ import main; "
           "sys.argv = ['mlx-moestream', '--help']; main()")
    done = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True,
                          cwd=tmp_path, env=os.environ | {"PYTHONPATH": str(tmp_path)})
    assert done.returncode == 1
    assert done.stderr == ("mlx-moestream: mlx_moestream's compiled part (_core.pyx) is not "
                           "built: run `pip install -e .` in the checkout\n")


def test_cyclic_below_one_token_of_experts_keeps_what_the_next_layers_use():
    """Three layers, one expert each per token, two slots: LRU evicts each expert before its
    layer comes round again; cyclic gives up the layer just served, as the optimum does."""
    result = replay(Trace(np.zeros((40, 3, 1), np.int16), 4), "cyclic", 2)
    assert result["lru_hit_rate"] == 0.0
    assert result["hit_rate"] == result["belady_hit_rate"]


def test_cyclic_lets_a_formerly_hot_expert_go_once_it_decays():
    cache = _cache(2, layers=1, policy="cyclic:half_life=4")
    for _ in range(8):
        cache.tick(1)
        _request(cache, 0, [0])
    for _ in range(40):  # expert 1 is used every other token from now on; 0 never again
        cache.tick(1)
        _request(cache, 0, [1])
        cache.tick(1)
        _request(cache, 0, [2])
    cache.tick(1)
    _request(cache, 0, [3])
    assert (0, 0) not in _resident(cache)


def test_cyclic_evicts_an_unused_prefetched_expert_first():
    cache = _cache(3, layers=1, policy="cyclic")
    for expert in (0, 1):
        cache.tick(1)
        _request(cache, 0, [expert])
    cache.prefetch(0, np.array([2]), set())
    cache.tick(1)
    _request(cache, 0, [3])
    assert _resident(cache) == {(0, 0), (0, 1), (0, 3)}


def test_markov_keeps_the_expert_that_follows_its_layers_latest_call():
    """Calls use 0, 1, 2, 2 in turn: after a call of 0, expert 1 stays and 2 goes, though
    LRU and LFU would both evict 1 (least recent, least used)."""
    policy = make_policy("markov", 3, 4, num_experts=4)
    for expert in [0, 1, 2, 2] * 4 + [0]:
        policy.tick(1)
        policy.access([expert], [expert])
    assert policy.p[0, 1] > policy.p[0, 2]
    assert _victim(policy, {0, 3}) == 2


def test_markov_evicts_the_current_layers_expert_before_the_next_layers_at_equal_chances():
    """Layer 0 is called now: its other experts wait a whole token, layer 1's one call."""
    policy = make_policy("markov", 2, 4, num_experts=2)
    policy.tick(1)
    policy.access([0], [0])
    policy.access([2], [2])
    assert policy.p[0, 0] == policy.p[1, 0]
    assert _victim(policy, {1}) == 0


def test_age_keeps_an_expert_that_returns_every_fourth_call_where_lru_and_cyclic_do_not():
    """Layer 1 calls experts 0, 1, 2, 3 in turn: the one used four calls ago is next. LRU and
    `cyclic` (one rate for every key out of the latest call) evict it, the least recent and
    least counted; `age` learned that keys of age 4-7 come back and those of 2-3 do not."""
    victims = {}
    for name in ("age", "cyclic", "lru"):
        policy = make_policy(name, 5, 8, num_experts=4)
        for token in range(40):
            policy.tick(1)
            policy.access([0], [0] if token == 0 else [])
            key = 4 + token % 4
            policy.access([key], [key] if token < 4 else [])
        policy.tick(1)
        victims[name] = _victim(policy, {0})
    assert victims == {"age": 5, "cyclic": 4, "lru": 4}  # 4 is due next, 5 two calls later


def test_age_ranks_the_called_layer_s_other_experts_at_the_call_after():
    """Calls alternate 0 and 1, each expert used again two calls later. Now a call uses 2:
    1, used at the latest call, is due at the next one and stays; 0 was due at this one."""
    policy = make_policy("age", 2, 3, num_experts=3)
    for call in range(20):
        policy.tick(1)
        policy.access([call % 2], [call % 2] if call < 2 else [])
    policy.tick(1)
    assert _victim(policy, {2}) == 0


def test_belady_evicts_the_key_used_farthest_in_the_future():
    future = np.array([0, 1, 2, 1, 0])
    policy = Belady(2, 4, future)
    _miss(policy, 0)
    _miss(policy, 1)
    assert _victim(policy, {2}) == 0  # 1 comes back before 0
    _miss(policy, 2)
    assert _victim(policy, {1}) == 2  # never used again


def test_belady_refuses_a_use_the_future_does_not_hold():
    policy = Belady(2, 4, np.array([0, 1]))
    _miss(policy, 1)
    with pytest.raises(RuntimeError, match="out of the order"):
        policy.access([1])


def test_belady_needs_the_future():
    with pytest.raises(ValueError, match="future"):
        make_policy("belady", 4, 8)


def test_next_call_evicts_a_key_its_layer_s_next_call_leaves_out_over_an_older_one_it_uses():
    """Two layers of two experts (keys 0-1, 2-3); token 1's first layer misses key 1. Key 0,
    the older, returns at layer 0's next call (token 2); key 2, the newer, not at layer 1's."""
    future = Future(np.array([0, 2, 1, 3, 0, 3]), 4, per_token=np.array([2, 2, 2]))
    policy = NextCall(3, 4, num_experts=2, future=future)
    _miss(policy, 0)
    _miss(policy, 2)
    assert _victim(policy, {1}) == 2


def test_next_call_needs_the_future_with_its_tokens():
    with pytest.raises(ValueError, match="needs the future routing and its tokens"):
        NextCall(3, 4, num_experts=2, future=Future(np.array([0, 2]), 4))


def test_next_call_replays_between_cyclic_and_belady_on_layered_routing():
    """Replay builds an offline policy per trace: a layered one is told its layers."""
    trace = synthetic_trace(400, 4, 16, 2, repeat=0.3, seed=2)
    rates = {r["policy"]: r["hit_rate"] for r in sweep(trace, ["cyclic", "next-call"], [0.25])}
    result = replay(trace, "next-call", 0.25)
    assert rates["cyclic"] < rates["next-call"] == result["hit_rate"] < result["belady_hit_rate"]


@pytest.mark.parametrize("name", ["lfu", "slru", "wlfu"])
def test_seed_adds_to_the_frequency_counts(name):
    policy = make_policy(name, 4, 8)
    policy.seed({2: 5.0, 3: 1.5})
    policy.seed({2: 1.0})
    assert policy.count[2] == 6.0
    assert policy.count[3] == 1.5


def test_seeded_expert_outlives_a_more_recent_one():
    cache = _cache(2, policy="wlfu")
    cache.seed({0: 10.0})
    _request(cache, 0, [0, 1])
    _request(cache, 0, [1])
    _request(cache, 0, [2])
    assert _resident(cache) == {(0, 0), (0, 2)}


def test_seed_is_a_no_op_for_lru():
    cache = _cache(2, policy="lru")
    cache.seed({0: 10.0})
    _request(cache, 0, [0, 1])
    _request(cache, 0, [1])
    _request(cache, 0, [2])
    assert _resident(cache) == {(0, 1), (0, 2)}


@pytest.mark.parametrize("counts", [{-1: 1.0}, {8: 1.0}, {1: -2.0}, {1: float("nan")}])
def test_seed_rejects_unknown_keys_and_bad_counts(counts):
    with pytest.raises(ValueError, match="seed"):
        make_policy("wlfu", 4, 8).seed(counts)


def test_unknown_policy_name_lists_the_known_ones():
    known = "age, belady, cyclic, lfu, lru, markov, next-call, slru, wlfu"
    with pytest.raises(ValueError, match=f"unknown policy 'fifo'.*{known}"):
        make_policy("fifo", 4, 8)
    with pytest.raises(ValueError, match="unknown policy 'fifo'"):
        _cache(4, policy="fifo")


def test_policy_spec_options_reach_the_constructor():
    wlfu = make_policy("wlfu:half_life=128, recent_tokens=1", 4, 8)
    assert (wlfu.half_life, len(wlfu.starts)) == (128, 1)
    assert make_policy("slru:protected_share=0.5", 10, 8).protected_slots == 5


def test_unknown_policy_option_names_the_options_of_that_policy():
    with pytest.raises(ValueError, match="'wlfu' has no option 'window'.*guard_share, half_life"):
        make_policy("wlfu:window=256", 4, 8)
    with pytest.raises(ValueError, match="'lru' has no option 'x' \\(its options: none\\)"):
        make_policy("lru:x=1", 4, 8)


@pytest.mark.parametrize("spec, match", [("wlfu:half_life=1.5", "half_life takes an integer"),
                                         ("slru:protected_share=lots", "takes a number"),
                                         ("wlfu:half_life=0", "at least 1 token"),
                                         ("slru:protected_share=2", "in \\[0, 1\\]"),
                                         ("age:freq_share=1", "in \\[0, 1\\)"),
                                         ("wlfu:recent_tokens=99999999999999999999",
                                          "recent_tokens must be in \\[1, 1024\\]")])
def test_bad_policy_option_value_is_a_clear_error(spec, match):
    with pytest.raises(ValueError, match=match):
        make_policy(spec, 4, 8)


def test_the_default_policy_beats_lru_on_a_trace_shaped_like_real_routing():
    """gpt-oss-20b's shape (24 layers x 32 experts, top-4) with its token-to-token reuse: at 10%
    the pool holds less than one token's experts and LRU loses each before its next call."""
    trace = synthetic_trace(512, 24, 32, 4, skew=1.0, repeat=0.4, switch_at=None, seed=3)
    for capacity, margin in ((0.1, 0.2), (0.25, 0.03)):
        result = replay(trace, DEFAULT_POLICY, capacity)
        assert result["hit_rate"] > result["lru_hit_rate"] + margin, (capacity, result)


def test_expert_cache_builds_policies_from_a_factory():
    sizes = []

    def factory(capacity) -> Policy:
        sizes.append(capacity)
        return LRU(capacity, 8)

    cache = _cache(6, policy=factory, layer_slots=[2, 4])
    assert sizes == [2, 4]
    assert all(isinstance(p, LRU) for p in cache.policies)


def test_per_layer_slots_cap_each_layer():
    cache = _cache(5, layers=2, num_experts=8, policy="wlfu", layer_slots=[2, 3])
    evicted = [cache.request(layer, experts)[2]
               for layer, experts in [(0, [0, 1]), (0, [2, 3]), (1, [0, 1, 2])]]
    assert [cache.resident_in(0), cache.resident_in(1)] == [2, 3]
    assert evicted == [[], [0, 1], []]


def test_split_slots_is_uniform_for_equal_weights():
    assert split_slots(12, [1, 1, 1], minimum=2) == [4, 4, 4]
    assert split_slots(10, [1, 1, 1], minimum=1) == [4, 3, 3]


def test_split_slots_is_proportional_to_weights():
    assert split_slots(100, [1, 2, 3, 4], minimum=8) == [10, 20, 30, 40]


def test_split_slots_gives_every_layer_its_minimum():
    assert split_slots(50, [1, 0, 0, 50], minimum=8) == [8, 8, 8, 26]


def test_split_slots_gives_what_the_weighted_layers_cannot_hold_to_the_others():
    """A layer the profile never saw used takes the slots left once the others are full."""
    assert split_slots(60, [1, 0, 1, 1], minimum=2, maximum=16) == [16, 12, 16, 16]
    assert split_slots(80, [1, 0, 0, 1], minimum=2, maximum=16) == [16, 16, 16, 16]


def test_split_slots_caps_at_maximum_and_leaves_the_rest_unused():
    assert split_slots(100, [1, 1, 1, 50], minimum=8, maximum=40) == [20, 20, 20, 40]
    assert split_slots(1000, [1, 1], minimum=8, maximum=128) == [128, 128]


def test_split_slots_stays_within_bounds_on_random_inputs():
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(1, 10))
        weights = rng.random(n) * (rng.random(n) < 0.8)
        low = int(rng.integers(0, 5))
        high = int(rng.integers(low, 20)) if rng.random() < 0.5 else None
        total = int(rng.integers(n * low, n * low + 100))
        slots = split_slots(total, weights, low, high)
        assert sum(slots) <= total and min(slots) >= low
        assert high is None or max(slots) <= high
        if high is None:
            assert sum(slots) == total


@pytest.mark.parametrize(
    "args, match",
    [((5, [1, 1, 1], 2), "minimum"), ((10, [], 1), "weights"), ((10, [1, -1], 1), "weights"),
     ((10, [1, 1], 4, 3), "maximum")],
)
def test_split_slots_rejects_impossible_splits(args, match):
    with pytest.raises(ValueError, match=match):
        split_slots(*args)


def _miss(policy, *keys: int) -> None:
    """A call that used `keys`, none of them resident before it."""
    policy.access(list(keys), list(keys))


def _victim(policy, protected: set[int]) -> int:
    (key,) = policy.victims(1, protected)
    return key


@pytest.mark.parametrize("policy", ONLINE)
def test_a_call_whose_experts_are_all_pinned_leaves_the_policy_working(policy):
    cache = _cache(4, layers=2, policy=policy)
    _request(cache, 0, [0, 1])
    cache.pin(0, 0)
    assert _request(cache, 0, [0]) == []
    cache.tick(1)
    _request(cache, 1, [0, 1])
    loads = _request(cache, 0, [2, 3])  # two victims, never the pinned expert
    assert len(loads) == 2 and (0, 0) in _resident(cache) and len(_resident(cache)) == 4


@pytest.mark.parametrize("policy", ONLINE)
def test_a_pinned_expert_whose_load_failed_is_unpinned_and_read_again(policy):
    """Left pinned without a slot it counted as a hit with slot -1: an out-of-range gather
    (cyclic), or a KeyError from its policy at every later call (lru, slru, lfu)."""
    cache = _cache(4, layers=2, policy=policy)
    _request(cache, 0, [0, 1])
    cache.pin(0, 0)
    assert cache.discard(0, 0)
    assert cache.pinned_total == 0 and cache.capacity(0) == 4
    assert _request(cache, 0, [0]) == [(0, cache.slot_of[0, 0])]  # a miss, read again


@pytest.mark.parametrize("policy", ["cyclic", "age"])
def test_a_policy_survives_one_tick_of_many_half_lives(policy):
    cache = _cache(4, layers=2, policy=f"{policy}:half_life=1")
    _request(cache, 0, [0, 1])
    cache.tick(40_000)  # one forward call of 40k tokens
    _request(cache, 1, [2, 3])
    _request(cache, 0, [2, 3])
    assert len(_resident(cache)) == 4


def test_a_prewarm_share_below_what_is_resident_reads_nothing_more():
    from mlx_moestream.replay import trace_profile

    trace = synthetic_trace(40, 2, 8, 2, seed=4)
    cache = _cache(8, layers=2, num_experts=8, policy="cyclic")
    for layer in range(2):
        _request(cache, layer, [0, 1, 2])
    picks, pins = cache.prewarm_plan(trace_profile(trace, np.arange(40), "w"), 0.5, 0.0, 2)
    assert picks == [] and pins == []


def test_a_prewarm_of_a_per_layer_pool_mid_session_fills_the_layers_with_room():
    """Layer 0's partition is full and its hottest experts are elsewhere: the picks go to
    layer 1, which has room, not to layer 0's experts that no slot can take."""
    from mlx_moestream.profiles import Profile

    cache = _cache(4, layers=2, num_experts=4, policy="cyclic", layer_slots=[2, 2])
    _request(cache, 0, [0, 1])
    decayed = np.array([[0.0, 0.0, 9.0, 8.0], [3.0, 2.0, 0.0, 0.0]])
    profile = Profile("w", {}, decayed.astype(np.int64), decayed, 10, 32, ["l0", "l1"])
    picks, _ = cache.prewarm_plan(profile, 1.0, 0.0, 2)
    assert [pick for pick in picks if cache.admit(*pick) is not None] == [(1, 0), (1, 1)]
