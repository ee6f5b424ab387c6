"""Writes through vq_gguf.atomic: complete or not at all, and a killed writer's leftovers removed."""
import os
import subprocess
import sys

import pytest

from vq_gguf.atomic import replacing


def test_the_target_appears_only_when_complete(tmp_path):
    out = tmp_path / "sub" / "out.bin"
    with replacing(out) as tmp:
        tmp.write_bytes(b"new")
        assert not out.exists()
    assert out.read_bytes() == b"new"
    assert os.listdir(out.parent) == ["out.bin"]


def test_an_error_keeps_the_old_file_and_removes_the_temporary(tmp_path):
    out = tmp_path / "out.bin"
    out.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with replacing(out, ".npy") as tmp:
            assert tmp.name.endswith(".npy")
            tmp.write_bytes(b"half")
            raise RuntimeError("killed")
    assert out.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["out.bin"]


def test_a_dead_writers_leftover_is_removed_a_live_ones_kept(tmp_path):
    out = tmp_path / "m.gguf"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f".m.gguf.{int(gone.stdout)}.tmp"
    live = tmp_path / f".m.gguf.{os.getppid()}.tmp.npz"     # the test runner's parent is alive
    dead.write_bytes(b"x")
    live.write_bytes(b"x")
    with replacing(out) as tmp:
        tmp.write_bytes(b"ok")
    assert not dead.exists() and live.exists()
