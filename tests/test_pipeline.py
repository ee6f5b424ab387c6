"""The VPTQ pipeline on real weights (a few blocks of the default model, a small calibration set), and the
end-to-end fine-tuning on a tiny model."""
import dataclasses
import json

import numpy as np
import pytest
import torch

from vq_gguf import quantize
from vq_gguf.calib import DEFAULT_CALIB, calibration_tokens
from vq_gguf.config import VQConfig
from vq_gguf.finetune import Teacher, VQWeight, finetune, kl_to_float
from vq_gguf.presets import Preset
from vq_gguf.quantize import quantize_model
from vq_gguf.reference import dequantize
from vq_gguf.runtime.llama import Model
from vq_gguf.vqtensor import Shared

SMALL = Preset("test-vptq", "vptq", VQConfig(v=4, k=64, kmeans_iters=8, refit_rounds=1), n_calib=6, seq_len=128,
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
    """The same bits: second-order VPTQ against plain k-means, measured on held-out calibration windows (16
    windows of 128 tokens, more tokens than ffn_down has inputs, so its Hessian is not rank-deficient)."""
    km = Preset("test-km", "kmeans", VQConfig(v=4, k=64, kmeans_iters=8))
    vp = quantize_model(src, tmp_path / "vp.gguf", dataclasses.replace(SMALL, n_calib=16), only=["blk.0."], calib=[DEFAULT_CALIB])
    report = json.loads(vp.with_suffix(".report.json").read_text())["tensors"]
    from gguf import GGUFReader
    from vq_gguf import hessian
    from vq_gguf.model import Model
    from vq_gguf.vptq import proxy_loss
    from vq_gguf.vqtensor import VQTensor
    kmf = quantize_model(src, tmp_path / "km.gguf", km, only=["blk.0."])
    by = {t.name: t for t in GGUFReader(kmf).tensors}
    tokens = calibration_tokens(src.path, [DEFAULT_CALIB], 18, 128)
    model = Model(src)
    blk = model.blocks[0]
    H, _ = hessian.collect(blk, model.embed(tokens[16:]))  # the held-out windows
    for short in ("attn_q", "ffn_down"):
        name = f"blk.0.{short}.weight"
        W, h = blk.w[short], H[hessian.INPUT_OF[short]]
        km_err = proxy_loss(W, torch.from_numpy(dequantize(VQTensor.from_gguf(name, by))), h) / proxy_loss(W, torch.zeros_like(W), h)
        assert report[name]["rel_error_heldout"] < 0.7 * km_err, (name, report[name], km_err)


def test_shared_codebook_file(src, tmp_path):
    """--share ffn_down: one codebook tensor and a link per weight; llama.cpp reads it as it reads the same
    weights each with its own copy, and the bits counted from the file are the shared copy's bytes once."""
    from gguf import GGUFReader
    from vq_gguf import ggml_vq, gguf_writer
    from vq_gguf.bpw import count
    from vq_gguf.vqtensor import read_vq
    preset = dataclasses.replace(SMALL, name="test-shared", share=("ffn_down",))
    out = quantize_model(src, tmp_path / "shared.gguf", preset, only=["blk.0.ffn_down", "blk.1.ffn_down"], calib=[DEFAULT_CALIB])
    reader = GGUFReader(out)
    assert reader.get_field(ggml_vq.FORMAT_KEY).contents() == 2
    assert [t.name for t in reader.tensors if t.name.startswith("vq_shared.")] == ["vq_shared.ffn_down.0.vq_codebook"]
    vq = read_vq(reader)
    (a_, b_) = (t.shared["vq_codebook"] for t in vq.values())
    assert a_ is b_ and a_.name == "vq_shared.ffn_down.0.vq_codebook" and list(vq.values())[0].codebook is a_.data
    own = {n: dataclasses.replace(t, shared={}) for n, t in vq.items()}
    copies = gguf_writer.write(tmp_path / "copies.gguf", src, vq=own, other_type="q8_0")
    assert GGUFReader(copies).get_field(ggml_vq.FORMAT_KEY).contents() == 1
    book = vq["blk.0.ffn_down.weight"].codebook.nbytes
    a, b = count(out), count(copies)
    assert sum(t.bytes for t in b.linears()) - sum(t.bytes for t in a.linears()) == book
    assert a.file_bytes < b.file_bytes
    with Model(out, n_ctx=256) as m:
        toks = m.tokenize("It is a truth universally acknowledged")
        shared_logits = m.logits(toks)
    with Model(copies, n_ctx=256) as m:
        assert np.array_equal(m.logits(toks), shared_logits)


def test_finetune_keeps_a_shared_codebook_shared(tiny_src):
    vq = _tiny_vq(tiny_src)
    downs = [n for n in vq if "ffn_down" in n]
    book = Shared("vq_shared.ffn_down.0.vq_codebook", vq[downs[0]].codebook)
    for n in downs:
        vq[n].codebook = book.data.copy()
        vq[n].link(book)
    from vq_gguf.finetune import _student
    _, weights = _student(tiny_src, vq)
    assert weights[downs[0]].C is weights[downs[1]].C                      # one parameter, trained once
    assert weights[downs[0]].C is not weights["blk.0.ffn_up.weight"].C
    finetune(tiny_src, vq, Teacher.run(tiny_src, _tokens(28), n_heldout=4), steps=18, lr=1e-3, batch=4, eval_every=3)
    tuned = vq[downs[0]].shared["vq_codebook"]
    assert tuned is not book and not np.array_equal(tuned.data, book.data)  # trained, and one object again
    assert all(vq[n].shared["vq_codebook"] is tuned and vq[n].codebook is tuned.data for n in downs)


@pytest.mark.parametrize("share, channel_weights", [((), "none"), (("ffn_up",), "none"), ((), "fisher")])
def test_interrupted_vptq_resumes_to_the_same_file(tiny_src, tmp_path, monkeypatch, share, channel_weights):
    src = tiny_src                                              # what resumes does not depend on the model's size
    preset = dataclasses.replace(SMALL, share=share, channel_weights=channel_weights)
    only = ["blk.0.", "blk.1.attn_k"]
    whole = quantize_model(src, tmp_path / "whole.gguf", preset, only=only, calib=[DEFAULT_CALIB])
    real, calls = quantize.VPTQ, []

    class Dies(real):
        def quantize(self):
            if len(calls) == 7:                                 # blk.0 done, blk.1.attn_k not
                raise KeyboardInterrupt
            calls.append(1)
            return super().quantize()

    monkeypatch.setattr(quantize, "VPTQ", Dies)
    with pytest.raises(KeyboardInterrupt):
        quantize_model(src, tmp_path / "resumed.gguf", preset, only=only, calib=[DEFAULT_CALIB])
    monkeypatch.setattr(quantize, "VPTQ", real)
    collect, blocks = quantize.hessian.collect, []
    monkeypatch.setattr(quantize.hessian, "collect", lambda blk, x: (blocks.append(blk), collect(blk, x))[1])
    resumed = quantize_model(src, tmp_path / "resumed.gguf", preset, only=only, calib=[DEFAULT_CALIB])
    assert resumed.read_bytes() == whole.read_bytes()
    assert [blk.index for blk in blocks] == [1]                # the Hessians of blk.1 only


def test_vq_weight_module_decodes_like_the_reference(feature_files):
    _, _, vq = feature_files
    for name in ("blk.0.attn_q.weight", "blk.1.ffn_up.weight"):
        np.testing.assert_allclose(VQWeight(vq[name])().detach().numpy(), dequantize(vq[name]), rtol=1e-6, atol=1e-7)


def _tiny_vq(tiny_src):
    from vq_gguf.quantize import quantize_linear
    # one Lloyd pass: codebooks rough enough that fine-tuning has something to recover on the held-out windows
    return {n: quantize_linear(tiny_src.tensors[n], VQConfig(v=4, k=8, kmeans_iters=1)) for n in tiny_src.linear_names()}


def _tokens(n, length=32):
    return torch.randint(0, 1000, (n, length), generator=torch.Generator().manual_seed(0))


def test_teacher_states_rebuild_the_float_logits(tiny_src):
    from vq_gguf.model import Model
    tokens = _tokens(3)
    teacher = Teacher.run(tiny_src, tokens, n_heldout=1)
    model = Model(tiny_src)
    rebuilt = model.logits_of(teacher.hidden.float())
    torch.testing.assert_close(rebuilt, model(tokens), rtol=2e-3, atol=2e-3 * float(model(tokens).abs().max()))


def test_finetune_lowers_kl_and_keeps_the_best_held_out_state(tiny_src):
    vq = _tiny_vq(tiny_src)
    tokens = _tokens(28)
    train, heldout = tokens[:24], tokens[24:]
    before = kl_to_float(tiny_src, vq, train), kl_to_float(tiny_src, vq, heldout)
    norms = finetune(tiny_src, vq, Teacher.run(tiny_src, tokens, n_heldout=4), steps=18, lr=1e-3, batch=4, eval_every=3)
    tuned = type(tiny_src)(**{**tiny_src.__dict__, "tensors": {**tiny_src.tensors, **norms}})
    assert kl_to_float(tuned, vq, train) < 0.9 * before[0]
    assert kl_to_float(tuned, vq, heldout) <= before[1] * (1 + 1e-5)   # a worse state than the start is never kept
    assert set(norms) >= {"output_norm.weight", "blk.0.attn_norm.weight", "blk.1.ffn_norm.weight"}


def test_finetune_trains_row_scales_into_the_file(tiny_src, tmp_path):
    """--row-scales adds a trained scale per output channel where the file had none; llama.cpp reads the file
    and gives the logits of the reference decoder."""
    from vq_gguf import gguf_writer
    from vq_gguf.finetune import finetune_file
    from vq_gguf.source import load_quantized
    vq = _tiny_vq(tiny_src)
    assert all(t.row_scale is None for t in vq.values())
    vq_file = gguf_writer.write(tmp_path / "tiny-vq.gguf", tiny_src, vq=vq, other_type="f32")
    teacher = Teacher.run(tiny_src, _tokens(28), n_heldout=4)
    out = finetune_file(vq_file, teacher.save(tmp_path / "teacher.npz"), tmp_path / "ft.gguf", steps=18, lr=1e-3,
                        batch=4, device="cpu", eval_every=3, row_scales=True)
    tuned_src, tuned = load_quantized(out)
    assert set(tuned) == set(vq)
    assert all(t.row_scale is not None and t.row_scale.shape == (t.shape[0],) for t in tuned.values())
    assert max(float(np.abs(t.row_scale - 1).max()) for t in tuned.values()) > 1e-3      # trained, not left at one
    heldout = teacher.tokens[-4:]
    assert kl_to_float(tiny_src, tuned, heldout) < kl_to_float(tiny_src, vq, heldout)
    decoded = gguf_writer.write(tmp_path / "decoded.gguf", tuned_src, other_type="f32")   # the numpy decoding
    toks = [int(t) for t in heldout[0, :16]]
    with Model(out, n_ctx=64) as m, Model(decoded, n_ctx=64) as d:
        a, b = m.logits(toks), d.logits(toks)
    assert np.abs(a - b).max() <= 1e-3 * float(np.abs(b).max()), np.abs(a - b).max()


def test_finetune_file_resumes_and_a_finished_checkpoint_only_writes(tiny_src, tmp_path, capsys):
    """An interrupted run resumes to the same file; a checkpoint kept elsewhere (say, made on a GPU machine)
    gives the same file again without training; a checkpoint of other inputs is refused."""
    from vq_gguf import gguf_writer
    from vq_gguf.finetune import finetune_file
    from vq_gguf.source import load_quantized
    vq_file = gguf_writer.write(tmp_path / "tiny-vq.gguf", tiny_src, vq=_tiny_vq(tiny_src), other_type="f32")
    teacher = Teacher.run(tiny_src, _tokens(16), n_heldout=2).save(tmp_path / "teacher.npz")
    kw = dict(steps=6, lr=3e-3, batch=2, device="cpu", eval_every=2)
    whole = finetune_file(vq_file, teacher, tmp_path / "whole.gguf", **kw)
    assert not list(tmp_path.glob(".whole.gguf.parts-*"))        # the parts folder is gone once written

    ckpt = tmp_path / "moved" / "ft.pt"
    import vq_gguf.finetune as ft
    real = ft.F.kl_div
    calls = []

    def dies(*a, **k):
        calls.append(1)
        if len(calls) == 8:                                        # during step 4 (2 held-out evaluations before)
            raise KeyboardInterrupt
        return real(*a, **k)
    ft.F.kl_div = dies
    try:
        with pytest.raises(KeyboardInterrupt):
            finetune_file(vq_file, teacher, tmp_path / "resumed.gguf", checkpoint=ckpt, **kw)
    finally:
        ft.F.kl_div = real
    assert torch.load(ckpt)["step"] < 6
    resumed = finetune_file(vq_file, teacher, tmp_path / "resumed.gguf", checkpoint=ckpt, **kw)
    again = finetune_file(vq_file, teacher, tmp_path / "again.gguf", checkpoint=ckpt, **kw)
    assert resumed.read_bytes() == whole.read_bytes() == again.read_bytes()
    src, vq = load_quantized(whole)
    before, _ = load_quantized(vq_file)
    assert not np.array_equal(src.tensors["output_norm.weight"], before.tensors["output_norm.weight"])
    with pytest.raises(ValueError, match="made from"):
        finetune_file(vq_file, teacher, tmp_path / "other.gguf", checkpoint=ckpt, **{**kw, "lr": 1e-3})
    # a torn checkpoint (a power cut before the data reached the disk) is dropped with a notice: a fresh run
    data = ckpt.read_bytes()
    ckpt.write_bytes(data[: len(data) // 2])
    torn = finetune_file(vq_file, teacher, tmp_path / "torn.gguf", checkpoint=ckpt, **kw)
    assert "cannot be read" in capsys.readouterr().out and torn.read_bytes() == whole.read_bytes()


def test_quantize_with_finetune_steps_writes_the_tuned_norms(tiny_src, tmp_path):
    import dataclasses
    from vq_gguf.source import load_quantized
    # one Lloyd pass (as _tiny_vq): codebooks rough enough that 8 steps gain on the held-out windows
    preset = dataclasses.replace(SMALL, config=VQConfig(v=4, k=16, kmeans_iters=1, refit_rounds=0), n_calib=4,
                                 seq_len=32, finetune_steps=8, finetune_lr=1e-3)
    out = quantize_model(tiny_src, tmp_path / "tiny-ft.gguf", preset, calib=[DEFAULT_CALIB])
    model, vq = load_quantized(out)
    assert len(vq) == len(tiny_src.linear_names())
    assert not np.array_equal(model.tensors["output_norm.weight"], tiny_src.tensors["output_norm.weight"])
    assert not list(tmp_path.glob(".tiny-ft.gguf.parts-*"))
