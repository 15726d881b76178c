"""Routing traces: which experts each token used at each MoE layer, recorded or synthetic.

A trace file is an `.npz` holding
  experts     int16 [tokens, layers, k]  routed expert ids, -1 where a position has none
  num_experts integer scalar             experts per layer; every id is in [-1, num_experts)
  weights     float16 [tokens, layers, k] optional router weights
  segment_id  integer [tokens]           optional: which workload each token belongs to
Other arrays (a converter's metadata: `model`, `source`, `segment_names`, ...) are kept in
`Trace.extras`, for display, and otherwise ignored; those of pickled objects are left out
(never unpickled). Plain numpy (no mlx), like the cache and the policies that replay it.
"""

from __future__ import annotations

import math
import operator
import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import TraceError
from .files import WRITER, atomic_write, check_replaceable, open_regular

_REQUIRED = ("experts", "num_experts")
# Past this many bytes of arrays a file is refused before it is decompressed: `replay` holds each
# routed id as Python objects, about 45 times its two bytes, so it stays under 3 GiB. The ids of
# 85k tokens x 48 layers x top-8 are 64 MiB.
MAX_TRACE_BYTES = 64 * 2**20
_OPTIONAL = ("weights", "segment_id")
_MAX_EXPERTS = int(np.iinfo(np.int16).max) + 1



@dataclass(eq=False)
class Trace:
    """The routing of one run; `experts[t, l]` are token t's experts at MoE layer l."""

    experts: np.ndarray
    num_experts: int
    weights: np.ndarray | None = None
    segment_id: np.ndarray | None = None
    extras: dict[str, np.ndarray] = field(default_factory=dict)  # other arrays of the file

    def __post_init__(self):
        problem = _problem(self.experts, self.num_experts, self.weights, self.segment_id)
        if problem:
            raise TraceError(f"trace: {problem}")
        self.num_experts = int(self.num_experts)

    @property
    def tokens(self) -> int:
        return self.experts.shape[0]

    @property
    def layers(self) -> int:
        return self.experts.shape[1]

    @property
    def top_k(self) -> int:
        return self.experts.shape[2]

    @classmethod
    def load(cls, path: str | os.PathLike) -> Trace:
        """Read and validate a trace file; every problem raises `TraceError` naming the file.
        Each array's size is read from its header first: a file that would expand beyond
        `MAX_TRACE_BYTES` (a zip bomb) is refused before anything is decompressed."""
        unreadable = "not a readable trace .npz"
        try:
            with open_regular(path, unreadable, TraceError) as f:
                # anything but a zip numpy would read as a pickle, and refuse as one
                if f.read(4) not in (b"PK\x03\x04", b"PK\x05\x06"):
                    raise TraceError(f"{path}: {unreadable} (not a zip of .npy arrays)")
                f.seek(0)
                with np.load(f, allow_pickle=False) as data:
                    pickled = _check_sizes(path, data)
                    # pickled objects are never loaded (that could run code): another tool's
                    # metadata of that kind is left out
                    arrays = {name: data[name] for name in data.files
                              if name not in pickled or name in _REQUIRED + _OPTIONAL}
        except TraceError:
            raise
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
            raise TraceError(f"{path}: {unreadable} ({e})") from e
        missing = [name for name in _REQUIRED if name not in arrays]
        if missing:
            raise TraceError(f"{path}: missing {', '.join(missing)}")
        fields = {name: arrays.pop(name, None) for name in _REQUIRED + _OPTIONAL}
        problem = _problem(**fields)
        if problem:
            raise TraceError(f"{path}: {problem}")
        return cls(**fields, extras=arrays)

    def save(self, path: str | os.PathLike) -> None:
        """Write the trace atomically (see `files.atomic_write`); see `check_save_target`."""
        path = Path(path)
        check_save_target(path)
        arrays = {"experts": self.experts, "num_experts": np.int64(self.num_experts),
                  "writer": np.array(WRITER)}
        if self.weights is not None:
            arrays["weights"] = self.weights
        if self.segment_id is not None:
            arrays["segment_id"] = self.segment_id
        atomic_write(path, lambda f: np.savez_compressed(f, **arrays))

    def usage(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """How many tokens in [start, stop) used each expert: float [layers, num_experts]."""
        ids = self.experts[start:stop].astype(np.int64)
        layer = np.arange(self.layers)[None, :, None]
        keys = (layer * self.num_experts + ids)[ids >= 0]
        counts = np.bincount(keys, minlength=self.layers * self.num_experts)
        return counts.reshape(self.layers, self.num_experts).astype(np.float64)

    def expert_counts(self, start: int = 0, stop: int | None = None) -> dict[int, float]:
        """An activation profile `{layer * num_experts + expert: uses}` of tokens [start, stop),
        the form `ExpertCache.seed` takes."""
        flat = self.usage(start, stop).ravel()
        keys = np.flatnonzero(flat)
        return dict(zip(keys.tolist(), flat[keys].tolist()))

    def working_set(self) -> np.ndarray:
        """Distinct experts each layer used: int [layers], a weight for `split_slots`."""
        return (self.usage() > 0).sum(axis=1)

    def routing_entropy(self) -> np.ndarray:
        """Entropy in bits of each layer's expert usage: float [layers], a weight for
        `split_slots`."""
        usage = self.usage()
        p = usage / np.maximum(usage.sum(axis=1, keepdims=True), 1)
        return -(p * np.log2(np.where(p > 0, p, 1))).sum(axis=1)


class TraceRecorder:
    """Collects a live run's routing. Call `record(layer, ids)` for every MoE layer call, layers
    0..L-1 in order within each forward call; `ids` is [tokens, k] (leading axes flatten into
    tokens), so a prefill call records all its tokens at once. Recording copies `ids` onto a list;
    the work happens in `to_trace`, which drops a trailing forward call that did not finish.
    """

    def __init__(self, num_layers: int, num_experts: int):
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.calls: list[list[tuple[np.ndarray, np.ndarray | None]]] = []

    def record(self, layer: int, ids: np.ndarray, weights: np.ndarray | None = None) -> None:
        """A forward call whose layer 0 was not recorded (recording started during it, from
        another thread) is left out, not an error raised inside the model's call."""
        if layer == 0:
            self.calls.append([])
        elif not self.calls or len(self.calls[-1]) == self.num_layers:
            return
        expected = len(self.calls[-1])
        if layer != expected or layer >= self.num_layers:
            raise ValueError(f"layer {layer} recorded out of order: expected layer {expected}")
        self.calls[-1].append((np.array(ids), None if weights is None else np.array(weights)))

    def to_trace(self) -> Trace:
        calls = [c for c in self.calls if len(c) == self.num_layers]
        if not calls:
            raise TraceError("no complete forward call was recorded")
        k = calls[0][0][0].shape[-1]
        experts = np.concatenate(
            [np.stack([ids.reshape(-1, k) for ids, _ in call], axis=1) for call in calls]
        ).astype(np.int64)
        experts = np.where((experts >= 0) & (experts < self.num_experts), experts, -1)
        weights = None
        if all(w is not None for call in calls for _, w in call):
            weights = np.concatenate(
                [np.stack([w.reshape(-1, k) for _, w in call], axis=1) for call in calls]
            ).astype(np.float16)
        return Trace(experts.astype(np.int16), self.num_experts, weights)


def synthetic_trace(
    tokens: int = 4096,
    layers: int = 16,
    num_experts: int = 128,
    top_k: int = 8,
    skew: float = 1.0,
    repeat: float = 0.1,
    switch_at: float | None = 0.5,
    seed: int = 0,
    sample_seed: int | None = None,
) -> Trace:
    """A trace with skewed expert popularity, temporal locality and a mid-trace workload switch.

    How it is built:
    - Workloads: two (one if `switch_at` is None). For each workload and layer the experts get
      ranks 1..num_experts by a random permutation drawn from `seed`; the expert of rank r has
      popularity proportional to r ** -skew (Zipf-like; skew 0 is uniform). Workloads are drawn
      independently, so the second one's hot experts are mostly cold in the first.
    - Segments: tokens before round(switch_at * tokens) use workload 0, the rest workload 1;
      `segment_id` is the workload of each token.
    - Routing: at every layer a token gets `top_k` distinct experts. Each of the previous token's
      experts at that layer is kept independently with probability `repeat` (temporal locality;
      token 0 keeps none); the remaining places are drawn without replacement from the
      workload's popularity over the experts not kept (Gumbel top-k: the same distribution as
      successive draws proportional to popularity). Ids are listed kept first, then in draw order.
    - `weights`: the chosen experts' popularities, normalised to sum to 1 per token and layer.
    - Draws for tokens come from `sample_seed` (default `seed`): another `sample_seed` with the
      same `seed` gives new tokens of the same workloads, e.g. a profile run to seed a cache.
    """
    if tokens < 1 or layers < 1 or not 1 <= top_k <= num_experts < _MAX_EXPERTS:
        raise ValueError("need tokens >= 1, layers >= 1 and 1 <= top_k <= num_experts <= 32767")
    if not 0.0 <= repeat <= 1.0 or skew < 0:
        raise ValueError(f"need 0 <= repeat <= 1 and skew >= 0, got {repeat}, {skew}")
    if switch_at is not None and not 0.0 < switch_at < 1.0:
        raise ValueError(f"switch_at must be in (0, 1) or None, got {switch_at}")
    workload_rng = np.random.default_rng([seed, 0])
    rng = np.random.default_rng([seed if sample_seed is None else sample_seed, 1])
    workloads = 1 if switch_at is None else 2
    ranks = np.stack([
        np.stack([workload_rng.permutation(num_experts) + 1 for _ in range(layers)])
        for _ in range(workloads)
    ])
    log_popularity = -skew * np.log(ranks)  # [workloads, layers, num_experts]
    switch = tokens if switch_at is None else int(round(switch_at * tokens))
    segment_id = (np.arange(tokens) >= switch).astype(np.int32)

    experts = np.empty((tokens, layers, top_k), np.int64)
    rows = np.arange(layers)[:, None]
    for t in range(tokens):
        score = log_popularity[segment_id[t]] + rng.gumbel(size=(layers, num_experts))
        if t > 0 and repeat > 0:
            keep = rng.random((layers, top_k)) < repeat
            score[np.nonzero(keep)[0], experts[t - 1][keep]] = np.inf
        top = np.argpartition(-score, top_k - 1, axis=1)[:, :top_k]
        order = np.argsort(-score[rows, top], axis=1, kind="stable")
        experts[t] = top[rows, order]

    popularity = np.exp(log_popularity[segment_id[:, None], np.arange(layers)[None, :]])
    chosen = np.take_along_axis(popularity, experts, axis=2)
    weights = (chosen / chosen.sum(axis=2, keepdims=True)).astype(np.float16)
    return Trace(experts.astype(np.int16), num_experts, weights, segment_id)


def check_save_target(path: str | os.PathLike) -> None:
    """An existing file is replaced only if it is a trace this tool wrote (see
    `check_replaceable`): another tool's trace is not ours to replace."""
    check_replaceable(path, _written_here, "a routing trace mlx-moestream wrote", TraceError)


def _written_here(path: Path) -> None:
    Trace.load(path)  # checked as every trace is (sizes first) before an array is read
    with np.load(path, allow_pickle=False) as data:
        if "writer" not in data.files or data["writer"].shape or str(data["writer"]) != WRITER:
            raise TraceError(f"{path}: a trace another tool wrote")


def _check_sizes(path, data: np.lib.npyio.NpzFile) -> set[str]:
    """Refuse an archive whose arrays, by their headers, add up to more than MAX_TRACE_BYTES;
    return the names of those that hold pickled objects."""
    total, pickled = 0, set()
    for member in data.zip.namelist():
        with data.zip.open(member) as f:
            version = np.lib.format.read_magic(f)
            header = {(1, 0): np.lib.format.read_array_header_1_0,
                      (2, 0): np.lib.format.read_array_header_2_0}.get(version)
            if header is None:  # read as any unreadable file: "cannot read a trace .npz"
                raise ValueError(f"array '{member}' has no .npy header")
            shape, _, dtype = header(f)
        if dtype.hasobject:
            pickled.add(member.removesuffix(".npy"))
        total += math.prod(shape) * dtype.itemsize
        if total > MAX_TRACE_BYTES:
            raise TraceError(f"{path}: array '{member.removesuffix('.npy')}' would expand the "
                             f"trace past {MAX_TRACE_BYTES >> 20} MiB ({shape} {dtype}): refused")
    return pickled


def _problem(experts, num_experts, weights=None, segment_id=None) -> str | None:
    """What is wrong with these trace arrays, or None."""
    if not isinstance(experts, np.ndarray) or experts.dtype != np.int16:
        return f"experts must be an int16 array, got {_kind(experts)}"
    if experts.ndim != 3:
        return f"experts must be [tokens, layers, k], got {experts.ndim} dimensions"
    if min(experts.shape) == 0:
        return f"experts is empty: shape {experts.shape}"
    try:
        if isinstance(num_experts, (bool, np.bool_)):
            raise TypeError
        num_experts = operator.index(num_experts)
    except TypeError:
        return f"num_experts must be an integer scalar, got {num_experts!r}"
    if not 1 <= num_experts <= _MAX_EXPERTS:
        return f"num_experts must be in [1, {_MAX_EXPERTS}], got {num_experts}"
    low, high = int(experts.min()), int(experts.max())
    if low < -1:
        return f"expert ids must be >= -1 (-1 = none), found {low}"
    if high >= num_experts:
        return f"expert ids must be < num_experts = {num_experts}, found {high}"
    if high < 0:
        return "no expert ids: every entry is -1 (none), nothing was routed"
    if weights is not None:
        if not isinstance(weights, np.ndarray) or weights.dtype != np.float16:
            return f"weights must be a float16 array, got {_kind(weights)}"
        if weights.shape != experts.shape:
            return f"weights shape {weights.shape} does not match experts shape {experts.shape}"
        if not np.isfinite(weights).all():
            return "weights must be finite"
    if segment_id is not None:
        if not isinstance(segment_id, np.ndarray) or segment_id.dtype.kind not in "iu":
            return f"segment_id must be an integer array, got {_kind(segment_id)}"
        if segment_id.ndim != 1:
            return f"segment_id must be [tokens], got {segment_id.ndim} dimensions"
        if len(segment_id) != len(experts):
            return f"segment_id has {len(segment_id)} tokens, experts has {len(experts)}"
    return None


def _kind(value) -> str:
    return str(value.dtype) if isinstance(value, np.ndarray) else type(value).__name__
