"""Every architecture the quantizer lists (source.SUPPORTED_ARCHS): a tiny random model of transformers' own class
(two blocks, real head and group layouts, the architecture's biases, q/k norms and multipliers), converted by the
pinned llama.cpp converter, calibrated through transformers, quantized with VPTQ, and run by the patched llama.cpp.

- the calibration model (model.Model: transformers with the GGUF's linears tapped) gives transformers' logits;
- the float agreement check passes: transformers and llama.cpp run the same float model;
- the VQ file run by llama.cpp gives the logits of transformers with the VQ weights decoded by the reference;
- a model whose config disagrees with the GGUF (another RoPE base) is refused by the check.
"""
import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch

from vq_gguf import agreement, source
from vq_gguf.calib import DEFAULT_CALIB, calibration_tokens
from vq_gguf.config import VQConfig
from vq_gguf.model import Model
from vq_gguf.presets import Preset
from vq_gguf.quantize import quantize_model
from vq_gguf.reference import dequantize
from vq_gguf.source import SourceError, load_quantized

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=True, initializer_range=0.1)   # wider than the default: attention not uniform

# transformers' model type -> (the GGUF architecture the converter writes, settings beyond COMMON)
CONFIGS = {
    "llama": ("llama", {}),
    "mistral": ("llama", {"sliding_window": None}),       # the converter writes Mistral checkpoints as llama
    "qwen2": ("qwen2", {}),                               # q/k/v biases, NEOX RoPE
    "qwen3": ("qwen3", {"head_dim": 16}),                 # q/k norms
    "granite": ("granite", {"embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                            "attention_multiplier": 0.0625, "logits_scaling": 8.0}),
    "olmo2": ("olmo2", {"tie_word_embeddings": False}),   # norms after the sublayers, q/k norms; llama.cpp needs a head
    "gemma2": ("gemma2", {"head_dim": 16, "query_pre_attn_scalar": 16}),   # norms stored 1 + w, soft caps
    "gemma3_text": ("gemma3", {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 64}),
    "phi3": ("phi3", {"tie_word_embeddings": False, "pad_token_id": 0}),
    "qwen2_moe": ("qwen2moe", {"tie_word_embeddings": False, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                               "shared_expert_intermediate_size": 64}),     # q, k, v in one tensor, gate and up in one
}
assert {arch for arch, _ in CONFIGS.values()} == set(source.SUPPORTED_ARCHS)
# The tokenizer each family's converter reads: SmolLM2's (rebuilt by transformers from its GGUF) for most;
# Qwen's for Qwen, whose converter takes a BPE tokenizer only by its pre-tokenizer's fingerprint, which the
# pinned tree's Qwen2 vocabulary file has; a SentencePiece model (trained here, on the calibration text) for the
# families whose converter reads tokenizer.model.
QWEN_VOCAB = "models/ggml-vocab-qwen2.gguf"
SENTENCEPIECE = ("gemma2", "gemma3_text", "phi3")

# v = 6 divides none of the tiny models' widths (as none of Llama's): attn_k and ffn_down get tails (format.md §3),
# ffn_down's with row scales and one codebook for both blocks
V6 = VQConfig(v=6, k=64, kmeans_iters=8, refit_rounds=1)
PRESET = Preset("test-arch", "vptq", VQConfig(v=4, k=64, kmeans_iters=8, refit_rounds=1), n_calib=6, seq_len=128,
                n_heldout=2, overrides=(("attn_k", V6), ("ffn_down", dataclasses.replace(V6, row_scale=True))),
                share=("ffn_down",))


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory) -> bytes:
    import io
    import sentencepiece
    from vq_gguf.calib import read_texts
    text = read_texts([DEFAULT_CALIB])[:2_000_000]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(text.splitlines()), model_writer=model,
                                             vocab_size=2000, model_type="bpe", byte_fallback=True,
                                             unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
                                             user_defined_symbols=["<|endoftext|>"])   # llama.cpp's Phi-3 vocabulary needs it
    return model.getvalue()


def save_tokenizer(model_type: str, out, default_gguf, sentencepiece_model: bytes) -> int:
    """Write the family's tokenizer into the model directory `out`; returns its vocabulary size."""
    if model_type in SENTENCEPIECE:
        import sentencepiece
        (out / "tokenizer.model").write_bytes(sentencepiece_model)
        return sentencepiece.SentencePieceProcessor(model_proto=sentencepiece_model).vocab_size()
    from transformers import AutoTokenizer
    from vq_gguf.native.build import tree_dir
    path = tree_dir() / QWEN_VOCAB if model_type.startswith("qwen") else default_gguf
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer.save_pretrained(out)
    return len(tokenizer)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def arch_model(request, default_gguf, sentencepiece_model, tmp_path_factory):
    """(Hugging Face directory, its converted SourceModel) of a tiny random model of the architecture."""
    from transformers import AutoConfig, AutoModelForCausalLM
    arch, extra = CONFIGS[request.param]
    out = tmp_path_factory.mktemp(request.param) / f"tiny-{request.param}"
    out.mkdir()
    n_vocab = save_tokenizer(request.param, out, default_gguf, sentencepiece_model)
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(request.param, vocab_size=n_vocab, **{**COMMON, **extra})
    model = AutoModelForCausalLM.from_config(cfg)
    for name, p in model.named_parameters():
        if name.endswith("bias") or "norm" in name:
            p.data += 0.1 * torch.randn_like(p)   # biases and norms start constant: make them matter
    model.save_pretrained(out, safe_serialization=True)
    from vq_gguf.native.build import tree_dir
    src = source.load(out, llama_tree=tree_dir(), cache_dir=tmp_path_factory.mktemp("gguf"))
    assert src.arch == arch
    return out, src


@pytest.fixture(scope="module")
def windows(arch_model):
    return calibration_tokens(arch_model[1].path, [DEFAULT_CALIB], 2, 128, seed=1)


def test_calibration_model_is_transformers_model(arch_model, windows):
    """The tapped linears (GGUF tensors, rows in llama.cpp's order) compute what the module computed."""
    from transformers import AutoModelForCausalLM
    hf_dir, src = arch_model
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)(windows, use_cache=False).logits
    ours = Model(src)(windows)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-4 * float(ref.abs().max()))


def test_transformers_and_llama_cpp_agree_on_the_float_model(arch_model, windows):
    a = agreement.measure(Model(arch_model[1]), arch_model[1].path, windows)
    print(f"{arch_model[1].arch}: {a}")
    assert a.top1 >= 0.98 and a.mean_abs <= 1e-3 * a.spread, a


def test_vq_file_runs_the_decoded_model(arch_model, windows, tmp_path):
    """quantize (which runs the agreement check first), then llama.cpp on the VQ file against transformers with
    the reference decoder's weights: every block linear reached the VQ kernels."""
    hf_dir, src = arch_model
    out = quantize_model(src, tmp_path / "tiny.vq.gguf", PRESET, other_type="f32", calib=[DEFAULT_CALIB])
    _, vq = load_quantized(out)
    assert set(vq) == set(src.linear_names())
    tails = {n for n, t in vq.items() if t.tail is not None}
    assert tails == {n for n in vq if ".attn_k." in n or ".ffn_down." in n}, tails
    model = Model(src)
    for name, t in vq.items():
        block, kind = int(name.split(".")[1]), name.split(".")[2]
        model.blocks[block].w[kind] = torch.from_numpy(dequantize(t))
    a = agreement.measure(model, out, windows)
    print(f"{src.arch} VQ: {a}")
    assert a.top1 >= 0.98 and a.mean_abs <= 1e-3 * a.spread, a


def test_a_config_that_disagrees_with_the_file_is_refused(arch_model, windows, tmp_path):
    hf_dir, src = arch_model
    if "LlamaForCausalLM" not in json.loads((hf_dir / "config.json").read_text())["architectures"]:
        pytest.skip("one architecture is enough for the control")
    bad = tmp_path / "bad"
    shutil.copytree(hf_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg.setdefault("rope_parameters", {})["rope_theta"] = 100.0    # the file says 10000
    cfg["rope_theta"] = 100.0
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SourceError, match=r"llama: transformers and llama.cpp do not run the same model.*top-1"):
        agreement.check(Model(dataclasses.replace(src, hf_source=bad)), src.path, windows)


def test_fine_tuning_writes_norms_in_the_files_convention(arch_model, windows):
    """Fine-tuning trains transformers' norm weights and writes them as the GGUF stores them (Gemma's converter
    stores 1 + w): with a zero learning rate, every norm comes back as it was in the file."""
    from vq_gguf.finetune import Teacher, finetune
    from vq_gguf.quantize import quantize_linear
    src = arch_model[1]
    vq = {n: quantize_linear(src.tensors[n], VQConfig(v=4, k=8, kmeans_iters=1)) for n in src.linear_names()}
    norms = finetune(src, vq, Teacher.run(src, windows, n_heldout=1), steps=1, lr=0.0, batch=1, eval_every=1)
    assert "output_norm.weight" in norms and any(n.startswith("blk.1.") for n in norms)
    for name, values in norms.items():
        np.testing.assert_allclose(values, src.tensors[name], rtol=1e-6, atol=1e-6, err_msg=name)


def test_a_preset_that_does_not_fit_the_shapes_is_refused_before_any_work(arch_model, tmp_path):
    """Outlier codebooks need v to divide the outputs (format.md §6); 3 divides none of the tiny models' widths.
    Every shipped preset fits: a width v does not divide gets a tail."""
    src = arch_model[1]
    preset = Preset("v3", "vptq", VQConfig(v=3, k=16, outlier_frac=0.01))
    with pytest.raises(ValueError, match=r"preset v3 does not fit \d+ tensors.*blk\.0\..* with v=3") as e:
        quantize_model(src, tmp_path / "never.gguf", preset)
    assert not any(tmp_path.iterdir())
    fitting = str(e.value).split("Presets that fit this model: ")[1].split(", ")
    assert "2bit-shared" in fitting and "4bit-shared" in fitting and "4bit" in fitting
