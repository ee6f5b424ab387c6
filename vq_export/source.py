"""Load a source model as float tensors plus the GGUF metadata that the output file must keep.

Two inputs are accepted:
- a GGUF file (any llama.cpp type that the `gguf` package can dequantize), read directly;
- a Hugging Face directory (config.json + safetensors + tokenizer), converted to an F32 GGUF first by the
  `convert_hf_to_gguf.py` of the pinned llama.cpp tree, so that tensor names, Q/K permutations and the
  tokenizer metadata are exactly what the patched llama.cpp expects.
"""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
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


@dataclass
class SourceModel:
    path: Path
    arch: str
    metadata: list[KV]
    tensors: dict[str, np.ndarray] = field(repr=False)  # float32, numpy shape = reversed ggml ne
    source_types: dict[str, str] = field(default_factory=dict)
    # what transformers loads to run the model (model.py): its Hugging Face directory or GGUF file; None for
    # a model whose tensors are not a file's (made in memory, or VQ weights decoded)
    hf_source: Path | None = None

    def linear_names(self) -> list[str]:
        """The block linears, in file order: what the quantizer replaces."""
        return [name for name in self.tensors if is_linear(name)]

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


def _float_tensor(path: Path, t) -> np.ndarray:
    try:
        values = dequantize_tensor(t)
    except NotImplementedError as e:
        raise SourceError(f"{path}: cannot dequantize {t.name} of type {t.tensor_type.name}") from e
    if not np.isfinite(values).all():
        bad = int((~np.isfinite(values)).sum())
        raise SourceError(f"{path}: tensor {t.name} has {bad} NaN or infinite values")
    return values


def load_gguf(path: Path) -> SourceModel:
    return _load(path, vq_ok=False)[0]


def load_quantized(path: Path) -> tuple[SourceModel, dict]:
    """A VQ-GGUF file as (model with every weight as float, the VQ weights as VQTensors): what fine-tuning
    starts from and writes back. Side tensors are part of their VQTensor, not of the model."""
    model, vq = _load(path, vq_ok=True)
    if not vq:
        raise SourceError(f"{path}: no VQ tensors")
    return model, vq


def _load(path: Path, vq_ok: bool) -> tuple[SourceModel, dict]:
    from .reference import dequantize as decode_vq
    from .vqtensor import VQTensor
    reader, arch = _reader(path)
    by_name = {t.name: t for t in reader.tensors}
    links = ggml_vq.links(reader.fields)
    tensors, types, vq = {}, {}, {}
    for t in reader.tensors:
        if ggml_vq.is_vq(t.tensor_type):
            if not vq_ok:
                raise SourceError(f"{path}: tensor {t.name} is already VQ-quantized; start from a float or llama.cpp-quantized file")
            try:
                vq[t.name] = VQTensor.from_gguf(t.name, by_name, links)
            except (ValueError, KeyError) as e:
                raise SourceError(f"{path}: {e}") from e
            tensors[t.name] = decode_vq(vq[t.name])
        elif vq_ok and is_side(t.name):
            continue
        else:
            tensors[t.name] = _float_tensor(path, t)
        types[t.name] = t.tensor_type.name
    return SourceModel(path=path, arch=arch, metadata=read_metadata(reader), tensors=tensors, source_types=types,
                       hf_source=None if vq else path), vq


def convert_hf(hf_dir: Path, llama_tree: Path, out: Path) -> Path:
    """Convert a Hugging Face model directory to an F32 GGUF with the pinned tree's converter."""
    script = llama_tree / "convert_hf_to_gguf.py"
    if not script.exists():
        raise SourceError(f"{script} not found: build the patched llama.cpp first (python -m vq_gguf.native.build)")
    with replacing(out, ".gguf") as tmp:
        cmd = [sys.executable, str(script), str(hf_dir), "--outtype", "f32", "--outfile", str(tmp)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SourceError(f"converting {hf_dir} failed:\n{proc.stderr[-4000:]}")
    return out


def load(path: str | Path, *, llama_tree: Path | None = None, cache_dir: Path | None = None) -> SourceModel:
    """Load a GGUF file or a Hugging Face directory as float tensors."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"source model {path} does not exist")
    if path.is_dir():
        if not (path / "config.json").exists():
            raise SourceError(f"{path} is a directory without config.json: not a Hugging Face model")
        if llama_tree is None or cache_dir is None:
            raise SourceError("loading a Hugging Face directory needs the llama.cpp tree and a cache directory")
        gguf_path = cache_dir / f"{path.resolve().name}.f32.gguf"
        if not gguf_path.exists() or gguf_path.stat().st_mtime < (path / "config.json").stat().st_mtime:
            convert_hf(path, llama_tree, gguf_path)
        return dataclasses.replace(load_gguf(gguf_path), hf_source=path)
    return load_gguf(path)
