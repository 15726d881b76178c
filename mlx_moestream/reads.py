"""Reads of experts into their slots: the I/O threads and every read in flight.

A read runs on the calling thread or on an I/O thread; either way it stays pending until a
call finishes it (`finish`), which counts it, or forgets its expert when it failed: no slot may
claim bytes that never landed. One wait loop serves a call's misses, a prompt's pipelined
chunks and a prefetch's reads ahead.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

from .errors import ClosedError, StoreError
from .interrupts import CRITICAL
from .stats import Stats

ReadExpert = Callable[[int, int, int], tuple[int, float]]  # (layer, expert, slot) -> (bytes, s)
Job = Future | Callable[[], tuple[int, float]]


@dataclass(eq=False)
class Group:
    """Reads of one layer waited for together: a call's misses, a chunk of a prompt's, or one
    prefetch's. `reads` holds (expert, job) pairs, each taken off once it ended; `landed`
    (a prefetch's) collects the experts read and counted."""

    layer: int
    reads: list[tuple[int, Job]] = field(default_factory=list)
    landed: set[int] | None = None


def only_the_wait_failed(read: Future) -> bool:
    """Whether an error from `read.result()` cut the wait short (Ctrl-C), not the read: it still
    runs, or ended well just after, and is left for the next call to finish and count."""
    return not read.done() or not (read.cancelled() or read.exception() is not None)


class Reads:
    """The I/O threads and the reads in flight, in the order they were started.

    Args:
        threads: I/O threads, all started now (see `started_pool`).
        read: reads one expert into its slot, returning (bytes, seconds).
        forget: takes an expert whose read failed or was cut short out of its slot.
        stats: where reads, read errors and stalls are counted.
    """

    def __init__(self, threads: int, read: ReadExpert, forget: Callable[[int, int], None],
                 stats: Stats):
        self.threads = threads
        self.read = read
        self.forget = forget
        self.stats = stats
        self.pool = started_pool(threads)
        self.pending: list[Group] = []
        self.closed = False

    def start(self, layer: int, loads: list[tuple[int, int]], size: int = 0,
              landed: set[int] | None = None) -> list[Group]:
        """Start reading `loads` ((expert, slot) pairs) of `layer` on the I/O threads, in
        pending groups of `size` reads (one group, empty too, when 0); `landed` marks a
        prefetch's.
        Experts whose reads cannot start leave their slots before the error is raised."""
        if size:
            groups = [Group(layer, landed=landed) for _ in range(0, len(loads), size)]
        else:
            groups, size = [Group(layer, landed=landed)], max(len(loads), 1)
        self.pending += groups
        started = 0
        try:
            for expert, slot in loads:
                job = self.pool.submit(self.read, layer, expert, slot)
                groups[started // size].reads.append((expert, job))
                started += 1
        except BaseException as e:
            for expert, _ in loads[started:]:
                self.forget(layer, expert)
            if self.closed and isinstance(e, RuntimeError):  # closed by another thread since
                raise ClosedError() from None  # the call began: the pool refuses new reads
            raise
        return groups

    def load(self, layer: int, loads: list[tuple[int, int]]) -> None:
        """Read a call's missing experts: the first on this thread while the I/O threads read
        the others (handing every read to a thread and waiting cost 3% of a token on the
        embedded model). However the wait ends, no slot claims bytes that never landed."""
        (expert, slot), others = loads[0], loads[1:]
        here = (expert, partial(self.read, layer, expert, slot))
        try:
            group, = self.start(layer, others)
        except BaseException:
            self.forget(layer, expert)
            raise
        group.reads.insert(0, here)
        try:
            self.finish(layer)
        except BaseException:
            if group.reads and group.reads[0] is here:  # cut short before it began
                self.forget(layer, expert)
                group.reads.pop(0)
            raise

    def read_now(self, layer: int, expert: int, slot: int) -> int:
        """Read one expert on this thread, counted; failed or cut short, it leaves its slot.
        Returns its bytes."""
        try:
            nbytes, seconds = self.read(layer, expert, slot)
        except BaseException as e:
            self.forget(layer, expert)
            if isinstance(e, StoreError):
                self.stats.read_errors += 1
            raise
        self.stats.count_read(layer, nbytes, seconds)
        return nbytes

    def finish(self, layer: int, until: Group | None = None) -> None:
        """Finish the pending reads in order, up to and including `until` (all by default).

        A wait is `layer`'s stall for a prefetch's reads, the group's own layer's for a call's.
        A failed read's expert is forgotten; a call's StoreError is raised once every pending
        read has ended (no read may land in a slot given away since), a prefetch's is only
        counted, and any other error is raised at once. An interrupt while a read runs leaves
        it pending for the next call. Callers hold CRITICAL: a read's end is counted or
        forgotten, and taken off its group, as one step.
        """
        failed = None
        while self.pending:
            group = self.pending[0]
            start = time.perf_counter()
            try:
                failed = self._wait(group) or failed
            finally:
                stalled = layer if group.landed is not None else group.layer
                self.stats.stall_seconds[stalled] += time.perf_counter() - start
            self.pending.pop(0)
            if group is until and failed is None:
                return
        if failed is not None:
            raise failed

    def drain(self) -> None:
        """Finish every read in flight outside a layer call, before the residency is read or
        changed there (a prefetch's reads, those a call cut short left running).

        A failed read is counted in read_errors and its expert forgotten: the next call that
        needs it reads it again and reports the error. Callers hold the model's lock.
        """
        stalled = self.stats.stall_seconds.copy()  # waiting here is not the forward pass's stall
        try:
            with CRITICAL:  # a read's end is counted or forgotten as one step
                self.finish(0)
        except StoreError:
            pass
        finally:
            self.stats.stall_seconds[:] = stalled

    def _wait(self, group: Group) -> StoreError | None:
        """Wait for (or make) each read of `group`; returns a call's first StoreError."""
        failed, reads = None, group.reads
        while reads:
            expert, job = reads[0]
            try:
                nbytes, seconds = job.result() if isinstance(job, Future) else job()
            except BaseException as e:
                if isinstance(job, Future) and only_the_wait_failed(job):
                    raise
                self.forget(group.layer, expert)  # then off the list: forgetting twice is safe
                reads.pop(0)
                if not isinstance(e, StoreError):
                    raise
                self.stats.read_errors += 1
                if group.landed is None:
                    failed = failed or e
                continue
            self.stats.count_read(group.layer, nbytes, seconds)
            if group.landed is not None:
                self.stats.prefetch_loads[group.layer] += 1
                group.landed.add(expert)
            else:
                self.stats.demand_loads[group.layer] += 1
                self.stats.demand_bytes[group.layer] += nbytes
            reads.pop(0)
        return failed

    def forked(self) -> None:
        """In a child forked while reads ran: the I/O threads did not come along, so it starts
        its own, and the reads in flight at the fork, which never land here, leave their slots."""
        if not self.closed:
            self.pool = started_pool(self.threads)
        pending = [(group.layer, expert) for group in self.pending for expert, _ in group.reads]
        self.pending = []
        for layer, expert in pending:
            self.forget(layer, expert)

    def close(self) -> None:
        """Refuse new reads and wait for those running."""
        self.closed = True
        self.pool.shutdown(wait=True)


def started_pool(threads: int) -> ThreadPoolExecutor:
    """An I/O pool whose threads all run now. A pool starts them on demand, in `submit`, after
    queueing the work: a thread that cannot start then raises there, and the read already
    queued would land later in a slot the runtime has given to another expert."""
    pool = ThreadPoolExecutor(threads, thread_name_prefix="moestream-read")
    running = threading.Barrier(threads + 1)  # each task holds its thread until all run
    try:
        for _ in range(threads):
            pool.submit(running.wait)
        running.wait()
    except BaseException as e:
        running.abort()  # the threads that run end their task
        pool.shutdown(wait=False)
        if isinstance(e, RuntimeError):
            raise RuntimeError(f"cannot start the {threads} threads that read experts: {e}"
                               ) from None
        raise
    return pool
