"""Bits per weight counted from the file; the CLI; interrupted quantization resumes to the same file;
llama.cpp's own tools accept VQ files."""
import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from vq_gguf import bpw, quantize
from vq_gguf.config import VQConfig
from vq_gguf.presets import PRESETS, Preset
from vq_gguf.quantize import quantize_model
from vq_gguf.runtime.llama import lib_dir as bin_dir


def test_bpw_matches_hand_count(ffn_down_file, src):
    bits = bpw.count(ffn_down_file)
    by_name = {t.name: t for t in bits.tensors}
    t = by_name["blk.0.ffn_down.weight"]
    out_features, in_features = 576, 1536
    index_bytes = out_features * in_features * 2 // 8          # vq2_00: 2 bits per weight
    codebook_bytes = 256 * 4 * 2                               # k=256 centroids of v=4 F16 values
    assert t.type == "vq2_00" and t.bytes == index_bytes + codebook_bytes
    assert t.bpw == pytest.approx(8 * (index_bytes + codebook_bytes) / (out_features * in_features))
    q = by_name["blk.0.ffn_up.weight"]
    assert q.type == "q8_0" and q.bpw == pytest.approx(8.5)
    assert not any("vq_" in t.name for t in bits.tensors)      # side tensors count with their weight
    n_linear = sum(t.elements for t in bits.linears())
    assert n_linear == sum(src.tensors[n].size for n in src.linear_names())
    expected = sum(t.bytes for t in bits.linears()) * 8 / n_linear
    assert bits.linear_bpw == pytest.approx(expected)
    assert bits.file_bytes == ffn_down_file.stat().st_size


def test_inspect_cli(ffn_down_file):
    out = subprocess.run([sys.executable, "-m", "vq_gguf.cli", "inspect", str(ffn_down_file), "--tensor", "blk.3.",
                          "--decode"], capture_output=True, text=True, check=True).stdout
    assert "vq.format_version = 1" in out
    assert "blk.3.ffn_down.weight" in out and "v=4 k=256" in out and "finite True" in out
    assert f"{bpw.count(ffn_down_file).linear_bpw:.3f} bits per weight" in out


def test_interrupted_quantization_resumes_to_the_same_file(src, tmp_path, monkeypatch):
    cfg = VQConfig(v=4, k=16, kmeans_iters=3)
    whole = quantize_model(src, tmp_path / "whole.gguf", cfg, only=["attn_k"])
    real, calls = quantize.quantize_linear, []

    def dies_after_ten(*a, **k):
        if len(calls) == 10:
            raise KeyboardInterrupt
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(quantize, "quantize_linear", dies_after_ten)
    with pytest.raises(KeyboardInterrupt):
        quantize_model(src, tmp_path / "resumed.gguf", cfg, only=["attn_k"])
    assert not (tmp_path / "resumed.gguf").exists()
    monkeypatch.setattr(quantize, "quantize_linear", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    resumed = quantize_model(src, tmp_path / "resumed.gguf", cfg, only=["attn_k"])
    assert len(calls) == 30  # 10 before the interruption, 20 after: the first 10 were reused
    assert resumed.read_bytes() == whole.read_bytes()


def test_llama_perplexity_is_finite(ffn_down_file):
    from tests.conftest import EVAL_TEXT
    proc = subprocess.run([str(bin_dir() / "llama-perplexity"), "-m", str(ffn_down_file), "-f", str(EVAL_TEXT),
                           "-c", "512", "--chunks", "2", "-t", "2"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = [l for l in (proc.stdout + proc.stderr).splitlines() if "Final estimate: PPL" in l][0]
    ppl = float(line.split("PPL =")[1].split()[0])
    assert np.isfinite(ppl) and 1 < ppl < 1e6


def test_llama_quantize_passes_vq_tensors_through(ffn_down_file, tmp_path):
    from gguf import GGUFReader
    out = tmp_path / "requant.gguf"
    proc = subprocess.run([str(bin_dir() / "llama-quantize"), "--allow-requantize", str(ffn_down_file), str(out), "Q4_0", "2"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    before = {t.name: (int(t.tensor_type), bytes(t.data)) for t in GGUFReader(ffn_down_file).tensors if "ffn_down" in t.name}
    after = {t.name: (int(t.tensor_type), bytes(t.data)) for t in GGUFReader(out).tensors if "ffn_down" in t.name}
    assert before == after


def test_preset_overrides_select_kinds_and_blocks():
    from vq_gguf.cli import parse_tensor_config
    base = PRESETS["2bit"]
    preset = Preset("t", "vptq", base.config, overrides=(
        parse_tensor_config("ffn_down@0,-1:v=2,k=64", base.config), parse_tensor_config("attn_v:k=16", base.config)))
    cfg = {n: preset.config_for(n, 30) for n in
           ("blk.0.ffn_down.weight", "blk.29.ffn_down.weight", "blk.10.ffn_down.weight", "blk.1.ffn_down.weight",
            "blk.0.ffn_up.weight", "blk.7.attn_v.weight")}
    assert (cfg["blk.0.ffn_down.weight"].v, cfg["blk.0.ffn_down.weight"].k) == (2, 64)
    assert cfg["blk.29.ffn_down.weight"] == cfg["blk.0.ffn_down.weight"]
    assert cfg["blk.10.ffn_down.weight"] is base.config and cfg["blk.1.ffn_down.weight"] is base.config
    assert cfg["blk.0.ffn_up.weight"] is base.config
    assert (cfg["blk.7.attn_v.weight"].v, cfg["blk.7.attn_v.weight"].k) == (base.config.v, 16)
    assert cfg["blk.7.attn_v.weight"].refit_rounds == base.config.refit_rounds  # other settings from the base
    with pytest.raises(SystemExit, match="KIND"):
        parse_tensor_config("ffn_down@0", base.config)
    with pytest.raises(SystemExit, match="unknown setting"):
        parse_tensor_config("ffn_down:bits=3", base.config)


def test_selectors_pick_blocks_by_position_at_any_depth():
    from vq_gguf.presets import check_selector, selects

    def picked(key, n):
        return [b for b in range(n) if selects(key, "ffn_down", b, n)]
    assert picked("ffn_down@first,last", 30) == [0, 29] and picked("ffn_down@first,last", 1) == [0]
    assert picked("ffn_down@0-33%", 30) == list(range(10)) and picked("ffn_down@0-33%", 80) == list(range(26))
    assert picked("ffn_down@0-10%", 30) == [0, 1, 2] and picked("ffn_down@50-100%", 4) == [2, 3]
    assert picked("ffn_down@-1,2", 12) == [2, 11] and picked("ffn_down", 3) == [0, 1, 2] and picked("attn_k", 3) == []
    for bad in ("ffn_dwn", "ffn_down@middle", "ffn_down@10-5%", "ffn_down@0-101%", "ffn_down@5%"):
        with pytest.raises(ValueError, match="selector"):
            check_selector(bad)
    with pytest.raises(ValueError, match="selector"):
        Preset("bad", "vptq", PRESETS["2bit"].config, overrides=(("ffn_down@middle", PRESETS["2bit"].config),))


def test_presets_read_from_toml(tmp_path):
    from vq_gguf.presets import load
    (tmp_path / "p.toml").write_text('[mine]\nmethod = "vptq"\nconfig = { v = 4, k = 4096, row_scale = true }\n'
                                     'overrides = [["attn_v@last", { v = 2 }]]\nshare = ["ffn_up"]\nn_calib = 64\n')
    mine = load(tmp_path / "p.toml")["mine"]
    assert mine.config_for("blk.7.attn_v.weight", 8) == dataclasses.replace(mine.config, v=2)   # relative to config
    assert mine.config_for("blk.6.attn_v.weight", 8) is mine.config and mine.n_calib == 64 and mine.share == ("ffn_up",)
    (tmp_path / "bad.toml").write_text('[x]\nmethod = "vptq"\nconfig = { v = 4, k = 256, bits = 2 }\n')
    with pytest.raises(ValueError, match="preset x"):
        load(tmp_path / "bad.toml")


def test_quantize_flags_keep_the_presets_overrides_unless_they_change_the_geometry():
    import argparse

    from vq_gguf.cli import add_quantize, preset_from_args
    parser = argparse.ArgumentParser()
    add_quantize(parser)
    base = PRESETS["2bit-shared"]
    refit = preset_from_args(parser.parse_args(["--preset", "2bit-shared", "--refit-rounds", "0"]))
    assert [key for key, _ in refit.overrides] == [key for key, _ in base.overrides] and refit.share == base.share
    for name in ("blk.0.ffn_down.weight", "blk.29.ffn_down.weight", "blk.5.attn_v.weight", "blk.5.ffn_up.weight"):
        cfg, was = refit.config_for(name, 30), base.config_for(name, 30)
        assert (cfg.v, cfg.k, cfg.row_scale, cfg.refit_rounds) == (was.v, was.k, was.row_scale, 0)
    wider = preset_from_args(parser.parse_args(["--preset", "2bit-shared", "--v", "4", "--k", "256"]))
    assert wider.overrides == () and (wider.config_for("blk.5.attn_v.weight", 30).v, wider.config.k) == (4, 256)


@pytest.mark.parametrize("name, budget", [("2bit", 2.1), ("2bit-shared", 2.1), ("2.25bit-shared", 2.3), ("3bit", 3.1), ("3bit-shared", 3.1), ("4bit", 4.1), ("4bit-shared", 4.1)])
def test_presets_spend_their_extra_bits_within_the_issue_budget(src, name, budget):
    """Index bits, F16 codebooks (a shared one once) and F16 row scales of every block linear of the default model,
    as the file will count them: the kinds a preset gives more bits (attn_v, attn_k, the end blocks' ffn_down) must
    not take it past its budget."""
    preset = PRESETS[name]
    bits = weights = 0
    books = {}  # one per tensor, or one per (kind, settings) where the kind is shared
    for n in src.linear_names():
        out_features, in_features = src.tensors[n].shape
        cfg = preset.config_for(n, src.n_blocks)
        kind = n.split(".")[2]
        books[(kind, cfg) if kind in preset.share else n] = cfg
        bits += out_features * in_features * cfg.index_bits / cfg.v + 16 * out_features * cfg.row_scale
        weights += out_features * in_features
    bits += sum(16 * cfg.v * (cfg.k + cfg.k_res) for cfg in books.values())
    assert budget - 0.15 < bits / weights <= budget
    rate = {n.split(".")[2]: preset.config_for(n, src.n_blocks) for n in src.linear_names() if n.startswith("blk.5.")}
    rate = {kind: cfg.index_bits / cfg.v for kind, cfg in rate.items()}
    assert rate["attn_v"] >= rate["attn_q"] + 0.75
