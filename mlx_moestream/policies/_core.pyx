# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The compiled cores of the `cyclic` and `age` policies (`_core_cyclic.pxi`, `_core_age.pxi`,
included below), over `KeyedCore`, what both keep and do alike. Their rules are documented in
cyclic.py and age.py.

They run on every MoE layer call, where CPython spent 7 us per layer per token (top-k 8 of 128
experts) over a few hundred bytecodes. Each key's state lives in numpy arrays read through raw
pointers, every key the caller passes checked against `num_keys` first.
"""

import numpy as np

from mlx_moestream.policies.base import add_counts, all_in_use

from libc.math cimport INFINITY, pow

cdef extern from *:
    const char* _SOURCE_DIGEST "SOURCE_DIGEST"  # given by setup.py
    int __builtin_clzll(unsigned long long) noexcept

SOURCE_DIGEST = _SOURCE_DIGEST.decode()  # sha256 of the sources as they were built
cdef double INF = INFINITY


cdef class KeyedCore:
    """The per-key state, key checks, protected keys, seeds and token clock of a compiled
    policy."""
    cdef readonly Py_ssize_t experts, layers, num_keys
    cdef readonly object count  # decayed uses per key, times `weight` (float64)
    cdef readonly double weight
    cdef list unused  # prefetched keys, in order
    cdef list _arrays  # the arrays the pointers read
    cdef double* _count
    cdef signed char* state  # 0: not resident, 1: prefetched, unused, 2: used
    cdef char* protected
    cdef Py_ssize_t* call_keys  # `access`'s keys, checked (`_read_call`)
    cdef Py_ssize_t position  # layer of the current call: the one after the latest accessed
    cdef long long tokens
    cdef double rescaled  # halvings already applied to the counts, from 0
    cdef double half_life

    cdef Py_ssize_t _start(self, Py_ssize_t num_keys, Py_ssize_t experts,
                           double half_life) except -1:
        """Check the sizes and allocate the per-key state; return the number of layers. The
        sizes are set by `_ready`, last: until then (an allocation failed) every call refuses."""
        if self.layers:
            raise RuntimeError("a policy is initialized once")
        if num_keys < 1 or experts < 1:
            raise ValueError(f"a policy needs keys and experts, got {num_keys} and {experts}")
        self._arrays = []
        self.count = np.zeros(num_keys)
        self._count = <double*> self._held(self.count)
        self.state = <signed char*> self._held(np.zeros(num_keys, np.int8))
        self.protected = <char*> self._held(np.zeros(num_keys, np.int8))
        self.call_keys = <Py_ssize_t*> self._held(np.empty(experts, np.intp))
        self.half_life, self.weight = half_life, 1.0  # what one use adds now
        self.unused = []
        return -(-num_keys // experts)

    cdef void _ready(self, Py_ssize_t num_keys, Py_ssize_t experts, Py_ssize_t layers) noexcept:
        self.num_keys, self.experts, self.layers = num_keys, experts, layers

    cdef size_t _held(self, object array) except 0:
        """The address of `array`'s memory, which the policy keeps alive."""
        self._arrays.append(array)
        return array.ctypes.data

    cdef inline Py_ssize_t _key(self, object key) except -1:
        cdef Py_ssize_t k = key
        if k < 0 or k >= self.num_keys:
            raise IndexError(f"key {k} is outside [0, {self.num_keys})")
        return k

    cdef Py_ssize_t _read_call(self, keys, new, list fresh) except -1:
        """Read and check an `access`'s keys into `call_keys` and its `new` ones into `fresh`;
        return how many keys it names. Every key is read once, before any change: a refused
        call leaves no trace, and no code of the caller's objects runs after."""
        cdef list items = [self._key(item) for item in keys]
        cdef Py_ssize_t i, layer, n = len(items)
        fresh += [self._key(item) for item in new]
        if not 0 < n <= self.experts:
            raise ValueError(f"a call names 1 to {self.experts} keys of one layer, got {n}")
        for i in range(n):
            self.call_keys[i] = <Py_ssize_t> items[i]
        layer = self.call_keys[0] // self.experts
        for i in range(1, n):
            if self.call_keys[i] // self.experts != layer:  # a layer's places have no room
                raise ValueError(f"a call's keys are of one layer: {self.call_keys[0]} and "
                                 f"{self.call_keys[i]} are not")
        return n

    def victims(self, Py_ssize_t n, protected) -> list:
        cdef Py_ssize_t key
        cdef list marked = [], chosen = []
        if not self.layers:
            raise RuntimeError("the policy was never initialized")
        try:  # the protected keys are flagged for the step, and unflagged however it ends
            for item in protected:
                key = item
                if 0 <= key < self.num_keys and not self.protected[key]:
                    self.protected[key] = 1
                    marked.append(key)
            self._choose(n, marked, chosen)
            return chosen
        finally:
            for key in marked:
                self.protected[key] = 0
            self._released(marked)

    cdef int _choose(self, Py_ssize_t n, list marked, list chosen) except -1:
        """Evict `n` keys into `chosen`, none of them flagged protected (`marked` lists those
        this search flagged)."""
        raise NotImplementedError

    cdef int _released(self, list marked) except -1:
        """The keys `marked` are no longer protected."""
        return 0

    def seed(self, counts: dict) -> None:
        add_counts(self.count, counts, self.weight)
        self._rescale(1.0)  # every ordering of counts is built again

    def tick(self, tokens: int) -> None:
        cdef double halvings
        self._fold()
        self.tokens += tokens
        halvings = <double> self.tokens / self.half_life - self.rescaled
        if halvings > 64:  # rescale long before the weight overflows; the order is unchanged
            self._rescale(pow(0.5, halvings))
            self.rescaled += halvings
            halvings = 0.0
        self.weight = pow(2.0, halvings)
        self._rates()

    cdef void _fold(self) noexcept:
        """Take in what was tallied over the token that ends."""

    cdef void _rates(self) noexcept:
        """Take the learned rates and the weight for the coming token."""


include "_core_cyclic.pxi"
include "_core_age.pxi"
