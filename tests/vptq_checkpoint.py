"""VPTQ checkpoints made by the `vptq` package's own layer (VQuantLinear), in the format its loader reads:
a Hugging Face directory whose config.json carries the per-layer `quantization_config` and whose safetensors
hold each quantized linear's packed indices, centroids and side parameters. Random values, every option the
layer supports; what tests/test_import_vptq.py imports and checks against the package."""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Layout:
    """One layer's VPTQ settings (the names of VQuantLinear's arguments)."""
    v: int
    k: int
    k_res: int = -1               # -1: no residual codebook
    groups: int = 1
    packed: bool = True           # indices bit-packed into int32 (as published), else one int16 per vector
    perm: bool = False
    norm: bool = False
    outliers: int = 0             # outlier columns
    v_outlier: int = -1
    k_outlier: int = -1
    indices_as_float: bool = False

    def init_args(self, in_features: int, out_features: int) -> dict:
        return dict(in_features=in_features, out_features=out_features,
                    vector_lens=[self.v_outlier, self.v], num_centroids=[self.k_outlier, self.k],
                    num_res_centroids=[-1, self.k_res], group_num=self.groups,
                    group_size=(in_features - self.outliers) // self.groups, outlier_size=self.outliers,
                    indices_as_float=self.indices_as_float, enable_norm=self.norm, enable_perm=self.perm,
                    is_indice_packed=self.packed, bias=False, vector_quant_dim="out")


def f16_values(*shape, scale: float, gen: torch.Generator) -> torch.Tensor:
    """Random float32 values that F16 holds exactly (as a checkpoint saved in float16 would have)."""
    return (torch.randn(*shape, generator=gen) * scale).half().float()


def random_layer(args: dict, gen: torch.Generator, dtype: torch.dtype):
    """A VQuantLinear with random codes and codebooks, built and packed by the package itself."""
    from vptq.layers.vqlinear import VQuantLinear
    from vptq.utils.pack import pack_index
    layer = VQuantLinear(**args, enable_proxy_error=False, dtype=dtype)
    G, P, gs = layer.num_codebooks, layer.num_indices, layer.group_size
    layer.centroids.weight.data = f16_values(G, layer.num_centroids * layer.vector_len, scale=0.05, gen=gen).to(dtype)
    idx = torch.randint(0, layer.num_centroids, (G, P, gs), generator=gen)
    res = None
    if layer.enable_residual:
        layer.res_centroids.weight.data = f16_values(G, layer.num_res_centroids * layer.vector_len, scale=0.01, gen=gen).to(dtype)
        res = torch.randint(0, layer.num_res_centroids, (G, P, gs), generator=gen)
    if layer.is_indice_packed:
        layer.indices.data = pack_index(idx.to(torch.int32).to(torch.uint16), layer.index_bits,
                                        None if res is None else res.to(torch.int32).to(torch.uint16),
                                        layer.res_index_bits, index_dtype=torch.uint16)
    else:
        as_type = torch.float16 if layer.indices_as_float else torch.int16
        layer.indices.data = idx.to(torch.int32).to(torch.uint16).view(as_type)
        if res is not None:
            layer.res_indices.data = res.to(torch.int32).to(torch.uint16).view(as_type)
    if layer.enable_outlier:
        layer.outlier_centroids.weight.data = f16_values(1, layer.num_outlier_centroids * layer.outlier_vector_len,
                                                         scale=0.2, gen=gen).to(dtype)
        oidx = torch.randint(0, layer.num_outlier_centroids, tuple(layer.outlier_indices.shape), generator=gen)
        layer.outlier_indices.data = oidx.to(torch.int32).to(torch.uint16).view(torch.int16)
    if layer.enable_perm:
        perm = torch.randperm(layer.in_features, generator=gen)
        layer.perm.data = perm.to(torch.int16) if layer.is_indice_packed else perm
    if layer.enable_norm:
        layer.weight_scale.data = (1 + 0.2 * torch.rand(layer.in_features, generator=gen)).to(dtype)
        layer.weight_bias.data = (0.01 * torch.randn(layer.in_features, generator=gen)).to(dtype)
    return layer


def make(hf_dir: Path, out: Path, layouts: dict[str, Layout], *, seed: int = 0,
         dtype: torch.dtype = torch.float32, shared: bool = False) -> Path:
    """`hf_dir`'s model with each block linear whose name ends in a key of `layouts` (q_proj, down_proj…)
    replaced by a random VQuantLinear of that layout, saved as a VPTQ checkpoint in `out`; the settings per
    linear by full name (`config_for_layers`) or, `shared`, once per kind (`shared_layer_config`)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    gen = torch.Generator().manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype)
    config_for_layers = {}
    for name, module in list(model.named_modules()):
        kind = name.rpartition(".")[2]
        if isinstance(module, torch.nn.Linear) and ".layers." in name and kind in layouts:
            args = layouts[kind].init_args(module.in_features, module.out_features)
            model.set_submodule(name, random_layer(args, gen, dtype))
            config_for_layers[name] = args
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((hf_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "vptq", "config_for_layers": config_for_layers} if not shared else {
        "quant_method": "vptq", "shared_layer_config": {n.rpartition(".")[2]: c for n, c in config_for_layers.items()}}
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in hf_dir.iterdir():
        if f.name != "config.json" and not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)
    return out


def dequantized(layer) -> torch.Tensor:
    """The package's own decoding of a VQuantLinear (its pure-torch `dequant`), float32 [out, in]."""
    from vptq.ops.quant_gemm import dequant
    res_c = None if layer.res_centroids is None else layer.res_centroids.weight.view(layer.num_codebooks, layer.num_res_centroids, layer.vector_len)
    out_c = None if layer.outlier_centroids is None else layer.outlier_centroids.weight.view(1, layer.num_outlier_centroids, layer.outlier_vector_len)
    return dequant(
        indices=layer.indices, centroids=layer.centroids.weight.view(layer.num_codebooks, layer.num_centroids, layer.vector_len),
        outlier_indices=layer.outlier_indices, outlier_centroids=out_c,
        res_indices=layer.res_indices, res_centroids=res_c, perm=getattr(layer, "perm", None),
        weight_scale=layer.weight_scale, weight_bias=layer.weight_bias, is_indice_packed=layer.is_indice_packed,
        enable_outlier=layer.enable_outlier, enable_residual=layer.enable_residual, enable_perm=layer.enable_perm,
        enable_norm=layer.enable_norm, num_centroids=layer.num_centroids,
        num_outlier_centroids=layer.num_outlier_centroids, num_res_centroids=layer.num_res_centroids,
        padding=layer.padding, outlier_padding=layer.outlier_padding, num_codebooks=layer.num_codebooks,
        group_size=layer.group_size, outlier_size=layer.outlier_size, vector_len=layer.vector_len,
        outlier_vector_len=layer.outlier_vector_len).float()


def load(ckpt: Path) -> torch.nn.Module:
    """The checkpoint as transformers + vptq run it: the model class from config.json, its linears replaced by
    the package's own `make_quant_linear`, the safetensors loaded strictly. (The package's AutoModelForCausalLM
    does the same through accelerate, whose hooks the pinned transformers no longer offers.)"""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from vptq.layers.model_base import make_quant_linear
    from vptq.layers.vqlinear import VQuantLinear
    config = AutoConfig.from_pretrained(ckpt)
    qc = config.quantization_config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    make_quant_linear(model, qc.get("config_for_layers", {}), qc.get("shared_layer_config", {}), target_layer=VQuantLinear)
    state = load_file(str(ckpt / "model.safetensors"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise ValueError(f"checkpoint does not fit the model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.eval()
