"""One VQ-quantized weight: indices, codebooks and side data, and its GGUF tensors (docs/format.md §4).

A vector is v consecutive output channels at one input column: vector row p of column j holds W[p·v : p·v+v, j].
Where v does not divide the output channels, the last out % v of them are the weight's tail, kept as F16 values.
A side tensor that several weights link to (format.md 4.1) is one `Shared` object that each of them holds.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from . import ggml_vq
from .pack import pack_codes, unpack_codes


def to_vectors(W: torch.Tensor, v: int) -> torch.Tensor:
    """[out, n] -> [n·P, v]: the vectors of a weight, vector row p of column j at row j·P + p. Codes found
    for them, idx [n·P], are the weight's codes [P, n] as idx.reshape(n, P).T."""
    return W.T.reshape(-1, v)


def split_tail(W, v: int):
    """W [out, in] -> (the out // v · v rows that vectors cover, the tail of out % v rows after them)."""
    n = W.shape[0] // v * v
    return W[:n], W[n:]


@dataclass(frozen=True, eq=False)
class Shared:
    """A side tensor stored once under its own name (vq_shared.<label>.<side>) and linked by several weights.
    The weights hold this one object; the writer stores it at its first use and refuses a different one of the
    same name."""
    name: str
    data: np.ndarray      # in its file type (float16 for codebooks), contiguous

    def __post_init__(self):
        side = self.name.rpartition(".")[2]
        if not self.name.startswith(ggml_vq.SHARED_PREFIX) or side not in ggml_vq.SIDES:
            raise ValueError(f"{self.name!r} is not a shared side tensor name ({ggml_vq.SHARED_PREFIX}<label>.<side>)")
        object.__setattr__(self, "data", np.ascontiguousarray(self.data))

    @property
    def side(self) -> str:
        return self.name.rpartition(".")[2]


@dataclass
class VQTensor:
    shape: tuple[int, int]                        # (out, in): numpy order of the weight
    codes: np.ndarray                             # uint32 [P, in]: main indices, stored column order
    codebook: np.ndarray                          # float16 [G, K1, v]
    res_codes: np.ndarray | None = None           # uint32 [P, in]
    res_codebook: np.ndarray | None = None        # float16 [G, K2, v]
    perm: np.ndarray | None = None                # int32 [in]: stored column j is input column perm[j]
    col_norm: np.ndarray | None = None            # float32 [2, in]: scale and bias per stored column
    row_scale: np.ndarray | None = None           # float16 [out] (float32 in files written before F16)
    outlier_cols: np.ndarray | None = None        # int32 [n_o]
    outlier_idx: np.ndarray | None = None         # int16 [n_o, out/v0]
    outlier_codebook: np.ndarray | None = None    # float16 [K0, v0]
    tail: np.ndarray | None = None                # float16 [out % v, in]: the output channels past P·v
    shared: dict[str, Shared] = field(default_factory=dict)  # side -> the shared tensor that holds it

    def add_tail(self, rows) -> "VQTensor":
        """This weight of P·v rows with `rows` [out % v, in] after them as its tail (format.md §3: their values in
        F16, row scale 1); nothing to add for no rows."""
        if len(rows):
            self.shape = (self.shape[0] + len(rows), self.shape[1])
            self.tail = np.asarray(rows, dtype=np.float32).astype(np.float16)
            if self.row_scale is not None:
                self.row_scale = np.concatenate([self.row_scale, np.ones(len(rows), self.row_scale.dtype)])
        return self

    def link(self, shared: Shared) -> "VQTensor":
        """Hold `shared` for its side instead of an own copy (the values must be those the weight has)."""
        own = getattr(self, shared.side.removeprefix("vq_"))
        if own is None or own.shape != shared.data.shape or not np.array_equal(own, shared.data):
            raise ValueError(f"{shared.name} is not this weight's {shared.side}")
        setattr(self, shared.side.removeprefix("vq_"), shared.data)
        self.shared[shared.side] = shared
        return self

    @property
    def v(self) -> int:
        return self.codebook.shape[2]

    @property
    def P(self) -> int:
        """Vector rows: out // v (the rest is the tail)."""
        return self.shape[0] // self.v

    @property
    def groups(self) -> int:
        return self.codebook.shape[0]

    @property
    def b1(self) -> int:
        return ggml_vq.code_bits(self.codebook.shape[1])

    @property
    def b2(self) -> int:
        return 0 if self.res_codebook is None else ggml_vq.code_bits(self.res_codebook.shape[1])

    @property
    def rate_quarters(self) -> int:
        """n: the ggml type stores n/4 index bits per weight."""
        bits4 = 4 * (self.b1 + self.b2)
        if bits4 % self.v:
            raise ValueError(f"{self.b1 + self.b2} index bits per vector of {self.v} is not a whole number of quarter bits per weight")
        return bits4 // self.v

    def gguf_tensors(self, weight_name: str) -> list[tuple[str, np.ndarray, object]]:
        """(name, array, raw ggml type or None) for the index tensor and every side tensor present; a shared
        side as its Shared's name and array (the writer stores it once)."""
        out_features, in_features = self.shape
        b = self.b1 + self.b2
        merged = self.codes.astype(np.uint64)
        if self.res_codes is not None:
            merged |= self.res_codes.astype(np.uint64) << np.uint64(self.b1)
        # the tail's out % v rows of the index tensor hold no codes (format.md §3): zeros
        row_bytes = in_features * self.rate_quarters // 32
        stream = np.pad(pack_codes(merged, b).reshape(-1, row_bytes), ((0, out_features - self.P * self.v), (0, 0)))
        tensors = [(weight_name, stream, ggml_vq.gguf_type(self.rate_quarters))]
        sides = {
            "vq_codebook": self.codebook.astype(np.float16),
            "vq_res_codebook": None if self.res_codebook is None else self.res_codebook.astype(np.float16),
            "vq_perm": None if self.perm is None else self.perm.astype(np.int32),
            "vq_col_norm": None if self.col_norm is None else self.col_norm.astype(np.float32),
            "vq_row_scale": None if self.row_scale is None else self.row_scale.astype(np.float16),
            "vq_outlier_cols": None if self.outlier_cols is None else self.outlier_cols.astype(np.int32),
            "vq_outlier_idx": None if self.outlier_idx is None else self.outlier_idx.astype(np.int16),
            "vq_outlier_codebook": None if self.outlier_codebook is None else self.outlier_codebook.astype(np.float16),
            "vq_tail": None if self.tail is None else self.tail.astype(np.float16),
        }
        for side in ggml_vq.SIDES:
            if side in self.shared:
                tensors.append((self.shared[side].name, self.shared[side].data, None))
            elif sides[side] is not None:
                tensors.append((ggml_vq.side_name(weight_name, side), np.ascontiguousarray(sides[side]), None))
        return tensors

    def links(self, weight_name: str) -> dict[str, str]:
        """The GGUF keys that point this weight's shared sides at their tensors (only sides it has: no dangling link)."""
        return {ggml_vq.LINK_PREFIX + ggml_vq.side_name(weight_name, side): s.name for side, s in self.shared.items()}

    @classmethod
    def from_gguf(cls, weight_name: str, tensors: dict, links: dict[str, str] | None = None,
                  shared_read: dict[str, Shared] | None = None) -> "VQTensor":
        """Rebuild from a GGUFReader's tensors (name -> ReaderTensor) and links (ggml_vq.links); raises
        ValueError on a malformed set. `shared_read` holds the Shared objects read so far (one per name)."""
        w = tensors[weight_name]
        n = ggml_vq.rate_quarters(w.tensor_type)
        in_features, out_features = (int(x) for x in w.shape[:2])
        shared = {s: links[ggml_vq.side_name(weight_name, s)] for s in ggml_vq.SIDES
                  if ggml_vq.side_name(weight_name, s) in (links or {})}
        for s, target in shared.items():
            if not (target.startswith(ggml_vq.SHARED_PREFIX) and target.endswith("." + s)):
                raise ValueError(f"{weight_name}: its {s} is linked to {target!r}, not a shared {s} tensor")
            if ggml_vq.side_name(weight_name, s) in tensors:
                raise ValueError(f"{weight_name}: has both its own {s} and a link to {target}")

        def side(name):
            tname = shared.get(name) or ggml_vq.side_name(weight_name, name)
            if name in shared and tname not in tensors:
                raise ValueError(f"{weight_name}: its {name} is linked to {tname}, which the file lacks")
            t = tensors.get(tname)
            return None if t is None else np.asarray(t.data)

        codebook = side("vq_codebook")
        if codebook is None:
            raise ValueError(f"{weight_name}: missing codebook tensor {ggml_vq.side_name(weight_name, 'vq_codebook')}")
        res_codebook = side("vq_res_codebook")
        if codebook.ndim == 2:
            codebook = codebook[None]
        if res_codebook is not None and res_codebook.ndim == 2:
            res_codebook = res_codebook[None]
        v = codebook.shape[2]
        b1 = ggml_vq.code_bits(codebook.shape[1])
        b2 = 0 if res_codebook is None else ggml_vq.code_bits(res_codebook.shape[1])
        tail = side("vq_tail")
        n_tail = out_features % v
        if 4 * (b1 + b2) != n * v or out_features < v:
            raise ValueError(f"{weight_name}: codebooks [{v}, 2^{b1}] (+2^{b2}) do not match type {ggml_vq.type_name(n)} "
                             f"and {out_features} output channels")
        if (tail is None) != (n_tail == 0) or (tail is not None and tail.shape != (n_tail, in_features)):
            raise ValueError(f"{weight_name}: {out_features} output channels with v = {v} need "
                             + (f"a vq_tail of [{n_tail}, {in_features}]" if n_tail else "no vq_tail"))
        P = out_features // v
        merged = unpack_codes(np.asarray(w.data).reshape(-1)[:P * in_features * (b1 + b2) // 8], P, in_features, b1 + b2)
        outlier_idx = side("vq_outlier_idx")
        t = cls(
            shape=(out_features, in_features),
            codes=merged & np.uint32((1 << b1) - 1),
            codebook=codebook,
            res_codes=None if res_codebook is None else merged >> np.uint32(b1),
            res_codebook=res_codebook,
            perm=side("vq_perm"),
            col_norm=side("vq_col_norm"),
            row_scale=side("vq_row_scale"),
            outlier_cols=side("vq_outlier_cols"),
            outlier_idx=None if outlier_idx is None else outlier_idx.reshape(-1, out_features // side("vq_outlier_codebook").shape[-1]),
            outlier_codebook=side("vq_outlier_codebook"),
            tail=tail,
        )
        shared_read = {} if shared_read is None else shared_read
        for s, target in shared.items():
            t.link(shared_read.get(target) or shared_read.setdefault(target, Shared(target, getattr(t, s.removeprefix("vq_")))))
        return t


def read_vq(reader, select=lambda name: True) -> dict[str, VQTensor]:
    """The VQ weights of a GGUFReader (those whose name `select` accepts), shared sides resolved."""
    by_name = {t.name: t for t in reader.tensors}
    links, shared = ggml_vq.links(reader.fields), {}
    return {t.name: VQTensor.from_gguf(t.name, by_name, links, shared) for t in reader.tensors
            if ggml_vq.is_vq(t.tensor_type) and select(t.name)}
