"""Bits per weight counted from a GGUF file (docs/format.md §7): every byte of a weight and of its side
tensors, codebooks included, over the weight's logical number of elements."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from gguf import GGUFReader

from . import ggml_vq
from .names import is_linear


@dataclass
class TensorBits:
    name: str
    type: str
    shape: tuple[int, ...]
    elements: int
    bytes: float               # the tensor itself plus, for a VQ weight, all its side tensors (its share of shared ones)
    side_bytes: float = 0

    @property
    def bpw(self) -> float:
        return 8 * self.bytes / self.elements


@dataclass
class FileBits:
    path: Path
    file_bytes: int
    tensors: list[TensorBits] = field(default_factory=list)

    def linears(self) -> list[TensorBits]:
        return [t for t in self.tensors if is_linear(t.name)]

    @staticmethod
    def _bpw(ts: list[TensorBits]) -> float:
        n = sum(t.elements for t in ts)
        return 8 * sum(t.bytes for t in ts) / n if n else float("nan")

    @property
    def linear_bpw(self) -> float:
        return self._bpw(self.linears())

    @property
    def params(self) -> int:
        return sum(t.elements for t in self.tensors)

    @property
    def file_bpw(self) -> float:
        """Whole file (header and metadata included) over all parameters."""
        return 8 * self.file_bytes / self.params

    def linear_types(self) -> dict[str, float]:
        """Share of block-linear parameters per type."""
        count: Counter[str] = Counter()
        for t in self.linears():
            count[t.type] += t.elements
        total = sum(count.values())
        return {k: v / total for k, v in count.most_common()}


def count(path: str | Path) -> FileBits:
    path = Path(path)
    reader = GGUFReader(path)
    by_name = {t.name: t for t in reader.tensors}
    links = ggml_vq.links(reader.fields)
    sides = {t.name: [links.get(s, s) for s in (ggml_vq.side_name(t.name, x) for x in ggml_vq.SIDES)]
             for t in reader.tensors if ggml_vq.is_vq(t.tensor_type)}
    users = Counter(s for names in sides.values() for s in names)   # a shared side's bytes are split among its users
    bits = FileBits(path=path, file_bytes=path.stat().st_size)
    for t in reader.tensors:
        if t.name in users:
            continue
        side = 0
        type_name = t.tensor_type.name.lower()
        if t.name in sides:
            side = sum(int(by_name[s].n_bytes) / users[s] for s in sides[t.name] if s in by_name)
        bits.tensors.append(TensorBits(name=t.name, type=type_name, shape=tuple(int(x) for x in t.shape),
                                       elements=int(t.n_elements), bytes=int(t.n_bytes) + side, side_bytes=side))
    return bits


def describe(path: Path) -> str:
    """What a file holds, in three lines: size and parameters, bits per weight of the block linears and of the file."""
    bits = count(path)
    types = ", ".join(f"{t} {share:.0%}" for t, share in bits.linear_types().items())
    return (f"{path}\n  file size {bits.file_bytes / 2**20:.1f} MiB, {bits.params / 1e6:.1f}M parameters"
            f"\n  block linears: {bits.linear_bpw:.3f} bits per weight (codebooks and side tensors included; {types})"
            f"\n  whole file:    {bits.file_bpw:.3f} bits per weight")
