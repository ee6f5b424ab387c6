"""Load a source model as float tensors plus the GGUF metadata that the output file must keep.

Two inputs are accepted:
- a GGUF file (any llama.cpp type that the `gguf` package can dequantize), read directly;
- a Hugging Face directory (config.json + safetensors + tokenizer), converted to a GGUF in the checkpoint's own
  float type first by the `convert_hf_to_gguf.py` of the pinned llama.cpp tree, so that tensor names, Q/K
  permutations and the tokenizer metadata are exactly what the patched llama.cpp expects.

A file's tensors are read one at a time when asked for (`TensorFile`), never all at once: the quantizer holds
one block of a model in memory, whatever the model's size. Every tensor is read once at load to check its values.
"""
from __future__ import annotations

import copy
import ctypes
import dataclasses
import hashlib
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, quant_shape_from_byte_shape
from gguf.quants import dequantize

from . import ggml_vq
from .names import block_of, is_linear, is_side
from .atomic import replacing

# GGUF architectures that tests/test_architectures.py holds: transformers and llama.cpp agree on the float
# model, and every block linear reaches the VQ kernels (docs/architectures.md)
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "granite", "olmo2", "gemma2", "gemma3", "phi3", "qwen2moe")



def load_model(model: str | Path) -> "SourceModel":
    """The float source of `model` ("default", a GGUF file or a Hugging Face directory), read as `load` does."""
    from .default_model import resolve
    from .native.build import tree_dir
    from .paths import home
    return load(resolve(str(model)), llama_tree=tree_dir(), cache_dir=home() / "hf-gguf")


class SourceError(ValueError):
    """The source model cannot be used: wrong path, malformed file, unsupported architecture, bad values."""


@dataclass
class KV:
    key: str
    value: Any
    vtype: GGUFValueType
    sub_type: GGUFValueType | None = None


class TensorFile(Mapping[str, np.ndarray]):
    """A GGUF file's tensors by name, in file order, each read from the file and dequantized to float32 when
    asked for (a new array each time: hold it as long as it is needed), with `replaced` tensors in place of the
    file's. Reads go through the file, not a memory map, so what was read leaves no pages in the process."""

    def __init__(self, path: Path, reader: GGUFReader):
        self.path = path
        # name -> (offset, bytes, the reader's dtype and shape of the raw data, type): the header only
        self._where = {t.name: (int(t.data_offset), int(t.n_bytes), t.data.dtype, t.data.shape,
                                GGMLQuantizationType(t.tensor_type)) for t in reader.tensors}
        self._replaced: dict[str, np.ndarray] = {}

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self._replaced:
            return self._replaced[name]
        offset, n_bytes, dtype, shape, qtype = self._where[name]
        raw = np.fromfile(self.path, dtype=np.uint8, count=n_bytes, offset=offset).view(dtype).reshape(shape)
        try:
            values = dequantize(raw, qtype)
        except NotImplementedError as e:
            raise SourceError(f"{self.path}: cannot dequantize {name} of type {qtype.name}") from e
        return np.asarray(values, dtype=np.float32).reshape(self.shape(name))

    def shape(self, name: str) -> tuple[int, ...]:
        """numpy shape (reversed ggml ne), without reading the tensor."""
        if name in self._replaced:
            return self._replaced[name].shape
        _, _, dtype, shape, qtype = self._where[name]
        return tuple(quant_shape_from_byte_shape(shape, qtype)) if dtype == np.uint8 else tuple(shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def replacing(self, tensors: Mapping[str, np.ndarray]) -> "TensorFile":
        """The same file with `tensors` (of its names) in place of the file's."""
        new = copy.copy(self)
        new._replaced = {**self._replaced, **tensors}
        return new


@dataclass
class SourceModel:
    path: Path
    arch: str
    metadata: list[KV]
    # float32, numpy shape = reversed ggml ne; a TensorFile reads each when asked
    tensors: Mapping[str, np.ndarray] = field(repr=False)
    source_types: dict[str, str] = field(default_factory=dict)
    # what transformers loads to run the model (model.py): its Hugging Face directory or GGUF file; None for
    # a model whose tensors are not a file's (made in memory, or VQ weights decoded)
    hf_source: Path | None = None

    def linear_names(self) -> list[str]:
        """The block linears, in file order: what the quantizer replaces."""
        return [name for name in self.tensors if is_linear(name)]

    def shape(self, name: str) -> tuple[int, ...]:
        t = self.tensors   # a mapping that makes its tensors when asked (a TensorFile) says their shapes first
        return t.shape(name) if hasattr(t, "shape") else t[name].shape

    def replacing(self, tensors: Mapping[str, np.ndarray]) -> "SourceModel":
        """This model with `tensors` in place of its own (tuned norms, say), the others read as before."""
        t = self.tensors
        return dataclasses.replace(self, tensors=t.replacing(tensors) if isinstance(t, TensorFile) else {**t, **tensors})

    @property
    def n_blocks(self) -> int:
        return 1 + max((block_of(name) for name in self.linear_names()), default=-1)


def read_metadata(reader: GGUFReader) -> list[KV]:
    """Every key-value pair of a GGUF file except the header's own (GGUF.*)."""
    kvs = []
    for f in reader.fields.values():
        if f.name.startswith("GGUF."):
            continue
        vtype = f.types[0]
        sub = f.types[1] if vtype == GGUFValueType.ARRAY and len(f.types) > 1 else None
        kvs.append(KV(f.name, f.contents(), vtype, sub))
    return kvs


def dequantize_tensor(t) -> np.ndarray:
    """A GGUFReader tensor of a llama.cpp type as float32 in numpy order (a writable copy, not a view of the file)."""
    values = dequantize(t.data, GGMLQuantizationType(t.tensor_type))
    return np.array(values, dtype=np.float32).reshape(tuple(int(x) for x in reversed(t.shape)))


def _reader(path: Path) -> tuple[GGUFReader, str]:
    try:
        reader = GGUFReader(path)
    except FileNotFoundError:
        raise
    except Exception as e:  # the gguf reader raises ValueError, struct.error, IndexError... on a bad file
        raise SourceError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e
    arch_field = reader.get_field("general.architecture")
    if arch_field is None:
        raise SourceError(f"{path}: no general.architecture key")
    arch = arch_field.contents()
    if arch not in SUPPORTED_ARCHS:
        raise SourceError(f"{path}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})")
    return reader, arch


def _check_finite(path: Path, name: str, values: np.ndarray) -> np.ndarray:
    if not np.isfinite(values).all():
        bad = int((~np.isfinite(values)).sum())
        raise SourceError(f"{path}: tensor {name} has {bad} NaN or infinite values")
    return values


def unmap_large_allocations(threshold: int = 1 << 20) -> None:
    """Make glibc map every allocation of `threshold` bytes or more on its own and unmap it when freed. By
    default it raises that threshold to the size of the largest block freed so far (up to 32 MiB), and the
    tensors of a model read one after another (load, quantize, write) then stay in a heap that fragments and
    grows with the model's depth."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return   # not glibc: nothing to change
    M_MMAP_THRESHOLD = -3
    libc.mallopt(M_MMAP_THRESHOLD, threshold)


def load_gguf(path: Path) -> SourceModel:
    """A float or llama.cpp-quantized GGUF file, its tensors read when asked for (each checked once here)."""
    unmap_large_allocations()
    reader, arch = _reader(path)
    tensors = TensorFile(path, reader)
    for t in reader.tensors:
        if ggml_vq.is_vq(t.tensor_type):
            raise SourceError(f"{path}: tensor {t.name} is already VQ-quantized; start from a float or llama.cpp-quantized file")
    for name in tensors:
        _check_finite(path, name, tensors[name])
    return SourceModel(path=path, arch=arch, metadata=read_metadata(reader), tensors=tensors,
                       source_types={t.name: t.tensor_type.name for t in reader.tensors}, hf_source=path)


def load_quantized(path: Path) -> tuple[SourceModel, dict]:
    """A VQ-GGUF file as (model with every weight as float, in memory, and the VQ weights as VQTensors): what
    fine-tuning starts from and writes back. Side tensors are part of their VQTensor, not of the model."""
    from .reference import dequantize as decode_vq
    from .vqtensor import VQTensor
    reader, arch = _reader(path)
    by_name = {t.name: t for t in reader.tensors}
    links = ggml_vq.links(reader.fields)
    tensors, types, vq = {}, {}, {}
    for t in reader.tensors:
        if ggml_vq.is_vq(t.tensor_type):
            try:
                vq[t.name] = VQTensor.from_gguf(t.name, by_name, links)
            except (ValueError, KeyError) as e:
                raise SourceError(f"{path}: {e}") from e
            tensors[t.name] = decode_vq(vq[t.name])
        elif is_side(t.name):
            continue
        else:
            try:
                tensors[t.name] = _check_finite(path, t.name, dequantize_tensor(t))
            except NotImplementedError as e:
                raise SourceError(f"{path}: cannot dequantize {t.name} of type {t.tensor_type.name}") from e
        types[t.name] = t.tensor_type.name
    if not vq:
        raise SourceError(f"{path}: no VQ tensors")
    return SourceModel(path=path, arch=arch, metadata=read_metadata(reader), tensors=tensors, source_types=types), vq


def checkpoint_type(hf_dir: Path) -> str:
    """The converter's --outtype that keeps a checkpoint's values exactly: its own 16-bit type when every
    matrix is stored in it, else f32."""
    from safetensors import safe_open
    types = set()
    for f in hf_dir.glob("*.safetensors"):
        with safe_open(f, framework="pt") as st:
            types |= {st.get_slice(k).get_dtype() for k in st.keys() if len(st.get_slice(k).get_shape()) >= 2}
    return {frozenset({"BF16"}): "bf16", frozenset({"F16"}): "f16"}.get(frozenset(types), "f32")


def convert_hf(hf_dir: Path, llama_tree: Path, out: Path, outtype: str = "f32") -> Path:
    """Convert a Hugging Face model directory to a GGUF of `outtype` with the pinned tree's converter."""
    script = llama_tree / "convert_hf_to_gguf.py"
    if not script.exists():
        raise SourceError(f"{script} not found: build the patched llama.cpp first (python -m vq_gguf.native.build)")
    with replacing(out, ".gguf") as tmp:
        cmd = [sys.executable, str(script), str(hf_dir), "--outtype", outtype, "--outfile", str(tmp)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SourceError(f"converting {hf_dir} failed:\n{proc.stderr[-4000:]}")
    return out


def load(path: str | Path, *, llama_tree: Path | None = None, cache_dir: Path | None = None) -> SourceModel:
    """A GGUF file or a Hugging Face directory (converted once, in its own float type, into cache_dir)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"source model {path} does not exist")
    if path.is_dir():
        if not (path / "config.json").exists():
            raise SourceError(f"{path} is a directory without config.json: not a Hugging Face model")
        if llama_tree is None or cache_dir is None:
            raise SourceError("loading a Hugging Face directory needs the llama.cpp tree and a cache directory")
        outtype = checkpoint_type(path)
        where = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:8]   # two folders of one name differ
        gguf_path = cache_dir / f"{path.resolve().name}-{where}.{outtype}.gguf"
        if not gguf_path.exists() or gguf_path.stat().st_mtime < (path / "config.json").stat().st_mtime:
            forget_orphans(cache_dir)
            convert_hf(path, llama_tree, gguf_path, outtype)
            gguf_path.with_suffix(".source").write_text(str(path.resolve()))
        return dataclasses.replace(load_gguf(gguf_path), hf_source=path)
    return load_gguf(path)


def forget_orphans(cache_dir: Path) -> None:
    """Remove the conversions whose Hugging Face folder no longer exists (each `.gguf` has a `.source` note
    beside it naming its folder): else the cache grows by a model's size for every folder ever converted, a
    model moved or downloaded again, a test suite's temporary models."""
    for note in cache_dir.glob("*.source"):
        try:
            folder = Path(note.read_text())
        except FileNotFoundError:   # another process removed it first
            continue
        if not folder.is_dir():
            note.with_suffix(".gguf").unlink(missing_ok=True)
            note.unlink(missing_ok=True)
