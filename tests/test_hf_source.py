"""A Hugging Face directory (config.json + safetensors + tokenizer) as the quantizer's source: converted by
the pinned llama.cpp's convert_hf_to_gguf.py, quantized, and loaded by the patched llama.cpp."""
import numpy as np
import pytest

from native.build import tree_dir
from runtime.llama import Model
from vq_export import gguf_writer, source
from vq_export.quantize import VQConfig, quantize_linear


@pytest.fixture(scope="module")
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


def test_hf_directory_to_vq_gguf(hf_dir, tmp_path):
    src = source.load(hf_dir, llama_tree=tree_dir(), cache_dir=tmp_path / "cache")
    assert src.arch == "llama" and len(src.linear_names()) == 14
    # the converter keeps torch's values (Q/K rows permuted for llama.cpp's rope layout)
    from safetensors.numpy import load_file
    st = load_file(str(hf_dir / "model.safetensors"))
    np.testing.assert_allclose(src.tensors["blk.1.ffn_down.weight"], st["model.layers.1.mlp.down_proj.weight"], rtol=1e-6)
    vq = {n: quantize_linear(src.tensors[n], VQConfig(v=4, k=16, iters=3)) for n in src.linear_names()}
    path = gguf_writer.write(tmp_path / "tiny.vq.gguf", src, vq=vq, other_type="f16")
    with Model(path, n_ctx=128) as m:
        assert m.n_vocab == src.tensors["token_embd.weight"].shape[0]
        text = "".join(m.generate(m.tokenize("Hello"), max_tokens=5, sampler=None))
        assert isinstance(text, str)
