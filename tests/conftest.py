"""Shared fixtures: the default model, and small VQ files made from it once per session.

The tests need the patched llama.cpp built (`vq-gguf build`, which `make test` runs first); they fail,
not skip, when it is missing.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from vq_gguf import default_model, gguf_writer, source
from vq_gguf.calib import DATA_DIR, EVAL_TEXT
from vq_gguf.config import VQConfig
from vq_gguf.paths import home
from vq_gguf.quantize import quantize_linear
from vq_gguf.reference import dequantize
from vq_gguf.vqtensor import VQTensor

DATA = DATA_DIR


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    return default_model.fetch(home())


@pytest.fixture(scope="session")
def src(default_gguf) -> source.SourceModel:
    return source.load(default_gguf)


@pytest.fixture(scope="session")
def eval_text() -> str:
    return EVAL_TEXT.read_text()[:20000]


def quantize_with_all_sides(W: np.ndarray, cfg: VQConfig, groups: int, rng: np.random.Generator) -> VQTensor:
    """Quantize W using every optional side tensor of the format, with random but consistent data: the codes
    are fitted to the permuted, row-scaled, column-normalized matrix, so that decoding gives back ~W."""
    out_features, in_features = W.shape
    perm = rng.permutation(in_features).astype(np.int32)
    scale = rng.uniform(0.5, 1.5, in_features).astype(np.float32)
    bias = rng.normal(0, 0.002, in_features).astype(np.float32)
    u = rng.uniform(0.8, 1.2, out_features).astype(np.float16)
    t = quantize_linear((W[:, perm] / u[:, None] - bias) / scale, dataclasses.replace(cfg, seed=3))
    t.perm, t.col_norm, t.row_scale = perm, np.stack([scale, bias]), u
    n_o, v0, k0 = 3, 4, 16
    t.outlier_cols = rng.choice(in_features, n_o, replace=False).astype(np.int32)
    t.outlier_idx = rng.integers(0, k0, (n_o, out_features // v0)).astype(np.int16)
    t.outlier_codebook = rng.normal(0, 0.002, (k0, v0)).astype(np.float16)
    return split_groups(t, groups, rng)


# (tensor, config, with every side tensor, column groups): odd code widths that straddle bytes (b = 3, 12,
# 18), residual codebooks, every vector length the default model's shapes allow, the rates 0.75 .. 3, and
# vector lengths that do not divide the outputs (tails: 192 mod 5 = 2, 1536 mod 7 = 3)
FEATURE_TENSORS = {
    "blk.0.ffn_down.weight": (VQConfig(v=4, k=256, k_res=16, kmeans_iters=4), True, 2),
    "blk.0.attn_q.weight": (VQConfig(v=8, k=4096, kmeans_iters=2), False, 1),
    "blk.0.attn_k.weight": (VQConfig(v=4, k=8, k_res=512, kmeans_iters=4), True, 1),
    "blk.1.ffn_up.weight": (VQConfig(v=12, k=512, k_res=512, kmeans_iters=2), False, 1),
    "blk.1.attn_v.weight": (VQConfig(v=6, k=256, k_res=16, kmeans_iters=4), True, 3),
    "blk.2.ffn_gate.weight": (VQConfig(v=2, k=64, kmeans_iters=4), False, 1),
    "blk.2.attn_k.weight": (VQConfig(v=4, k=8, kmeans_iters=4), False, 1),
    "blk.2.ffn_up.weight": (VQConfig(v=2, k=1024, kmeans_iters=2), False, 1),  # 5 bits per weight
    "blk.3.attn_k.weight": (VQConfig(v=5, k=1024, kmeans_iters=2), False, 1),
    "blk.3.ffn_up.weight": (VQConfig(v=7, k=128, kmeans_iters=2), False, 2),
}


def split_groups(t: VQTensor, groups: int, rng: np.random.Generator) -> VQTensor:
    """G codebooks: copies of the fitted one, each perturbed by about 1 %."""
    t.codebook = np.concatenate([t.codebook * rng.uniform(0.99, 1.01, t.codebook.shape) for _ in range(groups)]).astype(np.float16)
    if t.res_codebook is not None:
        t.res_codebook = np.concatenate([t.res_codebook] * groups)
    return t


@pytest.fixture(scope="session")
def feature_files(src, tmp_path_factory) -> tuple[Path, Path, dict[str, VQTensor]]:
    """A file whose FEATURE_TENSORS are VQ (every format feature somewhere), and the same model with those
    weights decoded by the numpy reference and stored F32 in a stock GGUF."""
    rng = np.random.default_rng(1)
    vq = {}
    for name, (cfg, sides, groups) in FEATURE_TENSORS.items():
        W = src.tensors[name]
        vq[name] = quantize_with_all_sides(W, cfg, groups, rng) if sides else split_groups(quantize_linear(W, dataclasses.replace(cfg, seed=3)), groups, rng)
    folder = tmp_path_factory.mktemp("features")
    vq_path = gguf_writer.write(folder / "features.vq.gguf", src, vq=vq, other_type="q8_0")
    dec_path = gguf_writer.write(folder / "features.decoded.gguf", src,
                                 override={n: dequantize(t) for n, t in vq.items()}, other_type="q8_0")
    return vq_path, dec_path, vq


@pytest.fixture(scope="session")
def ffn_down_file(src, tmp_path_factory) -> Path:
    """The default model with every ffn_down at ~2 bits (k-means v4 k256), the rest Q8_0."""
    from vq_gguf.quantize import quantize_model
    out = tmp_path_factory.mktemp("ffn_down") / "ffn_down.vq.gguf"
    return quantize_model(src, out, VQConfig(v=4, k=256, kmeans_iters=8), only=["ffn_down"])


@pytest.fixture(scope="session")
def hf_dir(default_gguf, tmp_path_factory):
    """A tiny random llama with SmolLM2's tokenizer, saved the way Hugging Face checkpoints are."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    import torch
    out = tmp_path_factory.mktemp("hf") / "tiny-llama"
    tok = AutoTokenizer.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_src(hf_dir, tmp_path_factory):
    """The tiny llama converted to GGUF by the pinned llama.cpp's converter, as a SourceModel."""
    from vq_gguf.native.build import tree_dir
    return source.load(hf_dir, llama_tree=tree_dir(), cache_dir=tmp_path_factory.mktemp("hf-gguf"))
