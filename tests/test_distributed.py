"""Quantizing over several processes (torchrun, gloo; vq_export/distributed.py): two ranks write the file one
process writes, byte for byte, shared codebooks included; a run that loses a rank mid-way resumes from the
parts folder to that same file. The default model's first two blocks, a small preset: each run about 40 s."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

PRESET = """
["test-ranks"]
method = "vptq"
config = { v = 4, k = 64, kmeans_iters = 4, refit_rounds = 1, row_scale = true }
share = ["ffn_gate", "ffn_up"]
n_calib = 8
seq_len = 128
n_heldout = 2
"""


def torchrun(nproc: int, model: Path, out: Path) -> subprocess.Popen:
    preset = out.parent / "presets.toml"
    preset.parent.mkdir(parents=True, exist_ok=True)
    preset.write_text(PRESET)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "vq_gguf.cli", "quantize", "--model", str(model), "--preset-file", str(preset),
           "--preset", "test-ranks", "--only", "blk.0.", "blk.1.", "--out", str(out)]
    # one thread per rank in every run: a matrix product may round differently with more threads
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen) -> str:
    log, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, log[-4000:]
    return log


@pytest.fixture(scope="module")
def one_process(default_gguf, tmp_path_factory) -> bytes:
    out = tmp_path_factory.mktemp("one") / "m.gguf"
    finish(torchrun(1, default_gguf, out))
    return out.read_bytes()


def test_two_ranks_write_the_file_of_one(default_gguf, one_process, tmp_path):
    out = tmp_path / "m.gguf"
    log = finish(torchrun(2, default_gguf, out))
    assert "over 2 processes" in log
    assert 0 < int(re.search(r"\[quantize\] rank 1: (\d+) tensors", log)[1]) < 14    # the work was split
    assert out.read_bytes() == one_process
    assert not list(tmp_path.glob(".m.gguf.parts-*"))


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_a_run_that_loses_a_rank_resumes_to_the_same_file(default_gguf, one_process, tmp_path):
    out = tmp_path / "m.gguf"
    proc = torchrun(2, default_gguf, out)
    deadline = time.time() + 600
    while not list(tmp_path.glob(".m.gguf.parts-*/blk.*.npz")):      # the first weight saved
        assert proc.poll() is None and time.time() < deadline, "the run ended before any weight was saved"
        time.sleep(0.02)
    workers = children(proc.pid)
    assert len(workers) == 2
    os.kill(workers[-1], signal.SIGKILL)
    proc.communicate(timeout=300)
    assert proc.returncode != 0 and not out.exists()                  # killed mid-run: no file
    saved = list(tmp_path.glob(".m.gguf.parts-*/blk.*.npz"))
    assert saved                                                      # what was done is kept ...
    log = finish(torchrun(2, default_gguf, out))                      # ... and the restart resumes from it
    assert out.read_bytes() == one_process
    assert "transformers and llama.cpp agree" in log
