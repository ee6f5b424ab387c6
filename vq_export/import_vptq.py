"""Import a checkpoint published in microsoft/VPTQ's format (a Hugging Face directory whose config.json has a
`quantization_config` with `quant_method: vptq`) into a VQ-GGUF file, exactly or not at all.

Each VPTQ linear maps onto docs/format.md without approximation (the mapping is format.md §8): its codes and
codebooks as they are, its permutation as `vq_perm`, its normalization as `vq_col_norm`, its outlier columns as
the outlier triple. A layer the format cannot express (padding of the last vector, a rate that is not a whole
number of quarter bits, centroids that F16 does not hold exactly…) is refused with its name and the setting.

Everything else (names, metadata, tokenizer, the float tensors) comes from the pinned llama.cpp's
convert_hf_to_gguf.py, run on the checkpoint with a small placeholder for every block linear. A placeholder's
rows carry their own number, so the converted file says which GGUF tensor each linear became and how the
converter reordered its rows. llama.cpp's converter reorders the rows of a llama's q and k weights for its
adjacent-pairs rotary embedding, which would break VPTQ's vectors (v consecutive rows); the import keeps them
in Hugging Face's order instead and sets `vq.rope_neox`, which makes the patched llama.cpp rotate them
NEOX-style: the same model, computed on the rows where they are.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFValueType
from tqdm import tqdm

from . import ggml_vq, gguf_writer
from .names import is_linear, kind_of
from .source import KV, SourceError, SourceModel, convert_hf, load_gguf
from .vqtensor import VQTensor

# the parameters of a VPTQ linear (VQuantLinear) in the checkpoint, besides its `bias`
LAYER_PARAMS = ("centroids.weight", "res_centroids.weight", "outlier_centroids.weight", "indices", "res_indices",
                "outlier_indices", "perm", "weight_scale", "weight_bias")
PLACEHOLDER_ID = 1_000_000    # placeholder column 1 holds PLACEHOLDER_ID + the linear's number (exact in F32)
ROW_PERMUTED_KINDS = ("attn_q", "attn_k")  # the rows llama.cpp's converter reorders for its rotary layout


class VPTQImportError(SourceError):
    """The checkpoint cannot be imported exactly: which tensor, which setting."""


def unpack_vptq_indices(packed: np.ndarray, count: int, bits: int) -> np.ndarray:
    """VPTQ's packed indices: each row of int32 words is a little-endian bit stream holding `count` codes of
    `bits` bits, padded to a whole word (vptq.utils.pack.pack_index). -> uint64 [..., count]. Each code is cut
    from the two words it may straddle (bits ≤ 32), without a bit-per-byte copy of the tensor."""
    if packed.shape[-1] * 32 < count * bits:
        raise ValueError(f"{packed.shape[-1]} words per row hold fewer than {count} codes of {bits} bits")
    words = np.ascontiguousarray(packed).view(np.uint32).astype(np.uint64)
    words = np.concatenate([words, np.zeros((*words.shape[:-1], 1), np.uint64)], axis=-1)
    start = np.arange(count, dtype=np.int64) * bits
    pair = words[..., start // 32] | (words[..., start // 32 + 1] << np.uint64(32))
    return (pair >> (start % 32).astype(np.uint64)) & np.uint64((1 << bits) - 1)


def as_u16(t: torch.Tensor) -> np.ndarray:
    """Indices stored as int16 or float16 bit patterns (VPTQ keeps uint16 values in those) -> int64."""
    if t.dtype in (torch.int16, torch.float16):
        return t.contiguous().view(torch.int16).numpy().view(np.uint16).astype(np.int64)
    return t.to(torch.int64).numpy()


def exact_f16(name: str, t: torch.Tensor) -> np.ndarray:
    """A codebook's values in F16 (what the format stores), refused unless F16 holds every value exactly."""
    x = t.detach().to(torch.float32).numpy()
    if not np.isfinite(x).all():
        raise VPTQImportError(f"{name}: non-finite values")
    h = x.astype(np.float16)
    if not np.array_equal(h.astype(np.float32), x):
        bad = np.abs(h.astype(np.float32) - x).argmax()
        raise VPTQImportError(f"{name}: value {x.flat[bad]!r} is not exactly representable in F16 (the format's "
                              f"codebook type; it would become {float(h.flat[bad])!r}); refusing to round")
    return h


def layer_config(module: str, qc: dict) -> dict:
    """A linear's settings: `config_for_layers` by full name, else `shared_layer_config` by its last part."""
    cfg = qc.get("config_for_layers", {}).get(module) or qc.get("shared_layer_config", {}).get(module.rpartition(".")[2])
    if cfg is None:
        raise VPTQImportError(f"{module}: quantized in the checkpoint but not in its quantization_config")
    return cfg


def layer_to_vq(module: str, cfg: dict, get) -> VQTensor:
    """One VPTQ linear (settings `cfg`, parameters by name through `get`, None where absent) as a VQTensor with
    the same weights (format.md §8)."""
    def refuse(why: str):
        raise VPTQImportError(f"{module}: {why}")

    out_f, in_f = int(cfg["out_features"]), int(cfg["in_features"])
    v0, v = (int(x) for x in cfg["vector_lens"])
    K0, K1 = (int(x) for x in cfg["num_centroids"])
    K2 = int(cfg["num_res_centroids"][1])
    G, gs, n_o = int(cfg["group_num"]), int(cfg["group_size"]), int(cfg.get("outlier_size", 0))
    outliers = v0 > 1 and K0 > 0
    norm, packed = bool(cfg.get("enable_norm")), bool(cfg.get("is_indice_packed"))
    if cfg.get("vector_quant_dim", "out") != "out":
        refuse(f"vector_quant_dim {cfg['vector_quant_dim']!r}: only 'out' (vectors along output channels) exists")
    if out_f % v:
        refuse(f"vector length {v} does not divide {out_f} output channels (VPTQ pads the last vector; reading it "
               f"into the format's tail of F16 rows is not done)")
    if in_f % ggml_vq.BLOCK_SIZE:
        refuse(f"{in_f} input columns are not a multiple of {ggml_vq.BLOCK_SIZE}")
    if G * gs + (n_o if outliers else 0) != in_f:
        refuse(f"{G} groups of {gs} columns and {n_o} outlier columns do not make {in_f} columns")
    try:
        b1, b2 = ggml_vq.code_bits(K1), (ggml_vq.code_bits(K2) if K2 > 0 else 0)
    except ValueError as e:
        refuse(str(e))
    if packed and b2 > b1:
        refuse(f"residual indices of {b2} bits packed beside main indices of {b1}: the package's own decoder reads "
               f"them with a {b1}-bit mask, so the checkpoint has no single meaning")
    if outliers and (norm or G > 1 or out_f % v0):
        refuse("outlier columns " + ("with enable_norm (the format adds outliers after the column norm, VPTQ scales them)"
                                     if norm else f"with {G} groups" if G > 1 else f"of vector length {v0} not dividing {out_f}"))

    P = out_f // v
    if packed:
        merged = unpack_vptq_indices(get("indices").numpy(), gs, b1 + b2)          # [G, P, gs]
        idx, res = merged & np.uint64((1 << b1) - 1), (merged >> np.uint64(b1) if b2 else None)
    else:
        idx = as_u16(get("indices")).reshape(G, P, gs)
        res = as_u16(get("res_indices")).reshape(G, P, gs) if b2 else None
    for name, codes, k in (("indices", idx, K1), ("res_indices", res, K2)):
        if codes is not None and codes.size and int(codes.max()) >= k:
            refuse(f"{name} hold {int(codes.max())}, outside a codebook of {k}")

    def stored(codes: np.ndarray) -> np.ndarray:
        """[G, P, gs] -> [P, in]: stored column n_o + g·gs + c (outlier columns first, their main codes 0)."""
        main = codes.transpose(1, 0, 2).reshape(P, G * gs)
        return np.concatenate([np.zeros((P, in_f - G * gs), np.uint64), main], axis=1).astype(np.uint32)

    t = VQTensor(shape=(out_f, in_f), codes=stored(idx),
                 codebook=exact_f16(f"{module}.centroids", get("centroids.weight")).reshape(G, K1, v))
    if b2:
        t.res_codes = stored(res)
        t.res_codebook = exact_f16(f"{module}.res_centroids", get("res_centroids.weight")).reshape(G, K2, v)
    if cfg.get("enable_perm"):
        perm = as_u16(get("perm")) if packed else get("perm").to(torch.int64).numpy()
        if perm.shape != (in_f,) or not np.array_equal(np.sort(perm), np.arange(in_f)):
            refuse("perm is not a permutation of the input columns")
        t.perm = perm.astype(np.int32)
    column = t.perm if t.perm is not None else np.arange(in_f)    # input column of each stored column
    if norm:
        scale, bias = (get(p).to(torch.float32).numpy() for p in ("weight_scale", "weight_bias"))
        if not (np.isfinite(scale).all() and np.isfinite(bias).all()):
            refuse("weight_scale or weight_bias has non-finite values")
        t.col_norm = np.stack([scale[column], bias[column]]).astype(np.float32)
    if outliers:
        t.col_norm = np.stack([np.r_[np.zeros(n_o), np.ones(in_f - n_o)], np.zeros(in_f)]).astype(np.float32)
        t.outlier_cols = column[:n_o].astype(np.int32)
        t.outlier_idx = as_u16(get("outlier_indices")).reshape(out_f // v0, n_o).T.astype(np.uint16).view(np.int16)
        t.outlier_codebook = exact_f16(f"{module}.outlier_centroids", get("outlier_centroids.weight")).reshape(K0, v0)
        if int(t.outlier_idx.view(np.uint16).max()) >= K0:
            refuse(f"outlier_indices point outside a codebook of {K0}")
    try:
        ggml_vq.type_id(t.rate_quarters)
    except ValueError as e:
        refuse(f"v = {v}, {K1} centroids" + (f" + {K2} residual" if b2 else "") + f": {e}")
    return t


class Checkpoint:
    """A VPTQ checkpoint directory: its config, its quantized linears and their tensors, read lazily."""

    def __init__(self, path: Path):
        from safetensors import safe_open
        self.path = Path(path)
        if not (self.path / "config.json").exists():
            raise (VPTQImportError if self.path.exists() else FileNotFoundError)(
                f"{self.path}: not a Hugging Face checkpoint directory (no config.json)")
        self.config = json.loads((self.path / "config.json").read_text())
        self.qc = self.config.get("text_config", self.config).get("quantization_config") or {}
        if self.qc.get("quant_method") != "vptq":
            raise VPTQImportError(f"{self.path}: config.json has no quantization_config with quant_method 'vptq'")
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise VPTQImportError(f"{self.path}: no .safetensors files")
        self._files = {f: safe_open(str(f), framework="pt") for f in files}
        self._where = {name: f for f, h in self._files.items() for name in h.keys()}
        self.modules = sorted({n.removesuffix(".centroids.weight") for n in self._where if n.endswith(".centroids.weight")})
        if not self.modules:
            raise VPTQImportError(f"{self.path}: no quantized linears (no *.centroids.weight tensors)")
        self.layer_params = {f"{m}.{p}" for m in self.modules for p in LAYER_PARAMS}

    def tensor(self, name: str) -> torch.Tensor | None:
        f = self._where.get(name)
        return None if f is None else self._files[f].get_tensor(name)

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._files[self._where[name]].get_slice(name).get_shape())

    def float_linears(self) -> list[str]:
        """The block linears kept in float (2-D weights of model.layers.* that are not quantized)."""
        return [n.removesuffix(".weight") for n in self._where if n.endswith(".weight") and ".layers." in n
                and n not in self.layer_params and len(self.shape(n)) == 2]

    def layer(self, module: str) -> VQTensor:
        return layer_to_vq(module, layer_config(module, self.qc), lambda p: self.tensor(f"{module}.{p}"))

    def out_features(self, module: str) -> int:
        if module in self.modules:
            return int(layer_config(module, self.qc)["out_features"])
        return self.shape(module + ".weight")[0]


def _converted(ck: Checkpoint, linears: list[str], llama_tree: Path, work: Path) -> SourceModel:
    """The checkpoint through the pinned converter, with the block linears `linears` replaced by placeholders
    [out, 2]: column 0 the row number, column 1 PLACEHOLDER_ID + the linear's number in `linears`."""
    from safetensors.torch import save_file
    hf = work / "hf"
    hf.mkdir()
    config = json.loads(json.dumps(ck.config))
    config.get("text_config", config).pop("quantization_config")
    (hf / "config.json").write_text(json.dumps(config, indent=2))
    for f in ck.path.iterdir():   # the tokenizer and generation settings; no weights but those written below
        if f.is_file() and f.name != "config.json" and not f.name.endswith(
                (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth", ".gguf")):
            shutil.copy(f, hf / f.name)
    placeholders = {f"{m}.weight" for m in linears}
    state = {n: ck.tensor(n) for n in ck.names() if n not in ck.layer_params and n not in placeholders}
    for i, m in enumerate(linears):
        rows = torch.arange(ck.out_features(m), dtype=torch.float32)
        state[f"{m}.weight"] = torch.stack([rows, torch.full_like(rows, PLACEHOLDER_ID + i)], dim=1)
    save_file(state, str(hf / "model.safetensors"), metadata={"format": "pt"})
    del state
    src = load_gguf(convert_hf(hf, llama_tree, work / "converted.gguf"))
    return dataclasses.replace(src, tensors=dict(src.tensors))   # in memory: the file goes with `work`


def _placed(src: SourceModel, linears: list[str]) -> dict[str, tuple[str, np.ndarray]]:
    """GGUF name -> (checkpoint linear, the checkpoint row of each GGUF row) for every placeholder the converter
    wrote; refused unless each linear became exactly one tensor whose rows are a reordering of its own."""
    placed = {}
    for name, a in src.tensors.items():
        if a.ndim == 2 and a.shape[1] == 2 and a[0, 1] >= PLACEHOLDER_ID:
            i = int(a[0, 1]) - PLACEHOLDER_ID
            rows = a[:, 0].astype(np.int64)
            if not (0 <= i < len(linears) and (a[:, 1] == a[0, 1]).all() and np.array_equal(np.sort(rows), np.arange(len(rows)))):
                raise VPTQImportError(f"the converter split, merged or transformed the block linear behind {name}: "
                                      "not an architecture the import can map")
            placed[name] = (linears[i], rows)
    missing = set(linears) - {m for m, _ in placed.values()}
    if missing or len(placed) != len(linears):
        raise VPTQImportError(f"the converter did not write {sorted(missing)[:3]} as one tensor each")
    return placed


def import_checkpoint(path: str | Path, out: str | Path, *, llama_tree: Path, other_type: str = "f16",
                      progress: bool = False) -> Path:
    """Write the VPTQ checkpoint at `path` as a VQ-GGUF file `out` (its float tensors in `other_type`)."""
    ck = Checkpoint(Path(path))
    vq_by_module = {}
    for m in (tqdm(ck.modules, desc="VPTQ layers", unit="layer") if progress else ck.modules):
        vq_by_module[m] = ck.layer(m)
    linears = ck.modules + ck.float_linears()
    with tempfile.TemporaryDirectory(prefix="vq-import-") as work:
        src = _converted(ck, linears, llama_tree, Path(work))
    placed = _placed(src, linears)
    reordered = {name for name, (_, rows) in placed.items() if not np.array_equal(rows, np.arange(len(rows)))}
    for name in reordered:
        if not is_linear(name) or kind_of(name) not in ROW_PERMUTED_KINDS:
            raise VPTQImportError(f"the converter reorders the rows of {name}, which the import can only undo for "
                                  f"{' and '.join(ROW_PERMUTED_KINDS)}")
    vq = {}
    for name, (m, _) in placed.items():
        if m in vq_by_module:
            if not is_linear(name):
                raise VPTQImportError(f"{m} becomes {name}, which is not a block linear: VQ is defined for block linears only")
            vq[name] = vq_by_module[m]      # (the source keeps the small placeholder: the writer takes vq's)
        else:
            src.tensors[name] = ck.tensor(m + ".weight").to(torch.float32).numpy()
        # every block linear stays in the checkpoint's row order; what the converter reordered is rotated NEOX-style
        bias = name.removesuffix(".weight") + ".bias"
        if name in reordered and bias in src.tensors:
            src.tensors[bias] = ck.tensor(m + ".bias").to(torch.float32).numpy()
    if reordered:
        src.metadata.append(KV(ggml_vq.ROPE_NEOX_KEY, True, GGUFValueType.BOOL))
    return gguf_writer.write(out, src, vq=vq, other_type=other_type, progress=progress,
                             extra_kv={ggml_vq.METHOD_KEY: "vptq-import"})
