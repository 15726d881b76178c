"""Atomic writes: a writer killed mid-write leaves its temporary file, which the next write
of that file removes."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest


def _kill_a_writer_of(target, host: str | None = None) -> list[str]:
    """Start writing `target` in another process (on `host`, as its name says), kill it
    mid-write, and return the names in the folder."""
    pretend = f"import socket; socket.gethostname = lambda: {host!r}; " if host else ""
    writer = subprocess.Popen([sys.executable, "-c", pretend + (
        "import sys, time; from mlx_moestream.files import atomic_write; "
        "atomic_write(sys.argv[1], lambda f: (f.write(b'half'), f.flush(), "
        "print('writing', flush=True), time.sleep(60)))"), str(target)],
        stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline() == "writing\n"
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()
    return [p.name for p in target.parent.iterdir()]


def test_a_name_too_long_for_its_temporary_file_is_refused_before_writing(tmp_path):
    from mlx_moestream.files import atomic_write_text, check_replaceable

    longest = 255 - len(".." + "-" + "." + ".tmp") - 7 - 8 - 8  # see `files._temporary`
    check_replaceable(tmp_path / ("a" * longest), Path.read_text, "a text")
    atomic_write_text(tmp_path / ("a" * longest), "fits")
    with pytest.raises(ValueError, match=rf"its name is too long \(at most {longest} bytes"):
        check_replaceable(tmp_path / ("a" * (longest + 1)), Path.read_text, "a text")


def test_a_temporary_file_left_by_a_killed_writer_goes_at_the_next_write(tmp_path):
    from mlx_moestream.files import atomic_write_text

    target = tmp_path / "p.json"
    left = _kill_a_writer_of(target)
    assert len(left) == 1 and left[0].startswith(".p.json.") and left[0].endswith(".tmp")
    atomic_write_text(target, "whole")
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]
    assert target.read_text() == "whole"


def test_a_temporary_file_of_a_live_writer_is_left_alone(tmp_path):
    from mlx_moestream.files import _HOST, atomic_write_text

    mine = tmp_path / f".p.json.{os.getpid()}-{_HOST}.abcd1234.tmp"
    mine.write_text("in progress")
    atomic_write_text(tmp_path / "p.json", "whole")
    assert mine.exists()


def test_a_temporary_file_of_another_host_is_left_alone(tmp_path):
    """A folder shared between hosts (NFS): another host's PID says nothing about this one's
    processes, so its writer may still be at work."""
    from mlx_moestream.files import atomic_write_text

    (theirs,) = _kill_a_writer_of(tmp_path / "p.json", host="another-host")
    atomic_write_text(tmp_path / "p.json", "whole")
    assert (tmp_path / theirs).exists()


def test_writing_through_a_symbolic_link_replaces_its_target_and_keeps_the_link(tmp_path):
    from mlx_moestream.files import atomic_write_text

    (tmp_path / "real").mkdir()
    target, link = tmp_path / "real" / "p.json", tmp_path / "p.json"
    target.write_text("old")
    link.symlink_to(target)
    atomic_write_text(link, "new")
    assert link.is_symlink() and target.read_text() == "new"
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == ["p.json"]
