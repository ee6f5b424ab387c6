"""Bit packing of VQ codes (docs/format.md §3): per vector row, a little-endian stream of b-bit codes."""
from __future__ import annotations

import numpy as np


def pack_codes(codes: np.ndarray, b: int) -> np.ndarray:
    """codes[P, in] (< 2**b) -> uint8[P, in*b/8]: code j of row p at bits [j*b, j*b+b) of row p's stream."""
    codes = np.asarray(codes, dtype=np.uint64)
    P, n = codes.shape
    if (n * b) % 8:
        raise ValueError(f"{n} codes of {b} bits do not fill whole bytes")
    if codes.size and int(codes.max()) >> b:
        raise ValueError(f"a code does not fit in {b} bits")
    bits = ((codes[:, :, None] >> np.arange(b, dtype=np.uint64)) & np.uint64(1)).astype(np.uint8)
    return np.packbits(bits.reshape(P, n * b), axis=1, bitorder="little")


def unpack_codes(data: np.ndarray, P: int, n: int, b: int) -> np.ndarray:
    """Inverse of pack_codes: uint8 data of P vector rows -> codes[P, n] as uint32."""
    data = np.asarray(data, dtype=np.uint8).reshape(P, n * b // 8)
    bits = np.unpackbits(data, axis=1, bitorder="little").reshape(P, n, b).astype(np.uint32)
    return (bits << np.arange(b, dtype=np.uint32)).sum(axis=2, dtype=np.uint32)
