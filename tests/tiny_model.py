"""A tiny valid VQ model (one llama block, 64 wide, 32 tokens, ~35 KB) in which every block linear is VQ
and every format feature appears somewhere (a shared side tensor too): the base of the malformed-file corpus (tests/test_malformed.py)
and the seed of the load fuzzer (tests/fuzz.py). Random but fixed weights: it is valid, not meaningful.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFValueType

from vq_gguf import gguf_writer
from vq_gguf.source import KV, SourceModel
from vq_gguf.vqtensor import Shared, VQTensor

N_EMBD, N_FF, N_HEAD, N_HEAD_KV, N_VOCAB, N_CTX = 64, 96, 4, 2, 32, 128

# weight -> (v, K1, K2, groups, every optional side tensor): residuals, groups, all code widths from 3 to 9 bits
LAYOUT = {
    "blk.0.attn_q.weight": (4, 16, 16, 2, True),       # 8-bit codes, vq2_00
    "blk.0.attn_k.weight": (2, 8, 0, 1, False),        # 3-bit codes straddling bytes, vq1_50
    "blk.0.attn_v.weight": (6, 64, 0, 1, False),       # vq1_00 with v = 6 on 32 outputs: a tail of 2 rows
    "blk.0.attn_output.weight": (4, 64, 8, 2, True),   # 9-bit codes, vq2_25
    "blk.0.ffn_gate.weight": (8, 256, 0, 1, False),    # vq1_00
    "blk.0.ffn_up.weight": (1, 4, 0, 1, False),        # v = 1, vq2_00
    "blk.0.ffn_down.weight": (4, 256, 0, 3, True),     # three groups of 32 columns
}
# numpy shapes (out, in) of the tensors
SHAPES = {
    "token_embd.weight": (N_VOCAB, N_EMBD),
    "output_norm.weight": (N_EMBD,),
    "blk.0.attn_norm.weight": (N_EMBD,),
    "blk.0.attn_q.weight": (N_EMBD, N_EMBD),
    "blk.0.attn_k.weight": (N_EMBD * N_HEAD_KV // N_HEAD, N_EMBD),
    "blk.0.attn_v.weight": (N_EMBD * N_HEAD_KV // N_HEAD, N_EMBD),
    "blk.0.attn_output.weight": (N_EMBD, N_EMBD),
    "blk.0.ffn_norm.weight": (N_EMBD,),
    "blk.0.ffn_gate.weight": (N_FF, N_EMBD),
    "blk.0.ffn_up.weight": (N_FF, N_EMBD),
    "blk.0.ffn_down.weight": (N_EMBD, N_FF),
}


# a sentencepiece vocabulary of N_VOCAB tokens: unknown, begin, end, the newline byte, 14 words, 14 letters
TOKENS = ["<unk>", "<s>", "</s>", "<0x0A>"] + [f"\u2581{c}" for c in "abcdefghijklmn"] + list("abcdefghijklmn")
TOKEN_TYPES = [2, 3, 3, 6] + [1] * 28  # llama.cpp's token attributes: unknown, control, byte, normal


def vocab_kvs(vocab: bool) -> list[KV]:
    """The tokenizer keys; without `vocab`, llama.cpp's `no_vocab` model (token ids only, no text)."""
    arr, i32 = GGUFValueType.ARRAY, GGUFValueType.INT32
    if not vocab:
        return [KV("tokenizer.ggml.model", "no_vocab", GGUFValueType.STRING)]
    return [KV("tokenizer.ggml.model", "llama", GGUFValueType.STRING),
            KV("tokenizer.ggml.tokens", TOKENS, arr, GGUFValueType.STRING),
            KV("tokenizer.ggml.scores", [-float(i) for i in range(N_VOCAB)], arr, GGUFValueType.FLOAT32),
            KV("tokenizer.ggml.token_type", TOKEN_TYPES, arr, i32),
            KV("tokenizer.ggml.unknown_token_id", 0, GGUFValueType.UINT32),
            KV("tokenizer.ggml.bos_token_id", 1, GGUFValueType.UINT32),
            KV("tokenizer.ggml.eos_token_id", 2, GGUFValueType.UINT32)]


def source(arch: str = "llama", vocab: bool = True) -> SourceModel:
    """The float model: metadata of a llama with a tiny tokenizer (or none) and random tensors."""
    assert len(TOKENS) == len(TOKEN_TYPES) == N_VOCAB
    rng = np.random.default_rng(0)
    u32 = GGUFValueType.UINT32
    meta = [
        KV("general.name", "vq-tiny", GGUFValueType.STRING),
        KV(f"{arch}.context_length", N_CTX, u32),
        KV(f"{arch}.embedding_length", N_EMBD, u32),
        KV(f"{arch}.block_count", 1, u32),
        KV(f"{arch}.feed_forward_length", N_FF, u32),
        KV(f"{arch}.attention.head_count", N_HEAD, u32),
        KV(f"{arch}.attention.head_count_kv", N_HEAD_KV, u32),
        KV(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5, GGUFValueType.FLOAT32),
        KV(f"{arch}.vocab_size", N_VOCAB, u32),
        *vocab_kvs(vocab),
    ]
    tensors = {name: (np.ones(shape) if len(shape) == 1 else rng.normal(0, 0.1, shape)).astype(np.float32)
               for name, shape in SHAPES.items()}
    return SourceModel(path=Path(f"{arch}-tiny"), arch=arch, metadata=meta, tensors=tensors)


def vq_tensor(name: str, rng: np.random.Generator) -> VQTensor:
    v, k1, k2, groups, sides = LAYOUT[name]
    out_features, in_features = SHAPES[name]
    codes = lambda k: rng.integers(0, k, (out_features // v, in_features)).astype(np.uint32)
    t = VQTensor(shape=(out_features // v * v, in_features), codes=codes(k1),
                 codebook=rng.normal(0, 0.1, (groups, k1, v)).astype(np.float16))
    if k2:
        t.res_codes, t.res_codebook = codes(k2), rng.normal(0, 0.02, (groups, k2, v)).astype(np.float16)
    if sides:
        v0, k0, n_o = 2, 8, 3
        t.perm = rng.permutation(in_features).astype(np.int32)
        t.col_norm = np.stack([rng.uniform(0.5, 1.5, in_features), rng.normal(0, 0.01, in_features)]).astype(np.float32)
        t.row_scale = rng.uniform(0.8, 1.2, out_features).astype(np.float16)
        t.outlier_cols = rng.choice(in_features, n_o, replace=False).astype(np.int32)
        t.outlier_idx = rng.integers(0, k0, (n_o, out_features // v0)).astype(np.int16)
        t.outlier_codebook = rng.normal(0, 0.05, (k0, v0)).astype(np.float16)
    return t.add_tail(rng.normal(0, 0.1, (out_features % v, in_features)))


# attn_output's outlier codebook is shared with ffn_up, which has outlier columns of its own (docs/format.md 4.1)
SHARED_OUTLIERS = "vq_shared.blk.0.vq_outlier_codebook"


def vq_tensors() -> dict[str, VQTensor]:
    rng = np.random.default_rng(1)
    vq = {name: vq_tensor(name, rng) for name in LAYOUT}
    o, u = vq["blk.0.attn_output.weight"], vq["blk.0.ffn_up.weight"]
    u.outlier_cols = np.array([5, 17], np.int32)
    u.outlier_idx = rng.integers(0, len(o.outlier_codebook), (2, u.shape[0] // o.outlier_codebook.shape[1])).astype(np.int16)
    u.outlier_codebook = o.outlier_codebook
    shared = Shared(SHARED_OUTLIERS, o.outlier_codebook)
    o.link(shared), u.link(shared)
    return vq


def write(path: str | Path, vq: dict[str, VQTensor] | None = None, arch: str = "llama", vocab: bool = True) -> Path:
    """The tiny model with `vq` (default: vq_tensors()) as its VQ weights, other tensors F32."""
    return gguf_writer.write(path, source(arch, vocab), vq=vq_tensors() if vq is None else vq, other_type="f32")


if __name__ == "__main__":
    import sys
    print(write(sys.argv[1] if len(sys.argv) > 1 else "tiny.vq.gguf"))
