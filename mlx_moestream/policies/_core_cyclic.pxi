# The core of `policies.cyclic.LayerCyclic`, included by _core.pyx.
#
# A call's cost does not grow with the resident keys: a layer's keys outside its latest call have
# one entry at most in its heap of (count, key), mended when it surfaces, and victims come from
# the layer of best bound while they beat the next best.


cdef inline bint _below(double c1, Py_ssize_t k1, double c2, Py_ssize_t k2) noexcept:
    """(c1, k1) < (c2, k2), as Python orders the tuples."""
    return c1 < c2 or (c1 == c2 and k1 < k2)


cdef inline double _score(double distance, double value) noexcept:
    return distance / value if value else INF


cdef class CyclicCore(KeyedCore):
    cdef char* in_heap
    cdef long long* stamp
    cdef long long* call_stamp
    cdef Py_ssize_t* latest  # per layer, `experts` places: the keys of its latest call
    cdef Py_ssize_t* latest_len
    cdef Py_ssize_t* ranked  # the same, least count first (stable), valid when `is_ranked`
    cdef char* is_ranked
    cdef double* least_latest
    cdef double* value
    cdef double* score
    cdef double* heap_count  # per layer, `experts` places: a binary heap of (count, key)
    cdef Py_ssize_t* heap_key
    cdef Py_ssize_t* heap_len
    cdef double* aside_count  # `_evict_least`'s scratch
    cdef Py_ssize_t* aside_key
    cdef long long calls_made, calls, reused, used, offered  # all from 0
    cdef double group_weight, bonus_latest, bonus_old
    cdef double uses[2]
    cdef double chances[2]

    def __init__(self, num_keys: int, experts: int, half_life: int, group_weight: float):
        layers = self._start(num_keys, experts, half_life)
        self.in_heap = <char*> self._held(np.zeros(num_keys, np.int8))
        self.stamp = <long long*> self._held(np.full(num_keys, -1, np.int64))
        self.call_stamp = <long long*> self._held(np.full(layers, -2, np.int64))
        self.latest = <Py_ssize_t*> self._held(np.zeros(layers * experts, np.intp))
        self.latest_len = <Py_ssize_t*> self._held(np.zeros(layers, np.intp))
        self.ranked = <Py_ssize_t*> self._held(np.zeros(layers * experts, np.intp))
        self.is_ranked = <char*> self._held(np.zeros(layers, np.int8))
        self.least_latest = <double*> self._held(np.full(layers, INF))
        self.value = <double*> self._held(np.full(layers, INF))
        self.score = <double*> self._held(np.empty(layers))
        self.heap_count = <double*> self._held(np.empty(layers * experts))
        self.heap_key = <Py_ssize_t*> self._held(np.empty(layers * experts, np.intp))
        self.heap_len = <Py_ssize_t*> self._held(np.zeros(layers, np.intp))
        self.aside_count = <double*> self._held(np.empty(experts))
        self.aside_key = <Py_ssize_t*> self._held(np.empty(experts, np.intp))
        self.group_weight = group_weight
        self._restart_rates()
        self._ready(num_keys, experts, layers)
        self._rates()

    cdef void _restart_rates(self) noexcept:
        """The uses and chances of the latest and of the other keys, before any call."""
        self.uses[0] = self.uses[1] = 1.0
        self.chances[0] = self.chances[1] = 2.0

    def access(self, keys, new=()) -> None:
        cdef list fresh = []
        cdef Py_ssize_t n = self._read_call(keys, new, fresh)
        cdef Py_ssize_t* called = self.call_keys
        cdef Py_ssize_t i, key, base, m, reused = 0, layer = called[0] // self.experts
        cdef long long call
        cdef double c, least = INF, weight = self.weight
        base, m = layer * self.experts, self.latest_len[layer]
        self.calls_made += 1
        call = self.calls_made
        for i in range(n):
            key = called[i]
            c = self._count[key] = self._count[key] + weight
            self.stamp[key] = call
            if c < least:
                least = c
        for i in range(m):  # those gone and resident join the layer's heap, unless there
            key = self.latest[base + i]
            if self.stamp[key] == call:
                reused += 1
            elif not self.in_heap[key] and self.state[key] == 2:
                self._push(layer, self._count[key], key)
                self.in_heap[key] = 1
        # tallied per token; `tick` weighs them (the uses and chances of both groups)
        self.calls += 1
        self.reused += reused
        self.used += n
        self.offered += m
        for key in fresh:
            self.state[key] = 2
        if self.unused:  # it may use prefetched keys (else every hit is a used key already)
            for i in range(n):
                self.state[called[i]] = 2
        for i in range(n):
            self.latest[base + i] = called[i]
        self.latest_len[layer], self.call_stamp[layer], self.is_ranked[layer] = n, call, 0
        self.least_latest[layer] = least
        self.position = layer + 1 if layer + 1 < self.layers else 0
        self._note(layer)

    def warm(self, keys) -> None:
        cdef Py_ssize_t key, layer
        for key in [self._key(item) for item in keys]:  # all checked first
            self.state[key] = 2
            layer = key // self.experts
            if self.stamp[key] == self.call_stamp[layer]:  # it ranks as latest again
                self._latest_changed(layer)
            elif not self.in_heap[key]:
                self._push(layer, self._count[key], key)
                self.in_heap[key] = 1
            self._note(layer)

    def insert(self, keys) -> None:
        cdef Py_ssize_t key
        cdef list checked = [self._key(item) for item in keys]
        for key in checked:
            self.state[key] = 1
        self.unused += checked

    def remove(self, key) -> None:
        cdef Py_ssize_t k = self._key(key), layer = k // self.experts
        self.state[k] = 0  # a heap entry goes when it surfaces; the values noted still hold
        if self.stamp[k] == self.call_stamp[layer]:
            self._latest_changed(layer)

    cdef int _choose(self, Py_ssize_t n, list marked, list chosen) except -1:
        if self.unused:
            chosen += self._unused_victims(n)
        if len(chosen) < n:
            self._evict(n, chosen)
        return 0

    cdef int _evict(self, Py_ssize_t n, list chosen) except -1:
        """Take victims, best layer first, until `chosen` holds `n`."""
        cdef Py_ssize_t j, rival, layer, position = self.position, layers = self.layers
        cdef double least, own, bar, d
        for j in range(layers):  # at most each layer's best
            self.score[j] = self._distance(j) / self.value[j]
        # its latest keys that its call does not use just missed: all count as old
        least = self.least_latest[position]
        if self.heap_len[position] and self.heap_count[position * self.experts] < least:
            least = self.heap_count[position * self.experts]
        # the current layer is tried first: it is usually the best (farthest from its call)
        layer, own = position, _score(layers, least + self.bonus_old)
        self.score[layer] = -1.0
        rival = self._best()  # the next best layer
        bar = self.score[rival]
        while True:
            if own < bar or (own == bar and rival < layer):  # the rival is the best
                self.score[layer] = own
                layer, own = rival, bar
                self.score[layer] = -1.0
                rival = self._best()  # no better than the layer it follows
                bar = self.score[rival]
            if own <= 0:
                raise all_in_use()
            d = self._distance(layer)
            own = _score(d, self._evict_least(layer, n - len(chosen), d, bar, layer < rival,
                                              chosen))
            if len(chosen) == n:
                return 0

    cdef inline double _distance(self, Py_ssize_t layer) noexcept:
        """Layer calls from the current one until `layer`'s next call: 1..layers."""
        return (layer - self.position - 1 + self.layers) % self.layers + 1

    cdef inline Py_ssize_t _best(self) noexcept:
        """The first layer of the highest score."""
        cdef Py_ssize_t j, best = 0
        for j in range(1, self.layers):
            if self.score[j] > self.score[best]:
                best = j
        return best

    cdef list _unused_victims(self, Py_ssize_t n):
        """Up to `n` prefetched keys that no call has used and none protects, in the order
        they came."""
        cdef list chosen = [], keep = []
        cdef Py_ssize_t key
        for key in self.unused:
            if self.state[key] != 1:
                continue  # used or gone since
            if len(chosen) < n and not self.protected[key]:
                self.state[key] = 0
                chosen.append(key)
            else:
                keep.append(key)
        self.unused = keep
        return chosen

    cdef double _evict_least(self, Py_ssize_t layer, Py_ssize_t limit, double distance, double bar,
                             bint wins_ties, list chosen) except? -1.0:
        """Evict the layer's keys of least value, at most `limit` (into `chosen`), while their
        score `distance / value` beats `bar` (or equals it, if `wins_ties`); return at most the
        least value left (inf: none). Its latest keys and its heap are merged, a latest key
        first among equals. The heap is settled only when it may hold a lesser value: entries
        of keys that left or are latest again go, those of protected keys go aside, and an
        entry below its key's count (used since) is raised to it."""
        cdef Py_ssize_t key, at = 0, end, aside = 0, i, base = layer * self.experts
        cdef Py_ssize_t* ranked = self._ranked(layer)
        cdef long long latest = self.call_stamp[layer]
        cdef bint current = layer == self.position, settled = False, evicted_latest = False
        cdef bint from_latest
        cdef double bonus_old = self.bonus_old, latest_value, old_value, value = INF, score, c
        cdef double bonus = bonus_old if current else self.bonus_latest  # see `victims`
        end = self.latest_len[layer]
        old_value = self.heap_count[base] + bonus_old if self.heap_len[layer] else INF
        while limit:
            while at < end and (self.state[ranked[at]] != 2 or self.protected[ranked[at]]):
                at += 1
            latest_value = self._count[ranked[at]] + bonus if at < end else INF
            if old_value < latest_value and not settled:
                while self.heap_len[layer]:
                    c, key = self.heap_count[base], self.heap_key[base]
                    if self.state[key] != 2 or self.stamp[key] == latest:
                        self._pop(layer)
                        self.in_heap[key] = 0
                    elif self.protected[key]:
                        self.aside_count[aside], self.aside_key[aside] = c, key
                        aside += 1
                        self._pop(layer)
                    elif self._count[key] != c:
                        self._pop(layer)
                        self._push(layer, self._count[key], key)
                    else:
                        break
                old_value = self.heap_count[base] + bonus_old if self.heap_len[layer] else INF
                settled = True
            from_latest = latest_value <= old_value
            value = latest_value if from_latest else old_value
            if value == INF:
                break
            score = _score(distance, value)
            if score < bar or (score == bar and not wins_ties):
                break
            if from_latest:
                key = ranked[at]
                at += 1
                evicted_latest = True
            elif self.heap_len[layer]:
                key = self.heap_key[base]  # the next one is no less
                self._pop(layer)
                self.in_heap[key] = 0
                settled = False
            else:  # never with finite counts (see `LayerCyclic.seed`)
                break
            self.state[key] = 0
            chosen.append(key)
            limit -= 1
        for i in range(aside):
            self._push(layer, self.aside_count[i], self.aside_key[i])
        if not current:  # else its call comes next and notes it; until then what is noted holds
            if evicted_latest:
                self._latest_changed(layer)
            self._note(layer)
        return value

    cdef Py_ssize_t* _ranked(self, Py_ssize_t layer) noexcept:
        """The layer's latest keys, least count first (in call order among equals)."""
        cdef Py_ssize_t i, j, key, base = layer * self.experts
        cdef Py_ssize_t* ranked = self.ranked + base
        cdef double c
        if not self.is_ranked[layer]:
            for i in range(self.latest_len[layer]):  # an insertion sort: a handful of keys
                key = self.latest[base + i]
                c = self._count[key]
                j = i
                while j > 0 and self._count[ranked[j - 1]] > c:
                    ranked[j] = ranked[j - 1]
                    j -= 1
                ranked[j] = key
            self.is_ranked[layer] = 1
        return ranked

    cdef void _latest_changed(self, Py_ssize_t layer) noexcept:
        """A key of the layer's latest call left or came back: find its least count again."""
        cdef Py_ssize_t i
        cdef Py_ssize_t* ranked = self._ranked(layer)
        for i in range(self.latest_len[layer]):
            if self.state[ranked[i]] == 2:
                self.least_latest[layer] = self._count[ranked[i]]
                return
        self.least_latest[layer] = INF

    cdef inline void _note(self, Py_ssize_t layer) noexcept:
        """Note a layer's value: a count plus its group's rate as a count."""
        cdef double latest = self.least_latest[layer] + self.bonus_latest
        cdef double old = (self.heap_count[layer * self.experts] if self.heap_len[layer] else INF)
        old += self.bonus_old
        self.value[layer] = old if old < latest else latest

    cdef void _rates(self) noexcept:
        """Each group's use rate as counts (for the blend of `p`), and every layer's value."""
        cdef double scale = self.group_weight * self.weight
        cdef Py_ssize_t layer
        self.bonus_latest = scale * (self.uses[0] / self.chances[0])
        self.bonus_old = scale * (self.uses[1] / self.chances[1])
        for layer in range(self.layers):
            self._note(layer)

    cdef void _fold(self) noexcept:
        """Add the calls tallied since the latest fold to the uses and chances, at the weight
        of their token."""
        cdef double weight = self.weight
        self.uses[0] += self.reused * weight
        self.uses[1] += (self.used - self.reused) * weight
        self.chances[0] += self.offered * weight
        self.chances[1] += (self.experts * self.calls - self.offered) * weight
        self.calls = self.reused = self.used = self.offered = 0

    def _rescale(self, double factor) -> None:
        """Multiply every count by `factor` and rebuild what holds counts."""
        cdef Py_ssize_t i, layer, key, kept, base
        self._fold()
        for i in range(self.num_keys):
            self._count[i] *= factor
        for i in range(2):
            self.uses[i] *= factor
            self.chances[i] *= factor
        if not min(self.chances[0], self.chances[1]) > 0:  # a tick of over a thousand
            self._restart_rates()  # half-lives: start afresh
        for layer in range(self.layers):
            base, kept = layer * self.experts, 0
            for i in range(self.heap_len[layer]):
                key = self.heap_key[base + i]
                self.in_heap[key] = 0
                if self.state[key] == 2 and self.stamp[key] != self.call_stamp[layer]:
                    self.heap_key[base + kept] = key
                    kept += 1
            self.heap_len[layer] = 0
            for i in range(kept):
                key = self.heap_key[base + i]
                self._push(layer, self._count[key], key)
                self.in_heap[key] = 1
            self.is_ranked[layer] = 0  # scaled counts may tie
            self._latest_changed(layer)
        self._rates()

    cdef void _push(self, Py_ssize_t layer, double c, Py_ssize_t key) noexcept:
        cdef Py_ssize_t base = layer * self.experts, i = self.heap_len[layer], parent
        self.heap_len[layer] = i + 1
        while i > 0:
            parent = (i - 1) >> 1
            if not _below(c, key, self.heap_count[base + parent], self.heap_key[base + parent]):
                break
            self.heap_count[base + i] = self.heap_count[base + parent]
            self.heap_key[base + i] = self.heap_key[base + parent]
            i = parent
        self.heap_count[base + i], self.heap_key[base + i] = c, key

    cdef void _pop(self, Py_ssize_t layer) noexcept:
        """Remove the least entry."""
        cdef Py_ssize_t base = layer * self.experts, n = self.heap_len[layer] - 1, i = 0, child
        cdef double c = self.heap_count[base + n]
        cdef Py_ssize_t key = self.heap_key[base + n]
        self.heap_len[layer] = n
        while True:
            child = 2 * i + 1
            if child >= n:
                break
            if child + 1 < n and _below(self.heap_count[base + child + 1],
                                        self.heap_key[base + child + 1],
                                        self.heap_count[base + child], self.heap_key[base + child]):
                child += 1
            if not _below(self.heap_count[base + child], self.heap_key[base + child], c, key):
                break
            self.heap_count[base + i] = self.heap_count[base + child]
            self.heap_key[base + i] = self.heap_key[base + child]
            i = child
        if n:
            self.heap_count[base + i], self.heap_key[base + i] = c, key

