"""Raw reads of a store's files: preadv into given buffers, direct I/O, and page-cache drops.

Pages read are dropped so that the OS cache does not quietly hold a second copy of the experts
on top of the budget. Plain Python (no mlx).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
import time
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from .checkpoint import file_identity
from .errors import StoreError

# Reads are dropped from the page cache in windows of the largest folio it may hold (2 MiB on
# x86-64; more on arm64 with 16 or 64 KiB pages), since the kernel drops only whole folios.
# Reads without readahead cache single pages, but a file just written (a download, a copy) or
# read by another program is cached in large folios, which dropping an expert's pages leaves.
try:
    DROP_ALIGN = max(2 * 2**20, int(Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")
                                    .read_text()))
except (OSError, ValueError):
    DROP_ALIGN = 2 * 2**20
# a failed read's windows are dropped again for this long: what it requested may still arrive
FAILED_DROP_SECONDS = 1.0


def page_aligned(array: np.ndarray) -> bool:
    """Whether direct I/O can read into `array`: contiguous, starting at a page."""
    return array.ctypes.data % mmap.PAGESIZE == 0 and array.flags.c_contiguous


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


class FileReader:
    """Reads byte ranges of files into given buffers, each checked against the file indexed.

    Args:
        files: The files, read by index.
        identity: Each file's `file_identity` when it was indexed.
        drop_page_cache: Keep no page read in the OS cache (Linux POSIX_FADV_DONTNEED once no
            read of it is in progress, macOS F_NOCACHE).
        repacked: The last file is a repacked copy, read with direct I/O where it can be.
    """

    def __init__(self, files: list[Path], identity: list[tuple[int, int, int]],
                 drop_page_cache: bool, repacked: bool):
        self.files = files
        self.identity = identity
        self.drop_page_cache = drop_page_cache
        self.repacked = repacked
        # pages read are dropped by posix_fadvise (Linux; macOS reads them uncached)
        self.drops = drop_page_cache and hasattr(os, "posix_fadvise")
        self.fds: list[int] | None = None
        self.links: list[int] = []  # each open file's hard links (`_relinked`)
        self.direct: int | None = None  # the repacked copy opened with O_DIRECT, when it can be
        self._closer: weakref.finalize | None = None  # closes what `open` opened
        self._bounce = threading.local()  # each reader thread's page-aligned buffer
        self._reads_lock = threading.Lock()
        # (file, window): how many `reading` blocks in progress read it, on any thread
        self._in_flight: dict[tuple[int, int], int] = {}
        # windows read and not yet dropped -> until when to drop them again (a failed read's)
        self._undropped: dict[tuple[int, int], float] = {}

    def open(self) -> None:
        """Open the files, once: reader threads share the descriptors.

        They close at `close`, or when the reader is collected (a load refused after this, a
        model dropped).
        """
        if self.fds is not None:
            return
        fds: list[int] = []  # every descriptor, the direct one last
        closer = weakref.finalize(self, _close_all, fds)
        closer.atexit = False  # at exit a daemon thread may still read: the OS closes them
        try:
            for path in self.files:
                fds.append(os.open(path, os.O_RDONLY))
                if self.drop_page_cache and hasattr(fcntl, "F_NOCACHE"):  # macOS
                    fcntl.fcntl(fds[-1], fcntl.F_NOCACHE, 1)
                elif self.drop_page_cache and hasattr(os, "POSIX_FADV_RANDOM"):
                    # No readahead, which may land after a read's pages are dropped: reads
                    # name every byte they need.
                    os.posix_fadvise(fds[-1], 0, 0, os.POSIX_FADV_RANDOM)
        except BaseException:
            closer()
            raise
        direct = None
        if self.drop_page_cache and self.repacked and hasattr(os, "O_DIRECT"):
            try:  # a file system without direct I/O fails here: read through the cache
                direct = os.open(self.files[-1], os.O_RDONLY | os.O_DIRECT)
                fds.append(direct)
                os.preadv(direct, [mmap.mmap(-1, mmap.PAGESIZE)], 0)
            except OSError:
                if direct is not None:
                    os.close(fds.pop())
                direct = None
        self.fds, self.direct, self._closer = fds[: len(self.files)], direct, closer
        self.links = [os.fstat(fd).st_nlink for fd in self.fds]

    def close(self) -> None:
        """Drop what reads left cached, and close the files."""
        if self.fds is not None:
            try:
                with self._reads_lock:
                    self._drop_windows(list(self._undropped))
                    self._undropped.clear()
            finally:
                self._closer()
        self.fds = self.direct = None

    def forked(self) -> None:
        """Forget, in a forked child, the reads in progress at the fork.

        They never end here, and one of their threads may have held the lock.
        """
        self._reads_lock = threading.Lock()
        self._in_flight = {}

    def read(self, file: int, offset: int, bufs: list[memoryview], nbytes: int,
             where: str | Callable[[int], str], fd: int | None = None) -> None:
        """Read `nbytes` at `offset` of `files[file]` into `bufs`, then check the file unchanged.

        Args:
            fd: The descriptor to read (the direct one); default: the file's.
            where: What is read, for errors; or, called with the byte a read failed at, a
                function that names it.
        """
        fd = self.fds[file] if fd is None else fd
        got = 0
        while got < nbytes:
            try:
                n = os.preadv(fd, bufs, offset + got)
            except OSError as e:
                n, why = 0, e.strerror
            else:
                why = "unexpected end of file"
            if n == 0:
                what = where if isinstance(where, str) else where(offset + got)
                raise StoreError(f"{self.files[file]}: cannot read {what} at byte {offset + got}: {why}")
            got += n
            while bufs and n >= len(bufs[0]):  # drop what is filled, keep the rest of a partial
                n -= len(bufs[0])
                bufs = bufs[1:]
            if n:
                bufs = [bufs[0][n:], *bufs[1:]]
        stat = os.fstat(fd)  # after the read: an in-place rewrite before or during it shows
        if file_identity(stat) != self.identity[file] and not self._relinked(file, stat):
            what = where if isinstance(where, str) else where(offset)
            raise StoreError(
                f"{self.files[file]}: changed on disk since the model was loaded (size, "
                f"modification or status change time), so {what} cannot be trusted: load the "
                f"model again"
            )

    def _relinked(self, file: int, stat: os.stat_result) -> bool:
        """Whether only the links of the open file changed since it was last checked: a rename
        over it, its removal or a new hard link move its status change time with its link
        count, and leave the bytes its descriptor reads alone. Its new time and count are
        taken as its own from then on, so that a later write with the modification time set
        back still shows."""
        size, mtime_ns, _ = self.identity[file]
        if (stat.st_size, stat.st_mtime_ns) != (size, mtime_ns):
            return False
        if stat.st_nlink == self.links[file]:  # a chmod, or a write with its time set back
            return False
        self.identity[file], self.links[file] = file_identity(stat), stat.st_nlink
        return True

    @contextmanager
    def reading(self, ranges: list[tuple[int, int, int]]) -> Iterator[None]:
        """Around the reads of one expert's (file, offset, nbytes) `ranges`, which lie far apart.

        On Linux each range is requested first (POSIX_FADV_WILLNEED, up to the device's
        readahead size of it) so that their device round trips overlap (9 cold reads of a
        120 KB expert here: 0.3 ms, not 0.9). Their windows are dropped at the end (`_read_done`).
        """
        windows = [(file, w) for file, offset, nbytes in ranges
                   for w in range(offset // DROP_ALIGN, -(-(offset + nbytes) // DROP_ALIGN))
                   ] if self.drops else []
        with self._reads_lock:
            for window in windows:
                self._in_flight[window] = self._in_flight.get(window, 0) + 1
        failed = True
        try:
            if len(ranges) > 1 and hasattr(os, "POSIX_FADV_WILLNEED"):
                for file, offset, nbytes in ranges:
                    os.posix_fadvise(self.fds[file], offset, nbytes, os.POSIX_FADV_WILLNEED)
            yield
            failed = False
        finally:
            self._read_done(windows, failed)

    def _read_done(self, windows: list[tuple[int, int]], failed: bool) -> None:
        """Drop, once a `reading` block ended, every window that no read in progress reads.

        One dropped under a concurrent read would take what that read requested and has not
        read. A failed read's windows are dropped again at every drop for `FAILED_DROP_SECONDS`:
        what it requested may still be arriving, and the kernel does not drop pages in flight.
        """
        now = time.monotonic()
        until = now + FAILED_DROP_SECONDS if failed else 0.0
        with self._reads_lock:  # a read starting meanwhile waits for the drop
            in_flight, undropped = self._in_flight, self._undropped
            for window in windows:
                left = in_flight[window] - 1
                if left:
                    in_flight[window] = left
                else:
                    del in_flight[window]
                undropped[window] = max(undropped.get(window, 0.0), until)
            ready = [window for window in undropped if window not in in_flight]
            self._drop_windows(ready)
            for window in ready:
                if undropped[window] <= now:
                    del undropped[window]

    def _drop_windows(self, windows: list[tuple[int, int]]) -> None:
        """Drop (file, window) windows from the page cache: one call per run of adjacent ones."""
        if not self.drops or self.fds is None:
            return
        runs: list[list[int]] = []  # [file, first window, end]
        for file, window in sorted(windows):
            if runs and runs[-1][0] == file and runs[-1][2] == window:
                runs[-1][2] += 1
            else:
                runs.append([file, window, window + 1])
        for file, first, end in runs:
            os.posix_fadvise(self.fds[file], first * DROP_ALIGN, (end - first) * DROP_ALIGN,
                             os.POSIX_FADV_DONTNEED)

    def drop_spans(self, file: int, spans: list[tuple[int, int]]) -> None:
        """Drop the (offset, nbytes) `spans` of `files[file]` from the page cache."""
        if self.drops:
            for offset, nbytes in spans:
                os.posix_fadvise(self.fds[file], offset, nbytes, os.POSIX_FADV_DONTNEED)

    def drop_all(self) -> None:
        """Drop every file's pages from the page cache, the reads' and others'."""
        if self.drops and self.fds is not None:
            for fd in self.fds:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def scratch(self, nbytes: int) -> mmap.mmap:
        """This thread's page-aligned buffer of at least `nbytes`, outside the budget."""
        buf = getattr(self._bounce, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = self._bounce.buf = mmap.mmap(-1, nbytes)  # anonymous memory: page-aligned
        return buf
