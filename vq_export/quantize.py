"""Vector quantization of a model's block linears in VPTQ's layout, and the pipeline around it.

A vector is v consecutive output channels at one input column. This module quantizes each linear with
k-means codebooks (optionally a residual codebook on the first pass's error); the second-order VPTQ
algorithm builds on the same layout and types.

Finished tensors are saved one file each in a parts folder next to the output, so an interrupted run
resumes where it stopped; the parts are removed once the GGUF is written.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from tqdm import tqdm

from . import ggml_vq, gguf_writer
from .kmeans import kmeans, nearest
from .source import SourceModel
from .vqtensor import VQTensor


@dataclass(frozen=True)
class VQConfig:
    v: int                 # vector length (output channels per vector)
    k: int                 # main codebook size
    k_res: int = 0         # residual codebook size (0: none)
    iters: int = 25        # k-means iterations

    @property
    def index_bits(self) -> int:
        return _log2(self.k) + (_log2(self.k_res) if self.k_res else 0)

    @property
    def rate_quarters(self) -> int:
        if (4 * self.index_bits) % self.v:
            raise ValueError(f"v={self.v} with {self.index_bits} index bits is not a whole number of quarter bits per weight")
        return 4 * self.index_bits // self.v


# index bits per weight: 2bit 2.0, 3bit 3.0, 4bit 4.0 (codebooks add ~0.03 on the default model)
PRESETS = {
    "2bit": VQConfig(v=4, k=256),
    "3bit": VQConfig(v=4, k=256, k_res=16),
    "4bit": VQConfig(v=4, k=256, k_res=256),
}


def _log2(k: int) -> int:
    b = int(k).bit_length() - 1
    if k < 2 or (1 << b) != k or b > 16:
        raise ValueError(f"codebook size {k} is not a power of two in [2, 65536]")
    return b


def to_vectors(W: torch.Tensor, v: int) -> torch.Tensor:
    """[out, in] -> [P*in, v]: row p*in + j is output channels p*v..p*v+v-1 at input column j."""
    out_features, in_features = W.shape
    return W.reshape(out_features // v, v, in_features).permute(0, 2, 1).reshape(-1, v)


def fit_codebook(X: torch.Tensor, k: int, iters: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k-means, then the codebook rounded to F16 (as stored) and the vectors re-assigned to it."""
    C, _ = kmeans(X, k, iters=iters, seed=seed)
    C = C.to(torch.float16).to(torch.float32)
    return C, nearest(X, C)[0]


def quantize_linear(W: np.ndarray, cfg: VQConfig, seed: int = 0) -> VQTensor:
    out_features, in_features = W.shape
    if out_features % cfg.v:
        raise ValueError(f"vector length {cfg.v} does not divide {out_features} output channels")
    if in_features % ggml_vq.BLOCK_SIZE:
        raise ValueError(f"{in_features} input columns are not a multiple of {ggml_vq.BLOCK_SIZE}")
    P = out_features // cfg.v
    X = to_vectors(torch.from_numpy(np.ascontiguousarray(W, dtype=np.float32)), cfg.v)
    C, idx = fit_codebook(X, cfg.k, cfg.iters, seed)
    t = VQTensor(shape=(out_features, in_features), codes=idx.reshape(P, in_features).numpy().astype(np.uint32),
                 codebook=C.to(torch.float16).numpy()[None])
    if cfg.k_res:
        R, ridx = fit_codebook(X - C[idx], cfg.k_res, cfg.iters, seed + 1)
        t.res_codes = ridx.reshape(P, in_features).numpy().astype(np.uint32)
        t.res_codebook = R.to(torch.float16).numpy()[None]
    return t


def _save_part(path: Path, t: VQTensor) -> None:
    tmp = path.with_name(path.name + ".tmp.npz")
    arrays = {k: v for k, v in asdict(t).items() if isinstance(v, np.ndarray)}
    np.savez(tmp, shape=np.array(t.shape), **arrays)
    tmp.replace(path)


def _load_part(path: Path) -> VQTensor:
    with np.load(path) as z:
        fields = {k: z[k] for k in z.files if k != "shape"}
        return VQTensor(shape=tuple(int(x) for x in z["shape"]), **fields)


def _file_key(path: Path) -> str | None:
    field = GGUFReader(path).get_field(ggml_vq.INPUTS_KEY)
    return None if field is None else field.contents()


def quantize_model(source: SourceModel, out: Path, cfg: VQConfig, *, preset: str = "custom", seed: int = 0,
                   other_type: str = "q8_0", only: list[str] | None = None) -> Path:
    """Quantize every block linear (or those whose name contains one of `only`) and write the GGUF."""
    names = [n for n in source.linear_names() if not only or any(s in n for s in only)]
    if not names:
        raise ValueError("no block linear matches the selection")
    key = hashlib.sha256(json.dumps([str(source.path), os.path.getsize(source.path), asdict(cfg), seed,
                                     other_type, names]).encode()).hexdigest()[:16]
    if out.exists() and _file_key(out) == key:
        print(f"[quantize] {out} is up to date (same source, settings and seed)", flush=True)
        return out
    parts = out.with_name(f".{out.name}.parts-{key}")
    parts.mkdir(parents=True, exist_ok=True)

    done: dict[str, VQTensor] = {}
    start = time.time()
    bar = tqdm(names, desc=f"quantize {preset}", unit="tensor", dynamic_ncols=True)
    for name in bar:
        part = parts / f"{name}.npz"
        if part.exists():
            done[name] = _load_part(part)
            continue
        bar.set_postfix_str(name)
        done[name] = quantize_linear(source.tensors[name], cfg, seed=seed)
        _save_part(part, done[name])
    bar.close()

    path = gguf_writer.write(out, source, vq=done, other_type=other_type, progress=False,
                             extra_kv={ggml_vq.METHOD_KEY: "kmeans", ggml_vq.PRESET_KEY: preset, ggml_vq.INPUTS_KEY: key})
    for f in parts.iterdir():
        f.unlink()
    parts.rmdir()
    print(f"[quantize] {len(names)} tensors in {time.time() - start:.0f} s -> {path}", flush=True)
    return path
