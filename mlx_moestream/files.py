"""Reading and writing the tool's files: only regular files are read (a FIFO's read never
ends), and profiles, traces, manifests and reports are never left half-written."""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import json
import os
import secrets
import socket
import stat
from pathlib import Path
from typing import BinaryIO, Callable

# this host, in temporary files' names: a short digest (a host name may hold any character)
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
WRITER = "mlx-moestream"  # the mark of the files this tool writes where a format holds one


def open_regular(path: str | os.PathLike, problem: str, error: type[ValueError] = ValueError
                 ) -> BinaryIO:
    """Open `path` to read if it is a regular file. A FIFO would wait for a writer forever and
    a device (/dev/zero) never end: opened without waiting, they are refused by what the open
    descriptor is, and any failure is an `error` "PATH: PROBLEM (why)"."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise error(f"{path}: {problem} ({e.strerror or e})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        why = os.strerror(errno.EISDIR) if stat.S_ISDIR(mode) else "not a regular file"
        raise error(f"{path}: {problem} ({why})")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def parse_json(data: bytes | str, path: str | os.PathLike, problem: str,
               error: type[ValueError] = ValueError) -> object:
    """JSON `data` read from `path`; text that is not JSON, or nested too deeply for Python's
    parser, is an `error` "PATH: PROBLEM (why)"."""
    try:
        return json.loads(data)
    except RecursionError:
        raise error(f"{path}: {problem} (JSON nested too deeply)") from None
    except ValueError as e:  # not JSON, or not even UTF-8
        raise error(f"{path}: {problem} ({e})") from None


def read_json(path: str | os.PathLike, problem: str, error: type[ValueError] = ValueError
              ) -> object:
    """The JSON content of the regular file `path` (see `open_regular`, `parse_json`)."""
    with open_regular(path, problem, error) as f:
        try:
            data = f.read()
        except OSError as e:
            raise error(f"{path}: {problem} ({e.strerror or e})") from None
    return parse_json(data, path, problem, error)


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> None:
    """Call `write` on a temporary file beside `path`, sync it, then rename it over `path`
    (over the file a symbolic link `path` points to: the link stays). Temporary files that a
    killed writer (kill -9) left for it are removed first. An OSError of the writing (a full
    disk) names `path`: a file object's error names no file. (`write` reads nothing that
    raises an OSError without a name: the store's read errors are StoreErrors.)"""
    path = _written_path(path)
    _remove_orphans(path)
    tmp = _temporary(path, os.getpid(), secrets.token_hex(4))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # mode as umask allows
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(FileNotFoundError):  # a replaced file keeps its mode
            os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode))
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.errno is not None and e.filename is None:
            e.filename = str(path)  # (one with no errno would print as "[Errno None] None")
        raise


def _written_path(path: str | os.PathLike) -> Path:
    """Where a write to `path` lands: the file a symbolic link points to (the link stays)."""
    return Path(os.path.realpath(path)) if os.path.islink(path) else Path(path)


def _temporary(path: Path, pid: int, token: str) -> Path:
    return path.with_name(f".{path.name}.{pid}-{_HOST}.{token}.tmp")


def check_replaceable(path: str | os.PathLike, check: Callable[[Path], object], what: str,
                      error: type[ValueError] = ValueError) -> None:
    """Writers replace an existing file only if it is one of theirs: `check` (a loader) raises
    OSError or ValueError on any other, and then `error` says so. Never a file this tool did
    not write. A missing or read-only folder, and a name too long for its folder (or its
    temporary file's), are refused here too: the write would fail after the work (`lexists`
    only says False for such a name), and so is an empty name (it is no file). A symbolic link
    is checked where `atomic_write` writes: beside the file it points to."""
    if not os.fspath(path):
        raise error("cannot write '': the file name is empty")
    path = _written_path(path)
    if not path.parent.is_dir() or not os.access(path.parent, os.W_OK):
        raise error(f"cannot write {path}: {path.parent} is not a writable folder")
    longest = len(os.fsencode(_temporary(path, 9_999_999, "0" * 8).name))  # pids have 7 digits
    try:
        limit = os.pathconf(path.parent, "PC_NAME_MAX")
    except (OSError, ValueError):  # no limit known
        limit = 255
    if longest > limit:
        raise error(f"cannot write {path}: its name is too long (at most "
                    f"{limit - longest + len(os.fsencode(path.name))} bytes in {path.parent})")
    if os.path.lexists(path):
        try:
            check(Path(path))
        except (OSError, ValueError):
            raise error(f"refusing to replace {path}: it is not {what}") from None


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def _remove_orphans(path: Path) -> None:
    """Remove `.NAME.PID-HOST.HEX.tmp` files beside `path` that a process of this host wrote
    and that no longer exists. Another host's are left alone: a folder may be shared (NFS)
    between the hosts of a distributed run, and its PID means nothing here."""
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        pid, _, host = tmp.name[len(path.name) + 2 :].split(".")[0].partition("-")
        if pid.isdigit() and host == _HOST and not _alive(int(pid)):
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True
