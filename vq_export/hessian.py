"""Hessians H = XᵀX of a block's linear inputs, from calibration activations, one block at a time.

Linears that read the same input share one Hessian (q/k/v read the attention norm's output, gate/up the FFN
norm's). Each mini-batch's product in float32 (4096 tokens: relative error ~1e-7, at half the time of float64),
summed in float64, so memory is one block's activations plus four small matrices, never the whole model's
Hessians.
"""
from __future__ import annotations

import torch

from .model import Block

# which Hessian each linear uses
INPUT_OF = {"attn_q": "attn_in", "attn_k": "attn_in", "attn_v": "attn_in", "attn_qkv": "attn_in", "attn_output": "attn_output",
            "ffn_gate": "ffn_in", "ffn_up": "ffn_in", "ffn_down": "ffn_down"}


def collect(block: Block, x: torch.Tensor, batch: int = 8) -> tuple[dict[str, torch.Tensor], int]:
    """Run x [N, L, d] through the block, accumulating XᵀX for every distinct linear input.
    Returns ({input name: H}, number of tokens)."""
    H: dict[str, torch.Tensor] = {}
    seen: set[str] = set()
    original = block.linear

    def record(name: str, inp: torch.Tensor) -> torch.Tensor:
        key = INPUT_OF[name]
        if key not in seen:  # q, k and v see the same tensor: count it once per forward
            seen.add(key)
            flat = inp.reshape(-1, inp.shape[-1])
            H[key] = H.get(key, 0) + (flat.T @ flat).to(torch.float64)
        return original(name, inp)

    block.linear = record
    try:
        with torch.no_grad():
            for s in range(0, x.shape[0], batch):
                seen.clear()
                block(x[s : s + batch])
    finally:
        del block.linear
    return H, x.shape[0] * x.shape[1]
