"""The VPTQ pipeline on real weights (a few blocks of the default model, a small calibration set), and the
end-to-end fine-tuning on a tiny model."""
import json

import numpy as np
import pytest
import torch

from runtime.llama import Model
from vq_export import quantize
from vq_export.calib import DEFAULT_CALIB, calibration_tokens
from vq_export.finetune import VQWeight, finetune, kl_to_float
from vq_export.quantize import Preset, quantize_model
from vq_export.reference import dequantize
from vq_export.vptq import VPTQConfig

SMALL = Preset("test-vptq", "vptq", VPTQConfig(v=4, k=64, kmeans_iters=8, refit_rounds=1), n_calib=6, seq_len=128,
               n_heldout=2)


def test_vptq_pipeline_on_two_blocks(src, tmp_path):
    out = quantize_model(src, tmp_path / "two.gguf", SMALL, only=["blk.0.", "blk.1."], calib=[DEFAULT_CALIB])
    report = json.loads(out.with_suffix(".report.json").read_text())["tensors"]
    assert len(report) == 14
    errors = [r["rel_error_heldout"] for r in report.values()]
    assert errors == sorted(errors, reverse=True)          # worst first
    assert 0 < max(errors) < 0.5
    with Model(out, n_ctx=256) as m:
        assert np.isfinite(m.logits(m.tokenize("It is a truth universally acknowledged"))).all()


def test_vptq_beats_kmeans_on_held_out_error(src, tmp_path):
    """The same bits: second-order VPTQ against plain k-means, measured on held-out calibration windows."""
    km = Preset("test-km", "kmeans", quantize.VQConfig(v=4, k=64, iters=8))
    vp = quantize_model(src, tmp_path / "vp.gguf", SMALL, only=["blk.0."], calib=[DEFAULT_CALIB])
    report = json.loads(vp.with_suffix(".report.json").read_text())["tensors"]
    from gguf import GGUFReader
    from vq_export import hessian
    from vq_export.model import Llama
    from vq_export.vptq import proxy_loss
    from vq_export.vqtensor import VQTensor
    kmf = quantize_model(src, tmp_path / "km.gguf", km, only=["blk.0."])
    by = {t.name: t for t in GGUFReader(kmf).tensors}
    tokens = calibration_tokens(src.path, [DEFAULT_CALIB], 8, 128)
    blk = Llama(src).blocks[0]
    H, _ = hessian.collect(blk, Llama(src).embed(tokens[6:]))   # the held-out windows
    for short in ("attn_q", "ffn_down"):
        name = f"blk.0.{short}.weight"
        W, h = blk.w[short], H[hessian.INPUT_OF[short]]
        km_err = proxy_loss(W, torch.from_numpy(dequantize(VQTensor.from_gguf(name, by))), h) / proxy_loss(W, torch.zeros_like(W), h)
        assert report[name]["rel_error_heldout"] < 0.7 * km_err, (name, report[name], km_err)


def test_interrupted_vptq_resumes_to_the_same_file(src, tmp_path, monkeypatch):
    whole = quantize_model(src, tmp_path / "whole.gguf", SMALL, only=["blk.0."], calib=[DEFAULT_CALIB])
    real, calls = quantize.VPTQ, []

    class Dies(real):
        def quantize(self):
            if len(calls) == 3:
                raise KeyboardInterrupt
            calls.append(1)
            return super().quantize()

    monkeypatch.setattr(quantize, "VPTQ", Dies)
    with pytest.raises(KeyboardInterrupt):
        quantize_model(src, tmp_path / "resumed.gguf", SMALL, only=["blk.0."], calib=[DEFAULT_CALIB])
    monkeypatch.setattr(quantize, "VPTQ", real)
    resumed = quantize_model(src, tmp_path / "resumed.gguf", SMALL, only=["blk.0."], calib=[DEFAULT_CALIB])
    assert resumed.read_bytes() == whole.read_bytes()


def test_vq_weight_module_decodes_like_the_reference(feature_files):
    _, _, vq = feature_files
    for name in ("blk.0.attn_q.weight", "blk.1.ffn_up.weight"):
        np.testing.assert_allclose(VQWeight(vq[name])().detach().numpy(), dequantize(vq[name]), rtol=1e-6, atol=1e-7)


def test_finetune_lowers_kl_on_a_tiny_model(tiny_src):
    from vq_export.quantize import quantize_linear
    vq = {n: quantize_linear(tiny_src.tensors[n], quantize.VQConfig(v=4, k=8, iters=4)) for n in tiny_src.linear_names()}
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 1000, (6, 32), generator=g)
    before = kl_to_float(tiny_src, vq, tokens)
    norms = finetune(tiny_src, vq, tokens, steps=8, lr=3e-3, batch=3)
    tuned = type(tiny_src)(**{**tiny_src.__dict__, "tensors": {**tiny_src.tensors, **norms}})
    assert kl_to_float(tuned, vq, tokens) < 0.9 * before
    assert set(norms) >= {"output_norm.weight", "blk.0.attn_norm.weight", "blk.1.ffn_norm.weight"}
