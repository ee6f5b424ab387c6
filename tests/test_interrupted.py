"""Interrupted and failing quantization jobs: SIGKILL at random points and resume gives the same bytes as an
uninterrupted run, no partial file ever sits under the final name, and an output that cannot be written is
refused before any work."""
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import REPO

from vq_gguf import gguf_writer, source
from vq_gguf.presets import PRESETS
from vq_gguf.quantize import quantize_model

KILLS = 10


def quantize_cmd(src_path: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "vq_gguf.cli", "quantize", "--model", str(src_path), "--preset", "kmeans-2bit",
            "--out", str(out)]


def quantize_job(src: source.SourceModel, out: str, started) -> None:
    """What `vq-gguf quantize --preset kmeans-2bit` does once the source is loaded; `started` marks the start."""
    started.set()
    quantize_model(src, Path(out), PRESETS["kmeans-2bit"])


def parts_dir(out: Path) -> list[Path]:
    return list(out.parent.glob(f".{out.name}.parts-*"))


def test_kill_and_resume_is_byte_identical(tiny_src, tmp_path):
    # jobs are forked from a server that has imported torch once, so a kill point is a point of the work, not of
    # the interpreter's start; SIGKILL gives the job no chance to clean up
    mp = multiprocessing.get_context("forkserver")
    mp.set_forkserver_preload(["vq_gguf.quantize"])

    def start(out: Path):
        started = mp.Event()
        p = mp.Process(target=quantize_job, args=(tiny_src, str(out), started))
        p.start()
        assert started.wait(600)
        return p, time.monotonic()

    ref = tmp_path / "ref" / "tiny.vq.gguf"
    p, t0 = start(ref)
    p.join(600)
    assert p.exitcode == 0
    work = time.monotonic() - t0
    print(f"uninterrupted: {work:.1f} s of quantization and writing")

    # a chain of kills at random points spread over the job (on average they add up to one whole job), each
    # followed by a resume from what the killed job left
    out = tmp_path / "resumed" / "tiny.vq.gguf"
    rng = random.Random(8)
    parts_seen = 0
    for i in range(KILLS):
        p, t0 = start(out)
        delay = rng.uniform(0, 2 * work / KILLS)
        time.sleep(max(0.0, t0 + delay - time.monotonic()))
        p.kill()
        p.join()
        parts = sum(len(list(d.iterdir())) for d in parts_dir(out))
        parts_seen += parts
        print(f"kill {i}: after {delay:.2f} s of work (exit {p.exitcode}); {parts} parts on disk; "
              f"final file {'present' if out.exists() else 'absent'}")
        # never a partial file under the final name: absent, or complete and identical
        assert not out.exists() or out.read_bytes() == ref.read_bytes()
    assert parts_seen > 0, "no kill landed after the first tensor: the kill points do not exercise resuming"

    p, _ = start(out)
    p.join(600)
    assert p.exitcode == 0
    assert out.read_bytes() == ref.read_bytes()
    # nothing left behind: no parts folder, no temporary GGUF of a killed writer
    assert sorted(f.name for f in out.parent.iterdir()) == sorted(f.name for f in ref.parent.iterdir())


def test_unwritable_output_is_refused_before_work(tiny_src, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    r = subprocess.run(quantize_cmd(tiny_src.path, blocker / "out.gguf"), cwd=REPO, capture_output=True, text=True)
    assert r.returncode != 0
    assert "cannot write the output" in r.stderr and str(blocker) in r.stderr
    assert "quantize kmeans" not in r.stderr  # no progress bar: refused before the first tensor


def test_folder_without_write_permission_is_refused_before_work(tiny_src, tmp_path):
    folder = tmp_path / "read-only"
    folder.mkdir(mode=0o555)
    # root ignores permissions unless it drops the capabilities that override them
    drop = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"] if os.geteuid() == 0 else []
    r = subprocess.run(drop + quantize_cmd(tiny_src.path, folder / "out.gguf"), cwd=REPO, capture_output=True, text=True)
    assert r.returncode != 0
    assert "cannot write the output" in r.stderr and "Permission denied" in r.stderr, r.stderr[-2000:]
    assert "quantize kmeans" not in r.stderr
    assert list(folder.iterdir()) == []


def test_full_disk_is_refused_before_work(tiny_src, tmp_path, monkeypatch):
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(gguf_writer.shutil, "disk_usage", lambda p: usage._replace(free=100_000))
    out = tmp_path / "full" / "out.gguf"
    with pytest.raises(OSError, match="not enough free space"):
        quantize_model(tiny_src, out, PRESETS["kmeans-2bit"])
    assert not out.exists() and not parts_dir(out)
