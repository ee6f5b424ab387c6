"""Reference decoder in numpy: a VQTensor back to the float weight it stands for (docs/format.md §5).

Mirrors ggml_vq_decode_vrow in native/ggml/ggml-vq.c; the tests hold the two together.
"""
from __future__ import annotations

import numpy as np

from .vqtensor import VQTensor


def dequantize(t: VQTensor) -> np.ndarray:
    """float32 [out, in] in the original column order."""
    out_features, in_features = t.shape
    v, G, P = t.v, t.groups, t.P
    group = np.arange(in_features) // (in_features // G)                    # per stored column
    vals = t.codebook.astype(np.float32)[group[None, :], t.codes]           # [P, in, v]
    if t.res_codebook is not None:
        vals = vals + t.res_codebook.astype(np.float32)[group[None, :], t.res_codes]
    if t.col_norm is not None:
        vals = vals * t.col_norm[0][None, :, None] + t.col_norm[1][None, :, None]
    stored = vals.transpose(0, 2, 1).reshape(P * v, in_features)            # row p*v+e, stored column j
    w = np.empty((out_features, in_features), np.float32)
    w[:P * v][:, t.perm if t.perm is not None else np.arange(in_features)] = stored
    if t.tail is not None:
        w[P * v:] = t.tail
    if t.outlier_cols is not None:
        K0, v0 = t.outlier_codebook.shape
        rows = np.arange(out_features)
        ocb = t.outlier_codebook.astype(np.float32)
        idx = t.outlier_idx.astype(np.uint16).astype(np.int64) & (K0 - 1)   # [n_o, out/v0]
        for o, c in enumerate(t.outlier_cols):
            w[:, c] += ocb[idx[o, rows // v0], rows % v0]
    if t.row_scale is not None:
        w *= t.row_scale[:, None]
    return w
