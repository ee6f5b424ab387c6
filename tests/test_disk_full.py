"""A quantization that runs out of disk for real: its output folder is a small tmpfs, filled to the last byte
while the run saves its parts, or while it writes the GGUF. The run must stop with ENOSPC, leave no partial file
under any final name, keep every part it had completed, and once space is freed resume to the same bytes as a
run that never failed. (The check before the work, for a disk already too full, is in test_interrupted.py.)

Mounting needs root (CI runs as root); elsewhere the test says why it cannot run.
"""
import errno
import os
import subprocess

import pytest

from tests.test_resume import TEXT, TINY, parts_of
from vq_gguf import quantize
from vq_gguf.quantize import quantize_model

DISK = "64m"  # room for the tiny model's output, parts and temporary GGUF, so that the check before the work passes


@pytest.fixture
def small_disk(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK}", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def fill(folder) -> None:
    """Write a file until the disk says ENOSPC."""
    fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        while True:
            os.write(fd, bytes(1 << 16))
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)


def no_temporaries(folder) -> list[str]:
    return sorted(p.name for p in folder.rglob("*.tmp*"))


@pytest.fixture(scope="module")
def expected(tiny_src, tmp_path_factory):
    """The bytes of a run on a disk with room."""
    folder = tmp_path_factory.mktemp("roomy")
    (folder / "calib.txt").write_text(TEXT[:20000])
    return quantize_model(tiny_src, folder / "tiny.gguf", TINY, calib=[folder / "calib.txt"]).read_bytes()


@pytest.mark.parametrize("when", ["parts", "gguf"])
def test_out_of_disk_then_resume(when, tiny_src, small_disk, expected, tmp_path, monkeypatch):
    calib = tmp_path / "calib.txt"
    calib.write_text(TEXT[:20000])
    out = small_disk / "tiny.gguf"
    saved = []
    real_save = quantize._save_part

    def save(*args):
        if when == "parts" and len(saved) == 3:  # the fourth part finds the disk full
            fill(small_disk)
        real_save(*args)
        saved.append(args[0])
    monkeypatch.setattr(quantize, "_save_part", save)
    if when == "gguf":    # every part saved, then the GGUF finds the disk full
        real_write = quantize.gguf_writer.write

        def write(*args, **kwargs):
            fill(small_disk)
            return real_write(*args, **kwargs)
        monkeypatch.setattr(quantize.gguf_writer, "write", write)

    with pytest.raises(OSError) as e:
        quantize_model(tiny_src, out, TINY, calib=[calib])
    assert e.value.errno == errno.ENOSPC
    assert not out.exists() and no_temporaries(small_disk) == []
    kept = sorted(parts_of(out)[0].glob("*.npz"))
    assert len(kept) == len(saved) == (3 if when == "parts" else len(saved)) and len(saved) >= 3
    assert sorted(p.name for p in saved) == [p.name for p in kept]

    monkeypatch.undo()
    (small_disk / "filler").unlink()
    assert quantize_model(tiny_src, out, TINY, calib=[calib]).read_bytes() == expected
    assert parts_of(out) == [] and no_temporaries(small_disk) == []
