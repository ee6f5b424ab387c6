"""Compare VPTQ settings on single real weights, in seconds instead of a whole-model run.

    python -m vq_gguf.tools.layer_proxy --tensors blk.3.ffn_down blk.5.attn_v --configs v=4,k=256 v=4,k=256,row_scale=1 v=2,k=64

    python -m vq_gguf.tools.layer_proxy --tensors blk.3.ffn_down --files iq2_xxs=llama-IQ2_XXS.gguf vq=model.vq.gguf

For each tensor: the block's input Hessians from calibration windows pushed through the float model (the
`--independent` way), then every config quantized with VPTQ and scored on held-out windows by the relative
layer-output error ‖(W − Ŵ)Xᵀ‖² / ‖WXᵀ‖² (what `vq-gguf quantize` reports per tensor), with its bits per
weight counted like the file's (indices, codebooks, side tensors) and its time. `--rotate` adds each config on
the weight with its input dimension rotated by a random orthogonal transform U (W·U quantized against the Hessian
UᵀHU, the result rotated back, scored on the same held-out inputs): `hadamard`, sign flips then Walsh-Hadamard
blocks of the largest power of two that divides the width (what a kernel could apply to the activations in
O(n log n)), or `orthogonal`, a dense random rotation (the most incoherence any rotation gives). `--files` scores the same
tensors as another GGUF file holds them (llama.cpp's types dequantized by gguf-py, VQ by the reference
decoder), so per-tensor errors can be set beside llama.cpp's at the same bits.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from gguf import GGUFReader

from vq_gguf import bpw, ggml_vq, hessian, source
from vq_gguf.calib import DEFAULT_CALIB, calibration_tokens
from vq_gguf.cli import parse_config
from vq_gguf.default_model import fetch
from vq_gguf.model import Model
from vq_gguf.names import parse_linear
from vq_gguf.paths import home
from vq_gguf.reference import dequantize
from vq_gguf.vptq import VPTQ, output_error
from vq_gguf.vqtensor import VQTensor


class FileWeights:
    """The block linears of a GGUF file as float matrices, with their type and bits per weight as the file counts them."""

    def __init__(self, path: str):
        reader = GGUFReader(path)
        self.tensors = {t.name: t for t in reader.tensors}
        self.links = ggml_vq.links(reader.fields)
        self.bits = {t.name: t for t in bpw.count(path).tensors}

    def weight(self, name: str) -> torch.Tensor:
        t = self.tensors[name]
        w = dequantize(VQTensor.from_gguf(name, self.tensors, self.links)) if ggml_vq.is_vq(t.tensor_type) else source.dequantize_tensor(t)
        return torch.from_numpy(np.asarray(w, dtype=np.float32))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF source (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--tensors", nargs="+", required=True, help="blk.N.NAME, e.g. blk.3.ffn_down")
    ap.add_argument("--configs", nargs="+", default=[], help="comma-separated VQConfig settings")
    ap.add_argument("--files", nargs="+", default=[], metavar="LABEL=PATH", help="score the tensors as these GGUF files hold them")
    ap.add_argument("--rotate", nargs="+", default=[], choices=["hadamard", "orthogonal"],
                    help="also quantize each config on the weight with its inputs rotated (see above)")
    ap.add_argument("--calib-windows", type=int, default=32)
    ap.add_argument("--heldout-windows", type=int, default=4)
    args = ap.parse_args(argv)

    configs = [(c, parse_config(c)) for c in args.configs]
    files = [(label, FileWeights(path)) for label, path in (f.split("=", 1) for f in args.files)]
    src = source.load(args.model or fetch(home()))
    print("| tensor | config | held-out error | bpw | seconds |\n| --- | --- | ---: | ---: | ---: |")
    for name, W, H, Xv in float_hessians(src, args.tensors, args.calib_windows, args.heldout_windows):
        for text, cfg in configs:
            for rotation in [None, *args.rotate]:
                start = time.time()
                U = None if rotation is None else input_rotation(rotation, W.shape[1])
                t = VPTQ(W if U is None else W @ U, H if U is None else U.T.to(H.dtype) @ H @ U.to(H.dtype), cfg).quantize()
                W_hat = torch.as_tensor(np.asarray(dequantize(t), dtype=np.float32))
                W_hat = W_hat if U is None else W_hat @ U.T
                label = text if rotation is None else f"{text}, {rotation}"
                print(f"| {name} | {label} | {output_error(W, W_hat, Xv):.2%} | {tensor_bpw(t):.3f} | {time.time() - start:.0f} |", flush=True)
        for label, f in files:
            err = output_error(W, f.weight(name + ".weight"), Xv)
            bits = f.bits[name + ".weight"]
            print(f"| {name} | {label} ({bits.type}) | {err:.2%} | {bits.bpw:.3f} | – |", flush=True)


def float_hessians(src, tensors: list[str], n_calib: int, n_heldout: int):
    """(blk.N.KIND, W, H, X_heldout) of each named block linear, in block order: the Hessian of its input from
    n_calib calibration windows pushed through the float model, and its inputs from n_heldout more for scoring."""
    wanted = {parse_linear(t) for t in tensors}
    tokens = calibration_tokens(src.path, [DEFAULT_CALIB], n_calib + n_heldout, 512)
    model = Model(src)
    x = model.embed(tokens)
    for i, blk in enumerate(model.blocks[: max(b for b, _ in wanted) + 1]):
        names = [s for b, s in sorted(wanted) if b == i]
        if names:
            H, _ = hessian.collect(blk, x[:n_calib])
            Xv = hessian.inputs(blk, x[n_calib:])
            for short in names:
                h = hessian.INPUT_OF[short]
                yield f"blk.{i}.{short}", blk.w[short], H[h], Xv[h]
        x = blk.push(x)


def input_rotation(kind: str, n: int, seed: int = 0) -> torch.Tensor:
    """An n × n orthogonal matrix U (float32): `hadamard` = diag(random signs) · blockdiag(H_b / √b), b the largest
    power of two dividing n; `orthogonal` = Q of the QR factorization of a Gaussian matrix."""
    g = torch.Generator().manual_seed(seed)
    if kind == "orthogonal":
        q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
        return (q * torch.sign(torch.diagonal(r))).float()
    b = n & -n
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (n,), generator=g).double() * 2 - 1
    return (signs[:, None] * torch.block_diag(*[h / b ** 0.5] * (n // b))).float()


def tensor_bpw(t: VQTensor) -> float:
    """Bits per weight of one VQ tensor as the file counts them (indices and side tensors)."""
    return 8 * sum(a.nbytes for _, a, _ in t.gguf_tensors("blk.0.w.weight")) / (t.shape[0] * t.shape[1])

if __name__ == "__main__":
    main()
