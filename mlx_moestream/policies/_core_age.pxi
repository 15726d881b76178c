# The core of `policies.age.LayerAge`, included by _core.pyx.
#
# A victim search compares each layer's best keys, found by a pass over the layer's used
# resident keys. They hold until its call, its turn to be called, an eviction from it or the
# next token (whose rates differ), so a search passes over the layers once and scans only
# those that changed.


cdef enum:
    LEAST = 4  # members a scan keeps in order: a call evicts a few keys of one layer


cdef class AgeCore(KeyedCore):
    cdef readonly Py_ssize_t ages
    cdef long long* last  # per key (`experts` places a layer): its layer's call that last used it
    cdef long long* calls  # per layer: calls so far
    cdef Py_ssize_t* members  # per layer, `experts` places: its resident keys a call used
    cdef Py_ssize_t* member_len
    cdef Py_ssize_t* member_at  # per key: its place among its layer's members, -1: none
    cdef char* stale  # per layer: its best needs a scan
    cdef double* least_chance  # per layer, `LEAST` places: its members of least use chance,
    cdef Py_ssize_t* least_key  # ordered by chance, then key (the next victims in order)
    cdef Py_ssize_t* least_at  # per layer: the first of them not evicted since its scan
    cdef Py_ssize_t* least_len
    cdef char* more  # per layer: its scan found more members than `LEAST`
    cdef double* uses  # per age, times `weight`: keys of that age used at their layer's call
    cdef double* offers  # and keys of that age at a call
    cdef double* by_age  # uses / offers as the current token started
    cdef long long* tally  # `access`'s scratch: keys per age
    cdef long long* tally_used
    cdef Py_ssize_t resident  # keys not in state 0
    cdef double freq_share, per_token, rate_scale

    def __init__(self, num_keys: int, experts: int, half_life: int, freq_share: float,
                 per_token: float, ages: int):
        layers = self._start(num_keys, experts, half_life)
        self.last = <long long*> self._held(np.full(layers * experts, -1, np.int64))
        self.calls = <long long*> self._held(np.zeros(layers, np.int64))
        self.members = <Py_ssize_t*> self._held(np.zeros(layers * experts, np.intp))
        self.member_len = <Py_ssize_t*> self._held(np.zeros(layers, np.intp))
        self.member_at = <Py_ssize_t*> self._held(np.full(num_keys, -1, np.intp))
        self.stale = <char*> self._held(np.ones(layers, np.int8))
        self.least_chance = <double*> self._held(np.empty(layers * LEAST))
        self.least_key = <Py_ssize_t*> self._held(np.empty(layers * LEAST, np.intp))
        self.least_at = <Py_ssize_t*> self._held(np.zeros(layers, np.intp))
        self.least_len = <Py_ssize_t*> self._held(np.zeros(layers, np.intp))
        self.more = <char*> self._held(np.zeros(layers, np.int8))
        self.uses = <double*> self._held(np.ones(ages))
        self.offers = <double*> self._held(np.full(ages, 2.0))
        self.by_age = <double*> self._held(np.full(ages, 0.5))
        self.tally = <long long*> self._held(np.zeros(ages, np.int64))
        self.tally_used = <long long*> self._held(np.zeros(ages, np.int64))
        self.freq_share, self.per_token, self.rate_scale = freq_share, per_token, per_token
        self.ages = ages
        self._ready(num_keys, experts, layers)

    cdef inline Py_ssize_t _age(self, long long last, long long call) noexcept:
        """The age at its layer's call number `call` of a key last used at call `last`."""
        cdef Py_ssize_t age
        if last < 0:
            return self.ages - 1
        age = 63 - __builtin_clzll(<unsigned long long> (call - last))
        return age if age < self.ages - 2 else self.ages - 2

    def access(self, keys, new=()) -> None:
        # `new` is checked only: every called key becomes used, fresh or not
        cdef Py_ssize_t n = self._read_call(keys, new, [])
        cdef Py_ssize_t* called = self.call_keys
        cdef Py_ssize_t i, key, ages = self.ages, layer = called[0] // self.experts, base
        cdef long long call
        cdef double weight = self.weight
        base, call = layer * self.experts, self.calls[layer] + 1
        for i in range(ages):
            self.tally[i] = self.tally_used[i] = 0
        for i in range(self.experts):  # the ages of every key of the layer at this call
            self.tally[self._age(self.last[base + i], call)] += 1
        for i in range(n):
            self.tally_used[self._age(self.last[called[i]], call)] += 1
        for i in range(ages):
            self.offers[i] += weight * self.tally[i]
            self.uses[i] += weight * self.tally_used[i]
        self.calls[layer] = call
        for i in range(n):
            key = called[i]
            self.last[key] = call
            self._count[key] += weight
            self._use(key)
        self.position = layer + 1 if layer + 1 < self.layers else 0
        self.stale[layer] = self.stale[self.position] = 1  # the next's ages count to its next call

    cdef inline void _use(self, Py_ssize_t key) noexcept:
        """Make a resident (or fresh) key used: a member of its layer."""
        cdef Py_ssize_t layer = key // self.experts
        if self.state[key] == 0:
            self.resident += 1
        self.state[key] = 2
        if self.member_at[key] < 0:
            self.member_at[key] = self.member_len[layer]
            self.members[layer * self.experts + self.member_len[layer]] = key
            self.member_len[layer] += 1
        self.stale[layer] = 1

    cdef inline void _leave(self, Py_ssize_t key, signed char state) noexcept:
        """Set a key's state to 0 (gone) or 1 (prefetched): it is no member then."""
        cdef Py_ssize_t layer = key // self.experts, at = self.member_at[key], moved
        if self.state[key] == 0 and state:
            self.resident += 1
        elif self.state[key] and not state:
            self.resident -= 1
        self.state[key] = state
        if at >= 0:
            self.member_len[layer] -= 1
            moved = self.members[layer * self.experts + self.member_len[layer]]
            self.members[layer * self.experts + at] = moved
            self.member_at[moved] = at
            self.member_at[key] = -1
            self.stale[layer] = 1

    def warm(self, keys) -> None:
        cdef Py_ssize_t key
        for key in [self._key(item) for item in keys]:  # all checked first
            self._use(key)

    def insert(self, keys) -> None:
        cdef Py_ssize_t key
        cdef list checked = [self._key(item) for item in keys]
        for key in checked:
            self._leave(key, 1)
        self.unused += checked

    def remove(self, key) -> None:
        self._leave(self._key(key), 0)

    cdef int _choose(self, Py_ssize_t n, list marked, list chosen) except -1:
        cdef Py_ssize_t key, busy = 0
        for key in marked:
            self.stale[key // self.experts] = 1  # its least may be protected
            busy += self.state[key] != 0
        if self.resident - busy < n:
            raise all_in_use()
        if self.unused:
            chosen += self._unused_victims(n)
        if len(chosen) < n:
            self._evict(n, chosen)
        return 0

    cdef int _released(self, list marked) except -1:
        cdef Py_ssize_t key
        for key in marked:
            self.stale[key // self.experts] = 1
        return 0

    cdef list _unused_victims(self, Py_ssize_t n):
        """Up to `n` prefetched keys that no call has used and none protects, least key first."""
        cdef list waiting = sorted({key for key in self.unused if self.state[key] == 1})
        cdef list chosen = [], keep = []
        cdef Py_ssize_t key
        for key in waiting:
            if len(chosen) < n and not self.protected[key]:
                self._leave(key, 0)
                chosen.append(key)
            else:
                keep.append(key)
        self.unused = keep
        return chosen

    cdef int _evict(self, Py_ssize_t n, list chosen) except -1:
        """Evict used keys, least chance per layer call until their next call first, until
        `chosen` holds `n`: from the best layer for as long as it beats the runner-up."""
        cdef Py_ssize_t layer, key, best, best_key, rival_key
        cdef double score, least, bar, distance
        while True:
            best, best_key, rival_key, least, bar = -1, -1, -1, INF, INF
            for layer in range(self.layers):
                key = self._next(layer)
                if key < 0:
                    continue
                score = self._next_chance(layer) / self._distance(layer)
                if score < least or (score == least and key < best_key):
                    bar, rival_key = least, best_key
                    least, best_key, best = score, key, layer
                elif score < bar or (score == bar and key < rival_key):
                    bar, rival_key = score, key
            if best < 0:
                raise all_in_use()
            distance = self._distance(best)
            while True:
                self._leave(best_key, 0)
                self.stale[best] = 0  # the next of its least holds
                self.least_at[best] += 1
                chosen.append(best_key)
                if len(chosen) == n:
                    return 0
                best_key = self._next(best)
                if best_key < 0:
                    break
                score = self._next_chance(best) / distance
                if not (score < bar or (score == bar and best_key < rival_key)):
                    break

    cdef inline double _distance(self, Py_ssize_t layer) noexcept:
        """Layer calls from the current one until `layer`'s next call: 1..layers."""
        return (layer - self.position - 1 + self.layers) % self.layers + 1

    cdef inline double _next_chance(self, Py_ssize_t layer) noexcept:
        return self.least_chance[layer * LEAST + self.least_at[layer]]

    cdef inline Py_ssize_t _next(self, Py_ssize_t layer) noexcept:
        """The layer's next victim (-1: none), after a scan if it changed or its least ran out."""
        if self.stale[layer] or (self.least_at[layer] == self.least_len[layer]
                                 and self.more[layer]):
            self._scan(layer)
        if self.least_at[layer] == self.least_len[layer]:
            return -1
        return self.least_key[layer * LEAST + self.least_at[layer]]

    cdef void _scan(self, Py_ssize_t layer) noexcept:
        """Keep the layer's `LEAST` members of least use chance at its next call, in order,
        skipping protected keys."""
        cdef Py_ssize_t i, j, key, n = 0, found = 0, base = layer * self.experts
        cdef Py_ssize_t* keys = self.least_key + layer * LEAST
        cdef double* chances = self.least_chance + layer * LEAST
        cdef long long call = self.calls[layer] + (2 if layer == self.position else 1)
        cdef double chance, share = self.freq_share, rest = 1.0 - self.freq_share
        for i in range(self.member_len[layer]):
            key = self.members[base + i]
            if self.protected[key]:
                continue
            found += 1
            chance = (share * (self._count[key] * self.rate_scale)
                      + rest * self.by_age[self._age(self.last[key], call)])
            if n == LEAST and not (chance < chances[n - 1]
                                   or (chance == chances[n - 1] and key < keys[n - 1])):
                continue
            j = n if n < LEAST else LEAST - 1  # an insertion into the few kept
            while j > 0 and (chance < chances[j - 1]
                             or (chance == chances[j - 1] and key < keys[j - 1])):
                chances[j], keys[j] = chances[j - 1], keys[j - 1]
                j -= 1
            chances[j], keys[j] = chance, key
            if n < LEAST:
                n += 1
        self.least_at[layer], self.least_len[layer] = 0, n
        self.more[layer] = found > n
        self.stale[layer] = 0

    cdef void _rates(self) noexcept:
        """Take the rates per age and the weight for the coming token: every best changes."""
        cdef Py_ssize_t i
        self.rate_scale = self.per_token / self.weight
        for i in range(self.ages):
            self.by_age[i] = self.uses[i] / self.offers[i]
        for i in range(self.layers):
            self.stale[i] = 1

    def _rescale(self, double factor) -> None:
        """Multiply every count, use and offer by `factor`."""
        cdef Py_ssize_t i
        cdef bint restart = False
        for i in range(self.num_keys):
            self._count[i] *= factor
        for i in range(self.ages):
            self.uses[i] *= factor
            self.offers[i] *= factor
            restart = restart or not self.offers[i] > 0
        if restart:  # a tick of over a thousand half-lives: start afresh
            for i in range(self.ages):
                self.uses[i], self.offers[i] = 1.0, 2.0
        self._rates()
