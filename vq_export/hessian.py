"""Hessians H = XᵀX of a block's linear inputs, from calibration activations, one block at a time.

Linears that read the same input share one Hessian (q/k/v read the attention norm's output, gate/up the FFN
norm's). Each mini-batch's product in float32 (4096 tokens: relative error ~1e-7, at half the time of float64),
summed in float64, so memory is one block's activations plus four small matrices, never the whole model's
Hessians. The few held-out windows that score the result keep their inputs instead (`inputs`): at a wide
input (14336 for Llama-3-8B's ffn_down) a Hessian is 1.6 GB, a few thousand tokens of inputs far less.
"""
from __future__ import annotations

from typing import Callable

import torch

from .model import Block

# which Hessian each linear uses
INPUT_OF = {"attn_q": "attn_in", "attn_k": "attn_in", "attn_v": "attn_in", "attn_qkv": "attn_in", "attn_output": "attn_output",
            "ffn_gate": "ffn_in", "ffn_up": "ffn_in", "ffn_down": "ffn_down"}


def _each_input(block: Block, x: torch.Tensor, batch: int, use: Callable[[str, torch.Tensor], None]) -> None:
    """Run x [N, L, d] through the block `batch` windows at a time, calling use(input name, X [tokens, d_in])
    once per distinct linear input and batch."""
    seen: set[str] = set()
    original = block.linear

    def record(name: str, inp: torch.Tensor) -> torch.Tensor:
        key = INPUT_OF[name]
        if key not in seen:  # q, k and v see the same tensor: count it once per forward
            seen.add(key)
            use(key, inp.reshape(-1, inp.shape[-1]))
        return original(name, inp)

    block.linear = record
    try:
        with torch.no_grad():
            for s in range(0, x.shape[0], batch):
                seen.clear()
                block(x[s : s + batch])
    finally:
        del block.linear


def collect(block: Block, x: torch.Tensor, batch: int = 8) -> tuple[dict[str, torch.Tensor], int]:
    """XᵀX for every distinct linear input of the block over x [N, L, d].
    Returns ({input name: H}, number of tokens)."""
    H: dict[str, torch.Tensor] = {}

    def add(key: str, flat: torch.Tensor) -> None:
        XtX = flat.T @ flat
        if key in H:
            H[key].add_(XtX)            # in place, promoted to float64: no float64 copy of the product
        else:
            H[key] = XtX.to(torch.float64)

    _each_input(block, x, batch, add)
    return H, x.shape[0] * x.shape[1]


def inputs(block: Block, x: torch.Tensor, batch: int = 8) -> dict[str, torch.Tensor]:
    """Every distinct linear input of the block over x [N, L, d], as {input name: X [N·L, d_in]}."""
    got: dict[str, list[torch.Tensor]] = {}
    _each_input(block, x, batch, lambda key, flat: got.setdefault(key, []).append(flat))
    return {key: torch.cat(parts) for key, parts in got.items()}
