"""A VQ file in a preset's layout with random codes and codebooks: for speed, which depends on the layout (vector
length, codebook sizes, shared codebooks, row scales) and not on the values. Made in seconds where quantizing takes
minutes to hours; its output is meaningless. `tools/bench.py --layout` measures the presets with such files.

    python -m vq_gguf.tools.layout_file SOURCE.gguf --preset 2bit-shared --out FILE
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from vq_gguf import ggml_vq, gguf_writer, source as source_mod
from vq_gguf.config import VQConfig
from vq_gguf.names import kind_of
from vq_gguf.presets import PRESETS, Preset
from vq_gguf.vqtensor import Shared, VQTensor

SCALE = 0.02  # of the random centroids: activations stay finite through a deep model


def random_tensor(shape: tuple[int, int], cfg: VQConfig, rng: np.random.Generator) -> VQTensor:
    """One weight of shape (out, in) in the layout of `cfg`: random codes and codebooks, unit row scales and
    column norms where the layout has them."""
    out_f, in_f = shape
    if cfg.outlier_frac:
        raise ValueError("layout files have no outlier codebooks (no preset uses them)")
    if not cfg.fits(out_f, in_f):
        raise ValueError(f"v={cfg.v} does not fit {out_f} output channels, or {in_f} inputs are not whole blocks")
    P = out_f // cfg.v
    book = lambda k: (rng.standard_normal((cfg.groups, k, cfg.v)) * SCALE).astype(np.float16)
    t = VQTensor(shape=(P * cfg.v, in_f), codes=rng.integers(0, cfg.k, (P, in_f), dtype=np.uint32), codebook=book(cfg.k))
    if cfg.k_res:
        t.res_codes, t.res_codebook = rng.integers(0, cfg.k_res, (P, in_f), dtype=np.uint32), book(cfg.k_res)
    if cfg.row_scale:
        t.row_scale = np.ones(P * cfg.v, np.float16)
    if cfg.col_norm:
        t.col_norm = np.stack([np.ones(in_f, np.float32), np.zeros(in_f, np.float32)])
    return t.add_tail(rng.standard_normal((out_f - P * cfg.v, in_f)) * SCALE)


def layout_tensors(src: source_mod.SourceModel, preset: Preset, seed: int = 0) -> dict[str, VQTensor]:
    """Every block linear of `src` in the preset's layout; the tensors of a shared kind and equal settings link one
    codebook, as quantize writes them."""
    rng = np.random.default_rng(seed)
    shared: dict[tuple[str, VQConfig], Shared] = {}
    tensors = {}
    for name in src.linear_names():
        cfg = preset.config_for(name, src.n_blocks)
        try:
            t = random_tensor(tuple(src.shape(name)), cfg, rng)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        kind = kind_of(name)
        if kind in preset.share:
            key = (kind, cfg)
            if key not in shared:
                shared[key] = Shared(ggml_vq.shared_name(f"{kind}.{len(shared)}", "vq_codebook"), t.codebook)
            t.codebook = shared[key].data
            t.link(shared[key])
        tensors[name] = t
    return tensors


def write(source_path: Path, preset: Preset, out: Path, other_type: str = "q8_0", seed: int = 0) -> Path:
    src = source_mod.load(source_path)
    return gguf_writer.write(out, src, vq=layout_tensors(src, preset, seed), other_type=other_type,
                             extra_kv={ggml_vq.METHOD_KEY: "random-layout", ggml_vq.PRESET_KEY: preset.name})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", type=Path, help="the model whose shapes and other tensors the file takes (GGUF)")
    ap.add_argument("--preset", required=True, choices=sorted(PRESETS))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--other-type", choices=("f32", "f16", "q8_0"), default="q8_0")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(write(args.source, PRESETS[args.preset], args.out, args.other_type, args.seed))


if __name__ == "__main__":
    main()
