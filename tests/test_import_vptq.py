"""`vq-gguf import-vptq` against the `vptq` package itself: checkpoints built by its own layer with every option
it supports are imported; the package's `dequant` equals our reference decoder on every layer, and the patched
llama.cpp's logits equal transformers + vptq on the same tokens. Settings the format cannot express are refused
by name."""
import json

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from tests import vptq_checkpoint as vc
from vq_gguf import ggml_vq
from vq_gguf.import_vptq import VPTQImportError, import_checkpoint, layer_to_vq
from vq_gguf.native.build import tree_dir
from vq_gguf.reference import dequantize
from vq_gguf.runtime.llama import Model
from vq_gguf.vqtensor import read_vq

# one layout per kind of linear, so that one checkpoint holds every option of VQuantLinear
EVERY_OPTION = {
    "q_proj": vc.Layout(v=8, k=4096, k_res=256, perm=True, norm=True),             # as published: packed, perm, norm
    # (unpacked indices with a residual: the package's VQuantLinear cannot build them, it reads num_indices unset)
    "k_proj": vc.Layout(v=4, k=256, groups=2, packed=False),                        # int16 indices, two codebooks
    # (unpacked with perm: the package's dequant reads the int64 perm as uint16s, so only packed layers have one)
    "v_proj": vc.Layout(v=2, k=16, packed=False),
    "o_proj": vc.Layout(v=4, k=64, perm=True, outliers=16, v_outlier=2, k_outlier=16),
    "gate_proj": vc.Layout(v=8, k=65536, norm=True),                                # 16-bit codes: 2 bits per weight
    "up_proj": vc.Layout(v=16, k=4096, k_res=4096),                                 # 24-bit codes over 16 channels
    "down_proj": vc.Layout(v=4, k=256, k_res=16, groups=4, perm=True, norm=True),
}


def hf_model(arch: str, default_gguf, out):
    """A tiny random model of `arch` with SmolLM2's tokenizer, saved as Hugging Face checkpoints are (llama.cpp's
    olmo2 wants its own output head)."""
    import transformers
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)
    config_class, model_class = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "olmo2": ("Olmo2Config", "Olmo2ForCausalLM")}[arch]
    torch.manual_seed(0)
    cfg = getattr(transformers, config_class)(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=arch == "llama", bos_token_id=1, eos_token_id=2)
    getattr(transformers, model_class)(cfg).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module", params=["llama", "olmo2"])
def imported(request, default_gguf, tmp_path_factory):
    """(checkpoint folder, imported GGUF) for a tiny model of each architecture with EVERY_OPTION (olmo2's settings
    given per kind, llama's per linear)."""
    folder = tmp_path_factory.mktemp(f"vptq-{request.param}")
    ckpt = vc.make(hf_model(request.param, default_gguf, folder / "hf"), folder / "vptq", EVERY_OPTION,
                   shared=request.param == "olmo2")
    return ckpt, import_checkpoint(ckpt, folder / "imported.gguf", llama_tree=tree_dir(), other_type="f32")


def modules(model):
    from vptq.layers.vqlinear import VQuantLinear
    return {name: m for name, m in model.named_modules() if isinstance(m, VQuantLinear)}


def test_every_layer_decodes_as_the_package_does(imported):
    ckpt, path = imported
    model = vc.load(ckpt)
    reader = GGUFReader(path)
    vq = read_vq(reader)
    assert len(vq) == len(modules(model)) == 14
    for name, layer in modules(model).items():
        block, kind = int(name.split(".")[2]), name.rpartition(".")[2]
        gguf_kind = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
                     "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}[kind]
        ours = dequantize(vq[f"blk.{block}.{gguf_kind}.weight"])
        np.testing.assert_array_equal(ours, vc.dequantized(layer).detach().numpy(), err_msg=name)
    rate = {t.name: ggml_vq.type_name(ggml_vq.rate_quarters(t.tensor_type)) for t in reader.tensors if ggml_vq.is_vq(t.tensor_type)}
    assert rate["blk.0.attn_q.weight"] == "vq2_50" and rate["blk.1.ffn_up.weight"] == "vq1_50"


def test_llama_cpp_gives_the_logits_of_transformers_with_vptq(imported, tmp_path):
    ckpt, path = imported
    model = vc.load(ckpt).float()
    tokens = [int(t) for t in np.random.default_rng(0).integers(0, 49152, 48)]
    with torch.no_grad():
        expected = model(torch.tensor([tokens])).logits[0].numpy()
    with Model(path, n_ctx=128) as m:
        got = np.asarray(m.logits(tokens))
    # (llama.cpp keeps its KV cache in F16: a few 1e-3 of the logits' range)
    np.testing.assert_allclose(got, expected, atol=5e-3 * np.abs(expected).max())
    assert (got.argmax(-1) == expected.argmax(-1)).mean() > 0.95
    version = GGUFReader(path).get_field(ggml_vq.FORMAT_KEY).contents()
    if json.loads((ckpt / "config.json").read_text())["model_type"] == "olmo2":
        assert GGUFReader(path).get_field(ggml_vq.ROPE_NEOX_KEY) is None and version == 1  # NEOX-style already
        return
    assert version == 3   # older loaders, which would ignore vq.rope_neox, refuse the file
    # llama: q and k kept in Hugging Face's row order need vq.rope_neox; without it (renamed away) the logits differ
    data = path.read_bytes()
    assert data.count(ggml_vq.ROPE_NEOX_KEY.encode()) == 1
    broken = tmp_path / "no-key.gguf"
    broken.write_bytes(data.replace(ggml_vq.ROPE_NEOX_KEY.encode(), b"vq.rope_xxxx"))
    with Model(broken, n_ctx=128) as m:
        assert np.abs(np.asarray(m.logits(tokens)) - expected).max() > 0.05 * np.abs(expected).max()


def test_float16_checkpoint_imports_exactly(hf_dir, tmp_path):
    """Published checkpoints are float16: the codebooks are copied bit for bit; the package decodes in float16,
    we in float32, so the weights agree to float16 rounding."""
    layouts = {"down_proj": vc.Layout(v=8, k=256, k_res=16, perm=True, norm=True)}
    ckpt = vc.make(hf_dir, tmp_path / "vptq", layouts, dtype=torch.float16)
    path = import_checkpoint(ckpt, tmp_path / "f16.gguf", llama_tree=tree_dir(), other_type="f16")
    vq = read_vq(GGUFReader(path))
    layer = modules(vc.load(ckpt).half())["model.layers.1.mlp.down_proj"]
    np.testing.assert_allclose(dequantize(vq["blk.1.ffn_down.weight"]), vc.dequantized(layer).detach().numpy(), rtol=2e-3, atol=1e-4)
    with Model(path, n_ctx=64) as m:
        assert np.isfinite(np.asarray(m.logits([1, 2, 3]))).all()


def test_indices_stored_as_float16_bits():
    """indices_as_float keeps the uint16 codes in a float16 tensor's bits (a layer the package's loader cannot
    reload: it casts them to its int16 parameter by value), so the layer is compared directly."""
    args = vc.Layout(v=4, k=256, packed=False, indices_as_float=True).init_args(64, 64)
    layer = vc.random_layer(args, torch.Generator().manual_seed(0), torch.float32)
    assert layer.indices.dtype == torch.float16
    params = {name: p.detach() for name, p in layer.named_parameters()}
    t = layer_to_vq("model.layers.0.self_attn.v_proj", args, lambda p: params.get(p))
    np.testing.assert_array_equal(dequantize(t), vc.dequantized(layer).detach().numpy())


REFUSED = {
    "vector length 12 does not divide 64": (vc.Layout(v=12, k=4096), torch.float32),
    "not a whole number of quarter bits": (vc.Layout(v=8, k=8192), torch.float32),
    "outlier columns with enable_norm": (vc.Layout(v=4, k=64, norm=True, outliers=16, v_outlier=2, k_outlier=16), torch.float32),
    # (the package cannot even write this one: its pack_index checks itself with that same mask and fails)
    "residual indices of 8 bits packed beside main indices of 4": (vc.Layout(v=4, k=16, k_res=256), None),
    "not exactly representable in F16": (vc.Layout(v=4, k=16), torch.bfloat16),
}


@pytest.mark.parametrize("message", REFUSED)
def test_what_the_format_cannot_express_is_refused_by_name(message):
    layout, dtype = REFUSED[message]
    args = layout.init_args(64, 64)
    params = {}
    if dtype is not None:
        layer = vc.random_layer(args, torch.Generator().manual_seed(0), dtype)
        if dtype == torch.bfloat16:
            layer.centroids.weight.data[0, 0] = 1e-7     # bfloat16 holds it, float16 only as a subnormal near it
        params = {name: p.detach() for name, p in layer.named_parameters()}
    with pytest.raises(VPTQImportError, match=message) as e:
        layer_to_vq("model.layers.0.mlp.down_proj", args, lambda p: params.get(p))
    assert "model.layers.0.mlp.down_proj" in str(e.value)


def test_a_checkpoint_without_vptq_config_is_refused(hf_dir, tmp_path):
    with pytest.raises(VPTQImportError, match="quant_method 'vptq'"):
        import_checkpoint(hf_dir, tmp_path / "x.gguf", llama_tree=tree_dir())
    with pytest.raises(FileNotFoundError):
        import_checkpoint(tmp_path / "nowhere", tmp_path / "x.gguf", llama_tree=tree_dir())
