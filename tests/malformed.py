"""The malformed-file corpus: variants of the tiny valid VQ model (tests/tiny_model.py), each with what loading
it must give: refused with a message holding given words (the tensor and the problem), or loaded and run
(valid but odd). Used by tests/test_malformed.py, and written out as seeds of the load fuzzer by tests/fuzz.py.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGUFReader, GGUFValueType

from tests import tiny_model
from vq_gguf import ggml_vq, gguf_writer
from vq_gguf.source import KV
from vq_gguf.vqtensor import Shared, VQTensor

Q = "blk.0.attn_q.weight"       # v4, K1 16 + K2 16, 2 groups, every side tensor
K = "blk.0.attn_k.weight"       # v2, K1 8, 3-bit codes
D = "blk.0.ffn_down.weight"     # v4, K1 256, 3 groups of 32 columns, every side tensor
G = "blk.0.ffn_gate.weight"     # v8, K1 256, no side tensor but the codebook
V = "blk.0.attn_v.weight"       # v6 on 32 outputs: 5 vector rows and a tail of 2, no other side tensor
O = "blk.0.attn_output.weight"  # v4, K1 64 + K2 8, every side tensor, its outlier codebook shared with ffn_up


def side(weight: str, suffix: str) -> str:
    return ggml_vq.side_name(weight, suffix)


@dataclass
class Case:
    name: str
    make: Callable[[Path], None]   # writes the file
    expect: tuple[str, ...] | None  # words the refusal must contain; None: the file loads and runs
    # refused by llama.cpp's own check of tensor data (check_tensors), not by the VQ loader: the runtime loads with
    # it on, llama.cpp's tools only with --check-tensors (llama-bench has no such option and runs the file)
    data_check: bool = False


class Edited(VQTensor):
    """A VQ tensor whose GGUF tensors pass through `edit` (name, array, raw type) -> list, and whose links get
    `links` added: files the writer never makes."""

    def __init__(self, t: VQTensor, edit=lambda ts: ts, links=None):
        super().__init__(**t.__dict__)
        self.edit, self.extra_links = edit, links or {}

    def gguf_tensors(self, weight_name):
        return self.edit(super().gguf_tensors(weight_name))

    def links(self, weight_name):
        return {**super().links(weight_name), **self.extra_links}


def tiny(weight: str | None = None, edit=None, links=None, **fields) -> Callable[[Path], None]:
    """Writer-made variant: `fields` replace attributes of `weight`'s VQTensor, `edit` rewrites its GGUF tensors,
    `links` adds link keys."""
    def make(path: Path) -> None:
        vq = tiny_model.vq_tensors()
        if weight:
            for k, v in fields.items():
                setattr(vq[weight], k, v(vq[weight]) if callable(v) else v)
            if edit or links:
                vq[weight] = Edited(vq[weight], edit or (lambda ts: ts), links)
        tiny_model.write(path, vq)
    return make


def rope_key(arch: str, value, vtype: GGUFValueType) -> Callable[[Path], None]:
    """The tiny model as architecture `arch` with the key vq.rope_neox (format.md §1) set to `value`."""
    def make(path: Path) -> None:
        src = tiny_model.source(arch)
        src.metadata.append(KV(ggml_vq.ROPE_NEOX_KEY, value, vtype))
        gguf_writer.write(path, src, vq=tiny_model.vq_tensors(), other_type="f32")
    return make


def link(weight: str, suffix: str) -> str:
    return ggml_vq.LINK_PREFIX + side(weight, suffix)


def replace_side(suffix: str, fn) -> Callable:
    """An edit that replaces the array of one side tensor by fn(array) (None drops it)."""
    def edit(ts):
        out = []
        for n, a, r in ts:
            if n.endswith("." + suffix):
                a = fn(a)
                if a is None:
                    continue
            out.append((n, a, r))
        return out
    return edit


class Layout:
    """Byte offsets in a GGUF file, from the gguf package's reader: for edits the writer cannot make."""

    def __init__(self, path: Path):
        r = GGUFReader(path)
        self.bytes = path.read_bytes()
        self.kv = {k: f.offset for k, f in r.fields.items()}
        self.info = {t.name: t.field.offset for t in r.tensors}
        self.data = {t.name: (int(t.data_offset), int(t.n_bytes)) for t in r.tensors}
        self.data_start = int(r.data_offset)

    def dims_at(self, name: str) -> int:
        """Offset of the tensor's n_dims (after the length-prefixed name)."""
        return self.info[name] + 8 + len(name.encode())

    def type_at(self, name: str) -> int:
        n_dims = struct.unpack_from("<I", self.bytes, self.dims_at(name))[0]
        return self.dims_at(name) + 4 + 8 * n_dims


def raw(edit: Callable[[Layout, bytearray], bytes | bytearray | None]) -> Callable[[Path], None]:
    """Byte-level variant of the valid tiny file."""
    def make(path: Path) -> None:
        tiny_model.write(path)
        lay = Layout(path)
        data = bytearray(lay.bytes)
        out = edit(lay, data)
        path.write_bytes(bytes(data if out is None else out))
    return make


def truncate_at(where: Callable[[Layout], int]):
    return raw(lambda lay, d: d[: where(lay)])


def pack(fmt: str, at: Callable[[Layout], int], *values):
    def edit(lay, d):
        struct.pack_into(fmt, d, at(lay), *values)
    return edit


def set_data(name: str, values: np.ndarray, index: int = 0):
    """Overwrite tensor data with values, starting at element `index`."""
    def edit(lay, d):
        start, n = lay.data[name]
        b = values.tobytes()
        pos = start + index * values.itemsize
        assert pos + len(b) <= start + n
        d[pos: pos + len(b)] = b
    return edit


def rename(old: str, new: str):
    assert len(old) == len(new)
    def edit(lay, d):
        at = lay.info[old] + 8
        d[at: at + len(old)] = new.encode()
    return edit


def set_format_version(fmt: str, value) -> Callable:
    def edit(lay, d):
        at = lay.kv[ggml_vq.FORMAT_KEY] + 8 + len(ggml_vq.FORMAT_KEY)
        struct.pack_into("<I" + fmt, d, at, *value)
    return edit


NAN16, INF16 = np.array([np.nan], np.float16), np.array([np.inf], np.float16)
NAN32, INF32 = np.array([np.nan], np.float32), np.array([-np.inf], np.float32)
I16, I32 = (lambda *v: np.array(v, np.int16)), (lambda *v: np.array(v, np.int32))


def truncations() -> list[Case]:
    """The file cut at every section boundary and inside tensors: header, KV pairs, tensor infos, data."""
    names = tiny_model_tensor_names()
    cases = [Case("truncated: empty file", truncate_at(lambda lay: 0), ("",)),
             Case("truncated: magic only", truncate_at(lambda lay: 4), ("",)),
             Case("truncated: after the version", truncate_at(lambda lay: 8), ("",)),
             Case("truncated: after the tensor count", truncate_at(lambda lay: 16), ("",)),
             Case("truncated: after the KV count", truncate_at(lambda lay: 24), ("",)),
             Case("truncated: inside the first KV key", truncate_at(lambda lay: 35), ("",)),
             Case("truncated: before the format version KV", truncate_at(lambda lay: lay.kv[ggml_vq.FORMAT_KEY]), ("",)),
             Case("truncated: inside the last tensor info", truncate_at(lambda lay: max(lay.info.values()) + 10), ("",)),
             Case("truncated: at the data section", truncate_at(lambda lay: lay.data_start), ("",))]
    for name in names:
        cases.append(Case(f"truncated: at the data of {name}", truncate_at(lambda lay, n=name: lay.data[n][0]), (name,)))
    for name in (Q, side(Q, "vq_codebook"), side(D, "vq_outlier_idx")):
        cases.append(Case(f"truncated: inside the data of {name}",
                          truncate_at(lambda lay, n=name: lay.data[n][0] + lay.data[n][1] // 2), (name,)))
    last = names[-1]
    cases.append(Case("truncated: last byte missing", truncate_at(lambda lay: lay.data[last][0] + lay.data[last][1] - 1), (last,)))
    return cases


def tiny_model_tensor_names() -> list[str]:
    """Tensor names of the tiny file in file order (data order)."""
    names = []
    src = tiny_model.source()
    vq = tiny_model.vq_tensors()
    for name in src.tensors:
        names += [n for n, _, _ in vq[name].gguf_tensors(name) if n not in names] if name in vq else [name]
    return names


def corpus() -> list[Case]:
    cb, rcb = "vq_codebook", "vq_res_codebook"
    return [Case("the valid file", tiny(), None),
            Case("the valid file without a tokenizer", lambda p: tiny_model.write(p, vocab=False), None)] + truncations() + [
        # not a GGUF, or not one this build reads
        Case("not a GGUF: text", raw(lambda lay, d: b"this is not a model file\n" * 64), ("",)),
        Case("GGUF version 4", raw(pack("<I", lambda lay: 4, 4)), ("",)),
        Case("GGUF version 1", raw(pack("<I", lambda lay: 4, 1)), ("",)),
        Case("tensor count beyond the file", raw(pack("<q", lambda lay: 8, 1 << 40)), ("",)),
        Case("KV count beyond the file", raw(pack("<q", lambda lay: 16, 1 << 40)), ("",)),
        *[Case(f"KV value type {t}", raw(pack("<i", lambda lay: lay.kv["general.name"] + 8 + len("general.name"), t)), ("GGUF value type",))
          for t in (13, 100, -1)],
        *[Case(f"rms norm epsilon {e}", raw(lambda lay, d, e=e: struct.pack_into(
            "<f", d, lay.kv["llama.attention.layer_norm_rms_epsilon"] + 8 + len("llama.attention.layer_norm_rms_epsilon") + 4, e)),
            ("rms norm",)) for e in (-1.0, float("nan"), float("inf"))],
        Case("unsupported architecture", lambda p: tiny_model.write(p, arch="nosucharch"), ("unknown model architecture", "nosucharch")),
        # found by the load fuzzer: the loader threw before it owned the GGUF's tensor context (a leak; patched)
        Case("architecture of type uint32", raw(_architecture_as_uint32), ("general.architecture", "wrong type")),
        # found by the load fuzzer: an upstream assert and an out-of-enum file type (both patched)
        Case("duplicate token strings", raw(lambda lay, d: d.replace("\u2581b".encode(), "\u2581a".encode(), 1)), ("duplicate token",)),
        *[Case(f"general.file_type {t}", raw(pack("<I", lambda lay: lay.kv["general.file_type"] + 8 + len("general.file_type") + 4, t)), None)
          for t in (1500, 5000, 0xFFFFFFFF)],
        # format version
        Case("format version missing", raw(lambda lay, d: d.replace(b"vq.format_version", b"vq.format_versioX")), ("format version",)),
        Case("format version 5", raw(set_format_version("I", (4, 5))), ("format version",)),
        Case("format version 0", raw(set_format_version("I", (4, 0))), ("format version",)),
        Case("format version of type int32", raw(set_format_version("i", (5, 1))), ("format version",)),
        # the rope order of imported q and k weights
        Case("the valid file with q and k in Hugging Face's row order", rope_key("llama", True, GGUFValueType.BOOL), None),
        Case("rope order key of type string", rope_key("llama", "yes", GGUFValueType.STRING), ("vq.rope_neox", "not a bool")),
        Case("rope order key on an architecture rotated NEOX-style", rope_key("qwen2", True, GGUFValueType.BOOL),
             ("vq.rope_neox", "adjacent pairs")),
        # type ids
        # ids with no type behind them (below the VQ rates, the gap before them) are named as numbers
        *[Case(f"type id {t} on {Q}", raw(pack("<I", lambda lay: lay.type_at(Q), t)), (Q, f"type {t} (unknown type id)"))
          for t in (199, 200, 201)],
        *[Case(f"type id {t} on {Q}", raw(pack("<I", lambda lay: lay.type_at(Q), t)), (Q,)) for t in (233, 240, 0xFFFFFFFF)],
        Case("VQ type of another rate (same bytes, shape changed)", raw(pack("<I", lambda lay: lay.type_at(Q), 216)), (Q,)),
        Case("VQ type of another rate with matching data", tiny(Q, edit=lambda ts: [
            (n, np.zeros((64, 64 * 9 // 32), np.uint8), ggml_vq.gguf_type(9)) if n == Q else (n, a, r) for n, a, r in ts]),
            (Q, "index bits")),
        Case("VQ type on a norm", raw(pack("<I", lambda lay: lay.type_at("blk.0.attn_norm.weight"), 208)), ("blk.0.attn_norm.weight",)),
        Case("VQ type on the token embedding", _vq_on_token_embd, ("token_embd.weight", "block linears")),
        # shapes in the tensor infos: byte size disagrees with the shape, overflow
        Case("index tensor row length changed", raw(pack("<q", lambda lay: lay.dims_at(Q) + 4, 96)), (Q,)),
        Case("index tensor rows changed", raw(pack("<q", lambda lay: lay.dims_at(Q) + 12, 65)), (Q,)),
        Case("index tensor with 3 dims", raw(pack("<I", lambda lay: lay.dims_at(Q), 3)), ("",)),
        Case("index tensor with 5 dims", raw(pack("<I", lambda lay: lay.dims_at(Q), 5)), ("",)),
        Case("index tensor row length not a multiple of the block", raw(pack("<q", lambda lay: lay.dims_at(Q) + 4, 48)), (Q,)),
        Case("dimension 2^62", raw(pack("<q", lambda lay: lay.dims_at(Q) + 12, 1 << 62)), (Q,)),
        Case("dimension -1", raw(pack("<q", lambda lay: lay.dims_at(Q) + 12, -1)), (Q,)),
        Case("codebook dimension 2^40", raw(pack("<q", lambda lay: lay.dims_at(side(Q, cb)) + 12, 1 << 40)), (side(Q, cb),)),
        # found by the load fuzzer: shapes gguf accepted and ggml_new_tensor then aborted on (patched)
        Case("codebook dims 2^33 x 0 x 2^31", raw(pack("<qqq", lambda lay: lay.dims_at(side(Q, cb)) + 4, 1 << 33, 0, 1 << 31)),
             (side(Q, cb),)),
        Case("index tensor of exactly INT64_MAX elements", raw(pack("<qq", lambda lay: lay.dims_at(Q) + 4, (2**63 - 1) // 7, 7)), (Q,)),
        Case("data offset beyond the file", raw(pack("<Q", lambda lay: lay.type_at(Q) + 4, 1 << 40)), (Q,)),
        Case("data offset misaligned", raw(pack("<Q", lambda lay: lay.type_at(side(Q, cb)) + 4, 3)), ("",)),
        # codebooks of the wrong shape, type or count
        Case("codebook missing", tiny(Q, edit=replace_side(cb, lambda a: None)), (Q, "missing codebook")),
        Case("codebook size not a power of two", tiny(Q, edit=replace_side(cb, lambda a: a[:, :12])), (Q, "power of two")),
        Case("codebook size 1", tiny(K, edit=replace_side(cb, lambda a: a[:, :1])), (K, "power of two")),
        Case("codebook vector length does not divide the outputs", tiny(Q, edit=replace_side(cb, lambda a: np.zeros((2, 16, 5), np.float16))), (Q, "does not divide")),
        Case("codebook vector length 0", tiny(Q, edit=replace_side(cb, lambda a: np.zeros((2, 16, 0), np.float16))), (Q,)),
        Case("codebook bits disagree with the type", tiny(Q, edit=replace_side(cb, lambda a: np.zeros((2, 32, 4), np.float16))), (Q, "index bits")),
        Case("codebook groups do not divide the inputs", tiny(Q, edit=replace_side(cb, lambda a: np.zeros((3, 16, 4), np.float16))), (Q, "groups")),
        Case("codebook of type F32", tiny(Q, edit=replace_side(cb, lambda a: a.astype(np.float32))), (Q, "F16")),
        Case("codebook with a 4th dimension", tiny(Q, edit=replace_side(cb, lambda a: np.stack([a, a]))), (Q, "F16")),
        Case("residual codebook groups differ", tiny(Q, edit=replace_side(rcb, lambda a: a[:1])), (Q, "residual codebook")),
        Case("residual codebook vector length differs", tiny(Q, edit=replace_side(rcb, lambda a: np.zeros((2, 16, 2), np.float16))), (Q, "residual codebook")),
        Case("residual codebook size not a power of two", tiny(Q, edit=replace_side(rcb, lambda a: a[:, :9])), (Q, "residual codebook")),
        Case("residual codebook missing (bits disagree)", tiny(Q, edit=replace_side(rcb, lambda a: None)), (Q, "index bits")),
        # other side tensors of the wrong shape or type
        Case("permutation too short", tiny(Q, edit=replace_side("vq_perm", lambda a: a[:32])), (Q, "permutation")),
        Case("permutation of type F32", tiny(Q, edit=replace_side("vq_perm", lambda a: a.astype(np.float32))), (Q, "permutation")),
        Case("column norm with one row", tiny(Q, edit=replace_side("vq_col_norm", lambda a: a[:1])), (Q, "column norm")),
        Case("row scale too long", tiny(D, edit=replace_side("vq_row_scale", lambda a: np.ones(65, np.float16))), (D, "row scale")),
        Case("row scale as I32", tiny(D, edit=replace_side("vq_row_scale", lambda a: np.ones(len(a), np.int32))), (D, "row scale")),
        Case("row scale as F32 (files before F16 row scales)", tiny(D, edit=replace_side("vq_row_scale", lambda a: a.astype(np.float32))), None),
        Case("outlier indices missing", tiny(Q, edit=replace_side("vq_outlier_idx", lambda a: None)), (Q, "outliers need")),
        Case("outlier codebook missing", tiny(Q, edit=replace_side("vq_outlier_codebook", lambda a: None)), (Q, "outliers need")),
        Case("outlier indices of the wrong shape", tiny(Q, edit=replace_side("vq_outlier_idx", lambda a: a[:, :-1])), (Q, "outlier indices")),
        Case("outlier vector length does not divide the outputs", tiny(Q, edit=replace_side("vq_outlier_codebook", lambda a: np.zeros((8, 3), np.float16))), (Q, "outlier codebook")),
        Case("outlier codebook size not a power of two", tiny(Q, edit=replace_side("vq_outlier_codebook", lambda a: a[:5])), (Q, "outlier codebook")),
        Case("more outlier columns than inputs", tiny(Q, outlier_cols=np.arange(65, dtype=np.int32) % 64,
                                                      outlier_idx=np.zeros((65, 32), np.int16)), (Q, "outlier columns")),
        # NaN and Inf in codebooks and scales
        # (refused by llama.cpp's data check when the loader runs it, which the runtime does, else by ggml_vq_check_data)
        *[Case(f"{what} in {suffix}", raw(set_data(side(w, suffix), val, 5)), (w.removesuffix(".weight"), suffix))
          for w, suffix, vals in ((Q, cb, (NAN16, INF16)), (Q, rcb, (NAN16, INF16)), (D, "vq_col_norm", (NAN32, INF32)),
                                  (Q, "vq_row_scale", (NAN16, INF16)), (D, "vq_outlier_codebook", (NAN16, INF16)),
                                  (V, "vq_tail", (NAN16, INF16)))
          for what, val in zip(("NaN", "Inf"), vals)],
        Case("Inf in the column bias row", raw(set_data(side(Q, "vq_col_norm"), INF32, 64 + 3)), ("blk.0.attn_q", "vq_col_norm")),
        Case("NaN in the token embedding", raw(set_data("token_embd.weight", NAN32, 70)), ("token_embd.weight",),
             data_check=True),
        Case("1e38 in a norm weight", raw(set_data("blk.0.attn_norm.weight", np.array([1e38], np.float32), 3)), None),
        # indices at and beyond the codebook sizes
        Case("every code at the largest index", raw(lambda lay, d: _fill(lay, d, Q, 0xFF)), None),
        Case("3-bit codes all ones", raw(lambda lay, d: _fill(lay, d, K, 0xFF)), None),
        Case("outlier index at the codebook size - 1", raw(set_data(side(Q, "vq_outlier_idx"), I16(7))), None),
        Case("outlier index at the codebook size", raw(set_data(side(Q, "vq_outlier_idx"), I16(8))), (Q, "outlier index")),
        Case("outlier index 65535", raw(set_data(side(D, "vq_outlier_idx"), I16(-1), 10)), (D, "outlier index")),
        Case("outlier column at the last input", raw(set_data(side(Q, "vq_outlier_cols"), I32(63))), None),
        Case("outlier columns repeated", raw(set_data(side(Q, "vq_outlier_cols"), I32(5, 5, 5))), None),
        Case("outlier column at the input count", raw(set_data(side(Q, "vq_outlier_cols"), I32(64))), (Q, "outlier column")),
        Case("outlier column -1", raw(set_data(side(D, "vq_outlier_cols"), I32(-1))), (D, "outlier column")),
        Case("permutation entry at the input count", raw(set_data(side(Q, "vq_perm"), I32(64), 7)), (Q, "permutation")),
        Case("permutation entry -2^31", raw(set_data(side(D, "vq_perm"), I32(-2 ** 31), 95)), (D, "permutation")),
        Case("permutation entry repeated", raw(set_data(side(Q, "vq_perm"), I32(0, 0))), (Q, "permutation")),
        Case("identity permutation", raw(set_data(side(D, "vq_perm"), np.arange(96, dtype=np.int32))), None),
        # the tail of a weight whose vector length does not divide its outputs (format.md §3)
        Case("tail missing", tiny(V, tail=None), (V, "vq_tail")),
        Case("tail of one row too few", tiny(V, tail=lambda t: t.tail[:1]), (V, "vq_tail")),
        Case("tail in F32", tiny(V, edit=lambda ts: [(n, a.astype(np.float32) if n.endswith("vq_tail") else a, r) for n, a, r in ts]),
             (V, "vq_tail")),
        Case("tail on a weight whose vector length divides its outputs",
             tiny(Q, edit=lambda ts: ts + [(side(Q, "vq_tail"), np.zeros((1, 64), np.float16), None)]), (Q, "vq_tail")),
        Case("tail rows of the index tensor not zero", raw(lambda lay, d: _fill_last_rows(lay, d, V, 2)), None),
        # side tensors missing, duplicated or attached to the wrong weight
        *[Case(f"optional {s} missing", tiny(Q, edit=replace_side(s, lambda a: None)), None)
          for s in ("vq_perm", "vq_col_norm", "vq_row_scale")],
        Case("every outlier tensor missing", tiny(Q, outlier_cols=None, outlier_idx=None, outlier_codebook=None), None),
        Case("side tensor duplicated", raw(rename(side(K, cb), side(Q, cb))), (side(Q, cb), "duplicate")),
        Case("permutation moved to a weight of the same width", raw(rename(side(Q, "vq_perm"), side(K, "vq_perm"))), None),
        Case("row scale moved to a weight of another height", tiny(G, row_scale=np.ones(64, np.float32)), (G, "row scale")),
        Case("codebook of a weight that is not VQ", tiny(Q, edit=lambda ts: ts + [("blk.0.attn_norm.vq_codebook", np.zeros((1, 16, 4), np.float16), None)]),
             ("blk.0.attn_norm.vq_codebook", "side tensor")),
        Case("unknown side tensor", tiny(Q, edit=lambda ts: ts + [(side(Q, "vq_scales"), np.zeros(4, np.float32), None)]),
             (side(Q, "vq_scales"), "side tensor")),
        # shared side tensors (format.md 4.1); the valid file shares one outlier codebook between attn_output and ffn_up
        Case("main codebook under a shared name", tiny(K, shared=lambda t: t.link(Shared("vq_shared.k.vq_codebook", t.codebook)).shared), None),
        Case("shared outlier codebook linked by a third weight", _outliers_of_o_linked_by_g, None),
        Case("link to a missing shared tensor", tiny(O, links={link(O, "vq_outlier_codebook"): "vq_shared.none.vq_outlier_codebook"}),
             (O, "vq_shared.none.vq_outlier_codebook", "lacks")),
        Case("own side tensor and a link", tiny(O, edit=lambda ts: ts + [(side(O, "vq_outlier_codebook"), ts[-1][1], None)]),
             (side(O, "vq_outlier_codebook"), "both")),
        Case("NaN in a shared outlier codebook", raw(set_data(tiny_model.SHARED_OUTLIERS, NAN16, 3)), (tiny_model.SHARED_OUTLIERS,)),
        Case("shared tensor that no weight links", tiny(K, edit=lambda ts: ts + [("vq_shared.x.vq_codebook", np.zeros((1, 8, 2), np.float16), None)]),
             ("vq_shared.x.vq_codebook", "no VQ weight")),
        Case("link to a tensor of another side", tiny(K, links={link(K, "vq_perm"): tiny_model.SHARED_OUTLIERS}),
             (link(K, "vq_perm"), "not a shared")),
        Case("link to a weight's own side tensor", tiny(K, links={link(K, "vq_res_codebook"): side(Q, "vq_res_codebook")}),
             (link(K, "vq_res_codebook"), "not a shared")),
        Case("link of a weight that is not VQ", tiny(K, links={link("blk.0.attn_norm.weight", "vq_codebook"): "vq_shared.y.vq_codebook"}),
             (link("blk.0.attn_norm.weight", "vq_codebook"), "no VQ weight")),
        Case("codebook linked by weights of other lane counts", _codebook_of_k_linked_by_g, (G, "codebook")),
    ]


def _fill_last_rows(lay: Layout, d: bytearray, name: str, rows: int) -> None:
    """The index tensor's last `rows` rows (a tail's, which hold no codes) set to 0xff: decoders never read them."""
    start, n = lay.data[name]
    row = n // tiny_model.SHAPES[name][0]
    d[start + n - rows * row: start + n] = b"\xff" * (rows * row)


def _fill(lay: Layout, d: bytearray, name: str, byte: int) -> None:
    start, n = lay.data[name]
    d[start: start + n] = bytes([byte]) * n


def _vq_on_token_embd(path: Path) -> None:
    vq = tiny_model.vq_tensors()
    vq["token_embd.weight"] = VQTensor(shape=(tiny_model.N_VOCAB, tiny_model.N_EMBD),
                                       codes=np.zeros((tiny_model.N_VOCAB // 4, tiny_model.N_EMBD), np.uint32),
                                       codebook=np.zeros((1, 16, 4), np.float16))
    tiny_model.write(path, vq)


def _outliers_of_o_linked_by_g(path: Path) -> None:
    vq = tiny_model.vq_tensors()
    g, shared = vq[G], vq[O].shared["vq_outlier_codebook"]
    g.outlier_cols, g.outlier_idx, g.outlier_codebook = np.array([1], np.int32), np.zeros((1, 96 // 2), np.int16), shared.data
    g.link(shared)
    tiny_model.write(path, vq)


def _codebook_of_k_linked_by_g(path: Path) -> None:
    vq = tiny_model.vq_tensors()
    vq[K].link(Shared("vq_shared.k.vq_codebook", vq[K].codebook))
    vq[G] = Edited(vq[G], edit=lambda ts: [x for x in ts if not x[0].endswith(".vq_codebook")],
                   links={link(G, "vq_codebook"): "vq_shared.k.vq_codebook"})
    tiny_model.write(path, vq)


def _architecture_as_uint32(lay: Layout, d: bytearray) -> bytearray:
    """general.architecture holding a uint32 instead of a string; general.name grows by the bytes that frees,
    so that the header keeps its length and the tensor data its offsets."""
    def value_at(key: str) -> int:
        return lay.kv[key] + 8 + len(key) + 4
    arch, name = value_at("general.architecture"), value_at("general.name")
    arch_len = struct.unpack_from("<Q", d, arch)[0]
    freed = 8 + arch_len - 4
    name_len = struct.unpack_from("<Q", d, name)[0]
    edits = sorted([(arch - 4, 4 + 8 + arch_len, struct.pack("<iI", 4, 0)),
                    (name, 8 + name_len, struct.pack("<Q", name_len + freed) + d[name + 8:name + 8 + name_len] + b"x" * freed)],
                   reverse=True)
    for at, old_len, new in edits:   # the later one first: the earlier offsets stay right
        d[at:at + old_len] = new
    return d
