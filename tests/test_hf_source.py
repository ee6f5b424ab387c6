"""A Hugging Face directory (config.json + safetensors + tokenizer) as the quantizer's source: converted by
the pinned llama.cpp's convert_hf_to_gguf.py, quantized, and loaded by the patched llama.cpp."""
import numpy as np

from vq_gguf import gguf_writer
from vq_gguf.config import VQConfig
from vq_gguf.quantize import quantize_linear
from vq_gguf.runtime.llama import Model


def test_hf_directory_to_vq_gguf(hf_dir, tiny_src, tmp_path):
    src = tiny_src
    assert src.arch == "llama" and len(src.linear_names()) == 14
    # the converter keeps torch's values (Q/K rows permuted for llama.cpp's rope layout)
    from safetensors.numpy import load_file
    st = load_file(str(hf_dir / "model.safetensors"))
    np.testing.assert_allclose(src.tensors["blk.1.ffn_down.weight"], st["model.layers.1.mlp.down_proj.weight"], rtol=1e-6)
    vq = {n: quantize_linear(src.tensors[n], VQConfig(v=4, k=16, kmeans_iters=3)) for n in src.linear_names()}
    path = gguf_writer.write(tmp_path / "tiny.vq.gguf", src, vq=vq, other_type="f16")
    with Model(path, n_ctx=128) as m:
        assert m.n_vocab == src.tensors["token_embd.weight"].shape[0]
        text = "".join(m.generate(m.tokenize("Hello"), max_tokens=5, sampler=None))
        assert isinstance(text, str)


def test_conversions_of_removed_folders_are_forgotten(hf_dir, tmp_path):
    """The conversion cache holds one GGUF per Hugging Face folder; once a folder is gone, the next conversion
    removes its GGUF, so temporary or moved models do not pile up."""
    import shutil
    from vq_gguf import source
    from vq_gguf.native.build import tree_dir
    cache = tmp_path / "cache"
    a, b = shutil.copytree(hf_dir, tmp_path / "a"), shutil.copytree(hf_dir, tmp_path / "b")
    first = source.load(a, llama_tree=tree_dir(), cache_dir=cache).path
    assert source.load(a, llama_tree=tree_dir(), cache_dir=cache).path == first      # converted once
    shutil.rmtree(a)
    second = source.load(b, llama_tree=tree_dir(), cache_dir=cache).path
    assert not first.exists() and second.exists()
    assert sorted(p.name for p in cache.iterdir()) == sorted([second.name, second.with_suffix(".source").name])
