"""The C side of the reference decoder, called through the runtime's cffi module."""
from __future__ import annotations

import numpy as np

from vq_gguf.runtime.llama import load_lib
from vq_gguf.vqtensor import VQTensor


def c_layout(t: VQTensor):
    """A struct ggml_vq_layout over t's arrays; returns (layout, arrays to keep alive)."""
    m = load_lib()
    ffi = m.ffi
    out_features, in_features = t.shape
    merged = t.codes.astype(np.uint64)
    if t.res_codes is not None:
        merged |= t.res_codes.astype(np.uint64) << np.uint64(t.b1)
    from vq_gguf.pack import pack_codes
    keep = {"codes": np.ascontiguousarray(pack_codes(merged, t.b1 + t.b2)),
            "codebook": np.ascontiguousarray(t.codebook, dtype=np.float16)}
    L = ffi.new("struct ggml_vq_layout *")
    setattr(L, "in", in_features)  # a Python keyword
    L.out = out_features
    L.v, L.b1, L.b2, L.G = t.v, t.b1, t.b2, t.groups
    L.P, L.n_tail = t.P, out_features - t.P * t.v
    rs_dtype = np.float16 if t.row_scale is not None and t.row_scale.dtype == np.float16 else np.float32
    rs_field = "row_scale_f16" if rs_dtype == np.float16 else "row_scale"
    fields = {"res_codebook": (t.res_codebook, np.float16), "perm": (t.perm, np.int32),
              "col_norm": (t.col_norm, np.float32), rs_field: (t.row_scale, rs_dtype),
              "outlier_cols": (t.outlier_cols, np.int32), "outlier_idx": (t.outlier_idx, np.int16),
              "outlier_codebook": (t.outlier_codebook, np.float16), "tail": (t.tail, np.float16)}
    for name, (arr, dtype) in fields.items():
        if arr is not None:
            keep[name] = np.ascontiguousarray(arr, dtype=dtype)
    if t.outlier_cols is not None:
        L.n_o = len(t.outlier_cols)
        L.v0 = t.outlier_codebook.shape[1]
        L.b0 = int(t.outlier_codebook.shape[0]).bit_length() - 1
    ctype = {"codes": "uint8_t *", "codebook": "ggml_fp16_t *", "res_codebook": "ggml_fp16_t *", "perm": "int32_t *",
             "col_norm": "float *", "row_scale": "float *", "row_scale_f16": "ggml_fp16_t *", "outlier_cols": "int32_t *", "outlier_idx": "int16_t *",
             "outlier_codebook": "ggml_fp16_t *", "tail": "ggml_fp16_t *"}
    for name, arr in keep.items():
        setattr(L, name, ffi.cast(ctype[name], ffi.from_buffer(arr)))
    return L, keep


def c_dequantize(t: VQTensor) -> np.ndarray:
    m = load_lib()
    L, keep = c_layout(t)
    out = np.empty(t.shape, dtype=np.float32)
    m.lib.ggml_vq_dequantize(L, m.ffi.cast("float *", m.ffi.from_buffer(out)))
    return out


def c_check_data(t: VQTensor) -> str | None:
    """None if the C validator accepts t's side data, else its message."""
    m = load_lib()
    L, keep = c_layout(t)
    err = m.ffi.new("char[]", 256)
    return None if m.lib.ggml_vq_check_data(L, err, 256) else m.ffi.string(err).decode()
