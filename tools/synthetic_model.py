"""A llama GGUF with a real model's shapes and random F16 weights, written without the model: for speed, which
depends on the shapes and the types and not on the values (`tools/bench.py --shape`, llama-quantize, the preset
layouts of `tools/layout_file.py`). Its output is meaningless.

    python -m vq_gguf.tools.synthetic_model llama3-8b --blocks 4 --out llama3-8b-4.gguf
    python -m vq_gguf.tools.synthetic_model --tokenizer-only --out tokenizer.gguf   # for a machine without the default model

The shape's widths, heads, vocabulary and rope base (`tools/shapes.py`), `--blocks` deep, untied output head. The
tokenizer is SmolLM2's (the default model's, or `--tokenizer GGUF`), padded with unused tokens up to the shape's
vocabulary as llama.cpp's converter pads one: text tokenizes as it would for SmolLM2, and every matrix has the real
model's size. Weights are N(0, 0.02) from a seed per tensor (torch's sampler), norms are ones.
"""
from __future__ import annotations

import argparse
import sys
import zlib
from pathlib import Path
from typing import Iterator, Mapping

import numpy as np
from gguf import GGUFReader, GGUFValueType, TokenType

from vq_gguf import gguf_writer
from vq_gguf.source import KV, SourceModel, read_metadata
from vq_gguf.tools.shapes import SHAPES, Shape, block_linears

STD = 0.02      # of the random weights: activations stay finite through a deep model


def tensor_shapes(s: Shape, blocks: int) -> dict[str, tuple[int, ...]]:
    """numpy shapes (out, in) of a llama of shape `s`, in the order llama.cpp's converter writes them."""
    linears = block_linears(s)
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (s.vocab, s.hidden)}
    for b in range(blocks):
        shapes[f"blk.{b}.attn_norm.weight"] = (s.hidden,)
        shapes.update({f"blk.{b}.{kind}.weight": linears[kind] for kind in ("attn_q", "attn_k", "attn_v", "attn_output")})
        shapes[f"blk.{b}.ffn_norm.weight"] = (s.hidden,)
        shapes.update({f"blk.{b}.{kind}.weight": linears[kind] for kind in ("ffn_gate", "ffn_up", "ffn_down")})
    shapes["output_norm.weight"] = (s.hidden,)
    shapes["output.weight"] = (s.vocab, s.hidden)
    return shapes


class RandomTensors(Mapping[str, np.ndarray]):
    """Tensors by name, each made when asked for (a new float32 array each time) from a seed of its name."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], seed: int):
        self.shapes, self.seed = shapes, seed

    def __getitem__(self, name: str) -> np.ndarray:
        shape = self.shapes[name]
        if len(shape) == 1:
            return np.ones(shape, np.float32)
        import torch   # its normal sampler is several times numpy's speed: a 8B model's head is 525 M values
        gen = torch.Generator().manual_seed(self.seed << 32 | zlib.crc32(name.encode()))
        return (torch.randn(shape, generator=gen) * STD).numpy()

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def metadata(name: str, s: Shape, blocks: int, tokenizer: Path) -> list[KV]:
    """The llama keys of shape `s` and the tokenizer keys of the GGUF `tokenizer`, padded to the vocabulary."""
    u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
    kvs = [KV("general.name", f"synthetic {name}, {blocks} blocks, random weights", GGUFValueType.STRING),
           KV("llama.block_count", blocks, u32), KV("llama.context_length", 8192, u32),
           KV("llama.embedding_length", s.hidden, u32), KV("llama.feed_forward_length", s.ffn, u32),
           KV("llama.attention.head_count", s.heads, u32), KV("llama.attention.head_count_kv", s.kv, u32),
           KV("llama.rope.freq_base", s.rope_base, f32), KV("llama.attention.layer_norm_rms_epsilon", 1e-5, f32),
           KV("llama.vocab_size", s.vocab, u32), KV("llama.rope.dimension_count", s.hidden // s.heads, u32)]
    for kv in tokenizer_keys(tokenizer):
        if kv.key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
            n = len(kv.value)
            if n > s.vocab:
                raise ValueError(f"{tokenizer} has {n} tokens, more than {name}'s vocabulary of {s.vocab}")
            pad = ([f"[PAD{i}]" for i in range(n, s.vocab)] if kv.key.endswith("tokens")
                   else [int(TokenType.UNUSED)] * (s.vocab - n))
            kv = KV(kv.key, list(kv.value) + pad, kv.vtype, kv.sub_type)
        kvs.append(kv)
    if not any(kv.key == "tokenizer.ggml.tokens" for kv in kvs):
        raise ValueError(f"{tokenizer} has no tokenizer")
    return kvs


def tokenizer_keys(path: Path) -> list[KV]:
    return [kv for kv in read_metadata(GGUFReader(path)) if kv.key.startswith("tokenizer.")]


def write_tokenizer(src: Path, out: Path) -> Path:
    """The tokenizer keys of the GGUF `src` in a GGUF without tensors (a few MB): what `--tokenizer` needs on a
    machine without the default model (tools/gpu_check.sh carries it)."""
    return gguf_writer.write(out, SourceModel(path=out, arch="llama", metadata=tokenizer_keys(src), tensors={}))


def write(name: str, blocks: int, out: Path, tokenizer: Path, seed: int = 0) -> Path:
    """The synthetic model `name` (a key of SHAPES), `blocks` deep, as an F16 GGUF at `out` (written atomically)."""
    s = SHAPES[name]
    if not 1 <= blocks <= s.blocks:
        raise ValueError(f"{name} has 1 to {s.blocks} blocks, not {blocks}")
    src = SourceModel(path=out, arch="llama", metadata=metadata(name, s, blocks, tokenizer),
                      tensors=RandomTensors(tensor_shapes(s, blocks), seed))
    return gguf_writer.write(out, src, other_type="f16", progress=sys.stderr.isatty())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", nargs="?", choices=SHAPES)
    ap.add_argument("--blocks", type=int, default=2, help="depth (default 2)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path, default=None, help="a GGUF whose tokenizer to take (default: the default model's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer-only", action="store_true", help="write only --tokenizer's tokenizer to --out (no tensors)")
    args = ap.parse_args(argv)
    if args.tokenizer is None:
        from vq_gguf import default_model
        from vq_gguf.paths import home
        args.tokenizer = default_model.fetch(home())
    if args.tokenizer_only:
        write_tokenizer(args.tokenizer, args.out)
    elif args.shape:
        write(args.shape, args.blocks, args.out, args.tokenizer, args.seed)
    else:
        ap.error("a shape, or --tokenizer-only")
    print(args.out)


if __name__ == "__main__":
    main()
