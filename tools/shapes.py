"""Shapes of real models, for the tools that measure them without the models (`quant_cost --shapes`,
`synthetic_model`)."""
from __future__ import annotations

from typing import NamedTuple


class Shape(NamedTuple):
    hidden: int
    ffn: int
    heads: int     # query heads
    kv: int        # key-value heads
    blocks: int
    vocab: int
    rope_base: float


SHAPES = {"smollm2-135m": Shape(576, 1536, 9, 3, 30, 49152, 100000.0),
          "llama3-8b": Shape(4096, 14336, 32, 8, 32, 128256, 500000.0),
          "llama3-70b": Shape(8192, 28672, 64, 8, 80, 128256, 500000.0)}


def block_linears(s: Shape) -> dict[str, tuple[int, int]]:
    """{kind: (out, in)} of one block of shape `s`."""
    head = s.hidden // s.heads
    return {"attn_q": (s.heads * head, s.hidden), "attn_k": (s.kv * head, s.hidden), "attn_v": (s.kv * head, s.hidden),
            "attn_output": (s.hidden, s.heads * head), "ffn_gate": (s.ffn, s.hidden), "ffn_up": (s.ffn, s.hidden),
            "ffn_down": (s.hidden, s.ffn)}
