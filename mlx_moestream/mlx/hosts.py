"""Expert parallelism: each host computes its own experts' positions and the hosts sum them.

Also the distributed load's end (every host joins, checkpoints compared) and `host_stats`.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import ModelError, StoreError
from ..runtime import Runtime
from ..session import runtime_of
from ..stats import hit_rate
from ..store import ExpertStore
from .streaming import StreamingExperts


class HostExperts(nn.Module):
    """Expert parallelism: this host computes the positions routed to its own experts and
    zeros elsewhere, and an `all_sum` over the hosts gives every host every position's output,
    exactly the single host's (x + 0 is x). Selecting, not multiplying, keeps whatever a
    position of another host's expert computed here (from any slot) out of the sum.

    The first MoE layer also compares the hosts' inputs first (`checks_inputs`): hosts fed
    other tokens (a script that reads its prompt on each host, or seeds its sampling apart)
    would sum the outputs of other tokens' experts, and hosts fed other lengths would exchange
    outputs of other shapes: every host raises instead, at the same point, before any expert
    of that call is read. Hosts of different chips may compute the same tokens' hidden states
    a few roundings apart: each position is compared within `INPUT_TOLERANCE` of its norm."""

    def __init__(self, local: nn.Module, first: int, count: int, group, runtime: Runtime,
                 checks_inputs: bool = False):
        super().__init__()
        self.local = local  # StreamingExperts or ResidentExperts: a child, see `PooledExperts`
        object.__setattr__(self, "first", first)
        object.__setattr__(self, "count", count)
        object.__setattr__(self, "group", group)
        object.__setattr__(self, "runtime", runtime)
        object.__setattr__(self, "checks_inputs", checks_inputs)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """Every position's output, summed over the hosts. A read error is this host's alone:
        raised, it would skip the exchange the others wait in and pair each later one with
        another layer's (wrong outputs on every host), so it ends this host instead, and the
        others as a lost host does."""
        if self.checks_inputs:
            self._check_inputs(x)
        try:
            y, owned = self._own_part(x, indices)
        except StoreError as e:
            end_host(f"host {self.runtime.host[0]}: {e} (the other hosts wait for its part of "
                     f"this layer: every host ends)")
        y = mx.where(owned[..., None], y, 0)
        y = mx.distributed.all_sum(y, group=self.group)
        with self.runtime.backend.watchdog:
            mx.eval(y)
        self.runtime.count_sync()
        return y

    def _check_inputs(self, x: mx.array) -> None:
        """Raise on every host where one was given other inputs than host 0: first the number
        of positions (the prints' shape), then each position's print."""
        positions = x.size // x.shape[-1]
        counts = self._gathered(mx.array([positions], mx.int32))[:, 0]
        apart = counts != counts[0]  # every host sees the same counts, and takes the same way
        if not apart.any():
            prints = self._gathered(_input_prints(x))  # [hosts, positions, 4 + norm]
            scale = np.maximum(prints[:, :, -1:], prints[:1, :, -1:]) * INPUT_TOLERANCE
            apart = (np.abs(prints[:, :, :-1] - prints[:1, :, :-1]) > scale).any(axis=(1, 2))
        if apart.any():
            raise ValueError(f"host {int(apart.argmax())} was given other input tokens than "
                             "host 0: every host must make the same calls with the same inputs "
                             "(and sample alike: do not seed hosts apart)")

    def _gathered(self, value: mx.array) -> np.ndarray:
        """Every host's `value` (of one shape on every host), in host order: each sums its
        own in its row, zeros elsewhere (x + 0 is x)."""
        host, hosts = self.runtime.host
        rows = mx.where(mx.arange(hosts).reshape(-1, *[1] * value.ndim) == host, value, 0)
        rows = mx.distributed.all_sum(rows, group=self.group)
        with self.runtime.backend.watchdog:
            mx.eval(rows)
        self.runtime.count_sync()
        return np.array(rows)

    def _own_part(self, x: mx.array, indices: mx.array) -> tuple[mx.array, mx.array]:
        """The outputs of the positions routed to this host's experts, and where those are."""
        if isinstance(self.local, StreamingExperts):  # it syncs for the ids anyway: once here
            self.local.start_routing(indices)
            ids = np.array(indices).astype(np.int32) - self.first
            owned = (ids >= 0) & (ids < self.count)
            ids[~owned] = -1  # another host's: masked, never read here
            if owned.any():
                y = self.local(x, mx.array(ids))
            else:
                # none of this call is ours: its tokens count, and zeros of the output's shape
                # and dtype go out (the probe's graph is never evaluated)
                runtime = self.runtime
                runtime.count_sync()  # the ids' read was a wait, as the local's is
                with runtime.lock:
                    runtime.route(self.local.layer, ids, compute=False)
                probe = self.local.inner(x, mx.zeros(indices.shape, mx.uint32))
                y = mx.zeros(probe.shape, probe.dtype)
            owned = mx.array(owned)
        else:
            ids = indices.astype(mx.int32) - self.first
            owned = (ids >= 0) & (ids < self.count)
            y = self.local(x, mx.where(owned, ids, -1))
        return y, owned


# how far two hosts' prints of one position may be apart, as a share of its hidden state's
# norm: roundings of bfloat16 (2**-8 of each element) move a print by about 0.004 of it, other
# tokens by about 1.4 of it (four prints: all four under 0.05 has a chance below 1e-6)
INPUT_TOLERANCE = 0.05


def _input_prints(x: mx.array) -> mx.array:
    """[positions, 5]: four projections of each position's hidden state on fixed random signs
    (one sign pattern on every host), and its norm."""
    rows = x.reshape(-1, x.shape[-1]).astype(mx.float32)
    norms = mx.sqrt(mx.sum(rows * rows, axis=-1, keepdims=True))
    return mx.concatenate([rows @ _signs(x.shape[-1]), norms], axis=-1)


@functools.cache
def _signs(width: int) -> mx.array:
    return mx.array(np.random.default_rng(0).choice([-1.0, 1.0], (width, 4)), mx.float32)


def end_host(message: str) -> None:
    """End this host's process at once with a one-line error: the other hosts, left waiting
    in an exchange, then end as on a lost host. (No cleanup runs: a thread may be blocked in
    the exchange, which nothing else can end.) The error starts a line of its own: the
    answer streaming or the prompt it cuts short has no end of line yet."""
    print(f"\nError: {message}", file=sys.stderr, flush=True)
    os._exit(1)


class Watchdog:
    """Ends the process with a clear error when a step that waits on the other hosts takes
    longer than `seconds`: a host that hangs or cannot be reached must not hang the others
    (one that exits closes its connections, and the ring backend raises at once)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.deadline: float | None = None
        threading.Thread(target=self._watch, daemon=True, name="moestream-watchdog").start()

    def __enter__(self) -> None:
        self.deadline = time.monotonic() + self.seconds

    def __exit__(self, *exc) -> None:
        self.deadline = None

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.seconds / 4))
            deadline = self.deadline
            if deadline is not None and time.monotonic() > deadline:
                end_host(f"no answer from the other hosts for {self.seconds:g} s: a host has "
                         "stopped or cannot be reached")


# the files besides the weights that mlx-lm and the tokenizers read
CHECKPOINT_TEXTS = {".json", ".jinja", ".model", ".txt", ".tiktoken", ".py"}


def checkpoint_digest(path: Path, store: ExpertStore) -> bytes:
    """What every host must have alike: the weights (`ExpertStore.fingerprint`), and the
    config and tokenizer files, which shape the computation and the tokens each host feeds."""
    digest = hashlib.sha256(store.fingerprint())
    for file in sorted(path.iterdir()):
        if file.suffix in CHECKPOINT_TEXTS and file.is_file():
            digest.update(file.name.encode() + b"\0" + file.read_bytes())
    return digest.digest()


def join_hosts(group: mx.distributed.Group, digest: bytes | None,
               error: Exception | None = None) -> None:
    """Every host's load ends here, together (a collective: a slow load does not count
    against another host's exchange timeout). A host that failed raises its error, the others
    name it; hosts whose checkpoints differ (`checkpoint_digest`) refuse to run: the sum of
    their experts' outputs would be another model's. Returns on every host or none, each
    seeding MLX's random generator with host 0's seed: hosts that sample (`temp` above 0)
    feed the same token, as their outputs' sum needs."""
    mine = np.zeros(10, np.int32)  # loaded, the digest's 32 bytes, then host 0's seed
    if error is None:
        mine[0], mine[1:9] = 1, np.frombuffer(digest, np.int32)
        if group.rank() == 0:
            mine[9] = int.from_bytes(os.urandom(3), "big")
    hosts = mx.distributed.all_gather(mx.array(mine), group=group)
    try:
        mx.eval(hosts)  # see `host_stats`
    except RuntimeError as lost:  # a host ended during its load (Ctrl-C, killed)
        if error is None:
            raise ModelError(f"a host ended before every host had loaded the model ({lost})"
                             ) from None
    if error is not None:
        raise error
    hosts = np.array(hosts).reshape(-1, 10)
    failed = [str(h) for h in range(len(hosts)) if not hosts[h, 0]]
    if failed:
        raise ModelError(f"host {', '.join(failed)} could not load the model (its error is in "
                         "its output)")
    other = [str(h) for h in range(len(hosts)) if (hosts[h, :9] != hosts[0, :9]).any()]
    if other:
        raise ModelError(f"host {', '.join(other)} has another checkpoint than host 0 (its "
                         "weights, config or tokenizer files differ): every host needs the "
                         "same model")
    mx.random.seed(int(hosts[0, 9]))


def host_group() -> mx.distributed.Group:
    """This process's group of hosts; an error unless `mlx.launch` started two or more."""
    group = mx.distributed.init()
    if group.size() < 2:
        raise ValueError("distributed=True needs two or more processes started by mlx.launch "
                         "(e.g. mlx.launch --backend ring -n 2 script.py)")
    return group


HOST_COUNTERS = ("tokens", "hits", "misses", "loads", "evictions", "bytes_read")


def host_stats(model: nn.Module) -> dict:
    """Every host's statistics and their sums, on every host: a collective call, so every
    host must make it (as they make every forward call)."""
    runtime = runtime_of(model)
    mine = runtime.stats_dict()
    hosts = mx.distributed.all_gather(mx.array([int(mine[k]) for k in HOST_COUNTERS], mx.int64))
    with runtime.backend.watchdog:
        # evaluated first: `np.array` of a collective a lost host made fail returns zeros
        mx.eval(hosts)
    rows = np.array(hosts).reshape(runtime.host[1], len(HOST_COUNTERS)).tolist()
    per_host = [dict(zip(HOST_COUNTERS, row)) for row in rows]
    total = {k: sum(h[k] for h in per_host) for k in HOST_COUNTERS[1:]}
    total["tokens"] = per_host[0]["tokens"]
    for counts in (*per_host, total):
        counts["hit_rate"] = hit_rate(counts["hits"], counts["misses"])
    return {"hosts": per_host, "combined": total}
