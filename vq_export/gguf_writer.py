"""Write a GGUF for the patched llama.cpp: the source's metadata and tokenizer, VQ weights with their side
tensors (docs/format.md), and every other tensor in a standard type. Written to a temporary file in the
same folder, then renamed: a crash never leaves a half-written model under the final name. A source tensor is
read and converted only when its bytes are written, so writing holds one tensor of the source at a time."""
from __future__ import annotations

import errno
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Mapping

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter, LlamaFileType, quant_shape_to_byte_shape
from gguf.quants import quantize

from . import ggml_vq
from .atomic import replacing
from .source import SourceModel
from .vqtensor import VQTensor

# types for the tensors that are not vector-quantized (token embedding, output head, or all of them in a
# plain float file); 1-D tensors (norms) are always F32
PLAIN_TYPES = {
    "f32": (GGMLQuantizationType.F32, LlamaFileType.ALL_F32),
    "f16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
    "q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
}


def plain_layout(shape: tuple[int, ...], type_name: str) -> tuple[tuple[int, ...], np.dtype, GGMLQuantizationType | None]:
    """How a float tensor of `shape` is stored in one of PLAIN_TYPES: (array shape, array dtype, raw type for
    quantized bytes or None). 1-D tensors stay F32."""
    qtype = PLAIN_TYPES[type_name][0]
    if len(shape) < 2 or qtype == GGMLQuantizationType.F32:
        return shape, np.dtype(np.float32), None
    if qtype == GGMLQuantizationType.F16:
        return shape, np.dtype(np.float16), None
    return tuple(quant_shape_to_byte_shape(shape, qtype)), np.dtype(np.uint8), qtype


def plain_tensor(values: np.ndarray, type_name: str) -> np.ndarray:
    """A float tensor as plain_layout stores it."""
    _, dtype, raw = plain_layout(values.shape, type_name)
    return values.astype(dtype) if raw is None else quantize(values.astype(np.float32), raw)


class Later:
    """A tensor made when the writer writes it (GGUFWriter asks its shape, dtype and nbytes when the header is
    written, and calls tofile once)."""

    def __init__(self, make: Callable[[], np.ndarray], shape: tuple[int, ...], dtype: np.dtype):
        self.make, self.shape, self.dtype = make, shape, dtype
        self.nbytes = math.prod(shape) * dtype.itemsize

    def tofile(self, f) -> None:
        data = self.make()
        if data.shape != self.shape or data.dtype != self.dtype:
            raise ValueError(f"a tensor came out {data.dtype}{list(data.shape)}, announced {self.dtype}{list(self.shape)}")
        data.tofile(f)


def check_writable(path: Path, need_bytes: int) -> None:
    """Before hours of work: the output folder can be created and written, and has room for need_bytes.
    Raises OSError with the folder and the figures."""
    folder = path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=f".{path.name}.probe"):
            pass
    except OSError as e:
        raise OSError(e.errno, f"cannot write the output {path} in {folder}: {e.strerror or e}") from e
    free = shutil.disk_usage(folder).free
    if free < need_bytes:
        raise OSError(errno.ENOSPC, f"not enough free space for {path}: about {need_bytes / 2**20:.1f} MiB needed "
                                    f"(the GGUF, its temporary copy and the resume parts), {free / 2**20:.1f} MiB free in {folder}")


def write(path: str | os.PathLike, source: SourceModel, *, vq: Mapping[str, VQTensor] | None = None,
          override: Mapping[str, np.ndarray] | None = None, other_type: str = "q8_0",
          extra_kv: Mapping[str, str] | None = None, progress: bool = False) -> Path:
    """Write source's model with `vq` weights vector-quantized, `override` tensors replaced by the given
    float arrays (stored F32), and every other 2-D tensor in `other_type`."""
    vq, override, extra_kv = vq or {}, override or {}, extra_kv or {}
    unknown = (set(vq) | set(override)) - set(source.tensors)
    if unknown:
        raise KeyError(f"tensors not in the source model: {sorted(unknown)[:5]}")
    path = Path(path)
    with replacing(path) as tmp:
        writer = _gguf_writer(tmp, source, vq, override, other_type, extra_kv)
        try:
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file(progress=progress)
        finally:
            writer.close()
    return path


def _gguf_writer(tmp: Path, source: SourceModel, vq: Mapping[str, VQTensor], override: Mapping[str, np.ndarray],
                 other_type: str, extra_kv: Mapping[str, str]) -> GGUFWriter:
    """A GGUFWriter for `tmp` holding every key and tensor of the file, ready to write."""
    writer = GGUFWriter(tmp, source.arch)
    file_type = ggml_vq.FTYPE_MOSTLY_VQ if vq else int(PLAIN_TYPES[other_type][1])
    skip = {"general.architecture", "general.file_type", ggml_vq.FORMAT_KEY, *extra_kv}
    for kv in source.metadata:
        if kv.key not in skip and not kv.key.startswith(ggml_vq.LINK_PREFIX):
            writer.add_key_value(kv.key, kv.value, kv.vtype, sub_type=kv.sub_type)
    writer.add_key_value("general.file_type", file_type, GGUFValueType.UINT32)
    links = {k: v for name in source.tensors if name in vq for k, v in vq[name].links(name).items()}  # file order
    if vq:
        rope_neox = any(kv.key == ggml_vq.ROPE_NEOX_KEY and kv.value for kv in source.metadata)
        tails = any(t.tail is not None for t in vq.values())
        writer.add_key_value(ggml_vq.FORMAT_KEY, ggml_vq.format_version(shares=bool(links), rope_neox=rope_neox, tails=tails),
                             GGUFValueType.UINT32)
    for key, value in {**extra_kv, **links}.items():
        writer.add_key_value(key, value, GGUFValueType.STRING)

    stored: dict[str, np.ndarray] = {}   # shared side tensors written so far: each once, at its first weight
    for name in source.tensors:
        if name in vq:
            for tname, data, raw in vq[name].gguf_tensors(name):
                if tname in stored:
                    if stored[tname] is not data:
                        raise ValueError(f"{name} links {tname}, but not the Shared object that an earlier weight links")
                    continue
                if tname.startswith(ggml_vq.SHARED_PREFIX):
                    stored[tname] = data
                writer.add_tensor(tname, data, raw_dtype=raw)
        elif name in override:
            writer.add_tensor(name, np.ascontiguousarray(override[name], dtype=np.float32))
        else:
            shape, dtype, raw = plain_layout(source.shape(name), other_type)
            later = Later(lambda name=name: plain_tensor(source.tensors[name], other_type), shape, dtype)
            writer.add_tensor(name, later, raw_dtype=raw)  # type: ignore[arg-type]  # read when written
    return writer
