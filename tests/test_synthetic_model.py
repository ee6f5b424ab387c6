"""tools/synthetic_model.py: a random model with a real model's shapes (what the speed benchmarks of real sizes
run on) must have those shapes, a tokenizer of the shape's vocabulary, and run in llama.cpp."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader, TokenType

from vq_gguf.runtime.llama import Model
from vq_gguf.source import load
from vq_gguf.tools import synthetic_model
from vq_gguf.tools.shapes import SHAPES, block_linears


def test_synthetic_model_has_the_shapes_and_runs(default_gguf, tmp_path):
    path = synthetic_model.write("smollm2-135m", 2, tmp_path / "s.gguf", default_gguf)
    src = load(path)
    s = SHAPES["smollm2-135m"]
    assert src.n_blocks == 2 and src.shape("output.weight") == src.shape("token_embd.weight") == (s.vocab, s.hidden)
    for kind, shape in block_linears(s).items():
        assert src.shape(f"blk.1.{kind}.weight") == shape
    w = src.tensors["blk.0.ffn_up.weight"]
    assert abs(float(w.std()) - synthetic_model.STD) < 1e-3 and not np.array_equal(w, src.tensors["blk.1.ffn_up.weight"])
    with Model(path, n_ctx=64) as m:
        tokens = m.tokenize("The capital of France is")
        assert m.n_vocab == s.vocab and np.isfinite(m.logits(tokens)).all()
    again = synthetic_model.write("smollm2-135m", 2, tmp_path / "again.gguf", default_gguf)
    assert again.read_bytes() == path.read_bytes()                      # a seed per tensor: the same file


def test_tokenizer_is_padded_to_the_shapes_vocabulary(default_gguf):
    kvs = {kv.key: kv.value for kv in synthetic_model.metadata("llama3-8b", SHAPES["llama3-8b"], 1, default_gguf)}
    n = len(GGUFReader(default_gguf).get_field("tokenizer.ggml.tokens").contents())
    tokens, types = kvs["tokenizer.ggml.tokens"], kvs["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == kvs["llama.vocab_size"] == 128256 and len(set(tokens)) == len(tokens)
    assert set(types[n:]) == {int(TokenType.UNUSED)} and kvs["llama.rope.dimension_count"] == 128
    with pytest.raises(ValueError, match="1 to 32 blocks"):
        synthetic_model.write("llama3-8b", 33, default_gguf.parent / "never.gguf", default_gguf)
