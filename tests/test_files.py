"""Atomic writes: a writer killed mid-write leaves its temporary file, which the next write
of that file removes."""

import os
import signal
import subprocess
import sys


def test_a_temporary_file_left_by_a_killed_writer_goes_at_the_next_write(tmp_path):
    target = tmp_path / "p.json"
    writer = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from mlx_moestream.files import atomic_write; "
        "atomic_write(sys.argv[1], lambda f: (f.write(b'half'), f.flush(), "
        "print('writing', flush=True), time.sleep(60)))"), str(target)],
        stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline() == "writing\n"
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()
    left = [p.name for p in tmp_path.iterdir()]
    assert len(left) == 1 and left[0].startswith(".p.json.") and left[0].endswith(".tmp")
    from mlx_moestream.files import atomic_write_text

    atomic_write_text(target, "whole")
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]
    assert target.read_text() == "whole"


def test_a_temporary_file_of_a_live_writer_is_left_alone(tmp_path):
    from mlx_moestream.files import atomic_write_text

    mine = tmp_path / f".p.json.{os.getpid()}.abcd1234.tmp"
    mine.write_text("in progress")
    atomic_write_text(tmp_path / "p.json", "whole")
    assert mine.exists()
