"""Tensor names of llama.cpp's GGUF files that the quantizer acts on, in one place (as gguf-py's constants.py):
the block linears (blk.N.KIND.weight), their kinds and blocks, and the side tensors of a VQ weight."""
from __future__ import annotations

import re

from .ggml_vq import SIDES

# the linears of a block, in the order llama.cpp's graph uses them; attn_qkv is q, k and v in one tensor
# (Phi-3), and an ffn_up without ffn_gate may hold gate and up rows together (Phi-3's gate_up_proj)
LINEAR_KINDS = ("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
LINEAR_RE = re.compile(r"^blk\.(\d+)\.(" + "|".join(LINEAR_KINDS) + r")\.weight$")


def linear(block: int, kind: str) -> str:
    return f"blk.{block}.{kind}.weight"


def is_linear(name: str) -> bool:
    return LINEAR_RE.match(name) is not None


def parse_linear(name: str) -> tuple[int, str]:
    """(block, kind) of a block linear's name, with or without its ".weight" (blk.3.ffn_down, as the tools take
    it on the command line); ValueError for any other name."""
    m = LINEAR_RE.match(name if name.endswith(".weight") else name + ".weight")
    if m is None:
        raise ValueError(f"{name!r} is not a block linear (blk.N.KIND.weight, KIND one of {', '.join(LINEAR_KINDS)})")
    return int(m[1]), m[2]


def block_of(name: str) -> int:
    return parse_linear(name)[0]


def kind_of(name: str) -> str:
    return parse_linear(name)[1]


def is_side(name: str) -> bool:
    """Whether `name` is a side tensor of a VQ weight (blk.0.ffn_down.vq_codebook, vq_shared.ffn_down.vq_codebook)."""
    return name.rsplit(".", 1)[-1] in SIDES
