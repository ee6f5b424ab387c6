"""A resumed quantization never mixes stale work: the parts of a run with another calibration text, other
settings or other code are not picked up, a torn part is redone, a corrupt output is replaced; each resumed
run writes the same bytes as a fresh run of its inputs. `vq-gguf clean` removes what no process holds."""
import dataclasses
import os
import subprocess
import sys

import pytest

from vq_gguf import quantize
from vq_gguf.calib import DEFAULT_CALIB
from vq_gguf.config import VQConfig
from vq_gguf.presets import Preset
from vq_gguf.quantize import quantize_model

TINY = Preset("test-resume", "vptq", VQConfig(v=4, k=16, kmeans_iters=2, refit_rounds=0), n_calib=4, seq_len=32,
              n_heldout=2)
TEXT = (DEFAULT_CALIB / "austen-emma.txt").read_text()


def parts_of(out):
    return sorted(out.parent.glob(f".{out.name}.parts-*"))


def interrupted(src, out, preset, calib, monkeypatch, saved: int = 3) -> None:
    """A run stopped (as by Ctrl-C) once `saved` tensors are in its parts folder."""
    real, calls = quantize._save_part, []

    def save_then_stop(*args):
        if len(calls) == saved:
            raise KeyboardInterrupt
        calls.append(1)
        real(*args)

    monkeypatch.setattr(quantize, "_save_part", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        quantize_model(src, out, preset, calib=calib)
    monkeypatch.setattr(quantize, "_save_part", real)
    assert len(list(parts_of(out)[0].glob("*.npz"))) == saved


def fresh(src, tmp_path, name, preset, text):
    calib = tmp_path / f"{name}.txt"
    calib.write_text(text)
    return quantize_model(src, tmp_path / f"{name}.gguf", preset, calib=[calib]).read_bytes()


def test_changed_calibration_text_at_the_same_path(tiny_src, tmp_path, monkeypatch):
    calib = tmp_path / "calib.txt"
    calib.write_text(TEXT[:20000])
    out = tmp_path / "out" / "tiny.gguf"
    interrupted(tiny_src, out, TINY, [calib], monkeypatch)
    stale = parts_of(out)
    calib.write_text(TEXT[20000:40000])                  # edited in place: same path, same size class
    resumed = quantize_model(tiny_src, out, TINY, calib=[calib]).read_bytes()
    assert resumed == fresh(tiny_src, tmp_path, "fresh-b", TINY, TEXT[20000:40000])
    assert resumed != fresh(tiny_src, tmp_path, "fresh-a", TINY, TEXT[:20000])
    assert parts_of(out) == [] and not stale[0].exists()  # the stale run's parts went with the run's end
    # and a finished output made from the old text is not "up to date" for the new one
    calib.write_text(TEXT[:20000])
    assert quantize_model(tiny_src, out, TINY, calib=[calib]).read_bytes() == fresh(tiny_src, tmp_path, "fresh-a2", TINY, TEXT[:20000])


def test_changed_setting(tiny_src, tmp_path, monkeypatch):
    calib = tmp_path / "calib.txt"
    calib.write_text(TEXT[:20000])
    out = tmp_path / "out" / "tiny.gguf"
    interrupted(tiny_src, out, TINY, [calib], monkeypatch)
    other = dataclasses.replace(TINY, config=dataclasses.replace(TINY.config, k=32))
    resumed = quantize_model(tiny_src, out, other, calib=[calib]).read_bytes()
    assert resumed == fresh(tiny_src, tmp_path, "fresh", other, TEXT[:20000])


def test_changed_code_makes_a_new_key(tiny_src, tmp_path, monkeypatch):
    run = quantize.Run(tiny_src, tmp_path / "x.gguf", TINY, tiny_src.linear_names(), [DEFAULT_CALIB])
    key = run.key
    monkeypatch.setattr(quantize, "_code_version", lambda: "another version")
    assert quantize.Run(tiny_src, tmp_path / "x.gguf", TINY, tiny_src.linear_names(), [DEFAULT_CALIB]).key != key


@pytest.mark.parametrize("damage", ["truncate", "empty", "garbage"])
def test_torn_part_is_redone(tiny_src, tmp_path, monkeypatch, capsys, damage):
    calib = tmp_path / "calib.txt"
    calib.write_text(TEXT[:20000])
    out = tmp_path / "out" / "tiny.gguf"
    interrupted(tiny_src, out, TINY, [calib], monkeypatch)
    part = sorted(parts_of(out)[0].glob("*.npz"))[1]
    data = part.read_bytes()
    part.write_bytes({"truncate": data[: len(data) // 2], "empty": b"",
                      "garbage": data[:100] + bytes(len(data) - 100)}[damage])
    resumed = quantize_model(tiny_src, out, TINY, calib=[calib]).read_bytes()
    assert f"{part.name} in {part.parent.name} cannot be read" in capsys.readouterr().out
    assert resumed == fresh(tiny_src, tmp_path, "fresh", TINY, TEXT[:20000])


def test_corrupt_output_is_replaced(tiny_src, tmp_path, capsys):
    calib = tmp_path / "calib.txt"
    calib.write_text(TEXT[:20000])
    out = tmp_path / "out" / "tiny.gguf"
    out.parent.mkdir()
    out.write_bytes(b"GGUF" + os.urandom(1000))
    written = quantize_model(tiny_src, out, TINY, calib=[calib]).read_bytes()
    assert "is not a readable GGUF" in capsys.readouterr().out
    assert written == fresh(tiny_src, tmp_path, "fresh", TINY, TEXT[:20000])


def test_clean_removes_only_what_no_process_holds(tmp_path):
    left = tmp_path / "a" / ".m.gguf.parts-0123456789abcdef"
    held = tmp_path / "b" / ".n.gguf.parts-fedcba9876543210"
    for folder in (left, held):
        folder.mkdir(parents=True)
        (folder / "blk.0.ffn_up.weight.npz").write_bytes(bytes(4096))
    (left / "pid").write_text("999999999")               # a process that is gone
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (held / "pid").write_text(str(holder.pid))
        cmd = [sys.executable, "-m", "vq_gguf.cli", "clean", str(tmp_path)]
        dry = subprocess.run(cmd + ["--dry-run"], capture_output=True, text=True, check=True).stdout
        assert f"would remove {left}" in dry and str(held) not in dry and left.exists()
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        assert f"removing {left}" in out and "1 leftover folder(s)" in out
        assert not left.exists() and held.exists()
    finally:
        holder.kill()
        holder.wait()
