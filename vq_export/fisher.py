"""Output-channel weights from the end loss, for VPTQ's layer loss.

VPTQ minimises tr(ΔW H ΔWᵀ) = Σ_o ‖ΔW_o X‖²: every output channel of a linear counts alike. But the rest of
the network amplifies some channels far more than others (a residual-stream channel that the next norms scale
up, a gate that opens often). With g_o = E[(∂ℓ/∂y_o)²], the mean squared gradient of the next-token
cross-entropy ℓ of the float model with respect to output o of the linear over calibration tokens, the loss
Σ_o g_o ‖ΔW_o X‖² is the second-order change of ℓ under a diagonal Fisher of the outputs (as GuidedQuant,
Kim et al. 2025, for scalar and trellis quantizers). The weights enter VPTQ as lane weights of every distance,
k-means and refit; the error feedback of one row does not depend on its weight, so the second-order pass is
unchanged.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from .model import Model


def channel_fisher(model: Model, tokens: torch.Tensor, names: list[str]) -> dict[str, torch.Tensor]:
    """{name: g [out]} for the block linears `names` (blk.N.KIND.weight), each normalised to mean 1, from the
    windows `tokens` [N, L] (one forward and backward pass of the model per window)."""
    acc: dict[str, torch.Tensor] = {}
    wanted = set(names)

    def observe(i: int, blk):
        def linear(short: str, x: torch.Tensor) -> torch.Tensor:
            y = x @ blk.w[short].T
            key = f"blk.{i}.{short}.weight"
            if key in wanted:
                y.register_hook(lambda g: acc.__setitem__(key, acc.get(key, 0) + g.double().pow(2).sum((0, 1))))
            return y
        return linear

    for i, blk in enumerate(model.blocks):
        blk.linear = observe(i, blk)
    start = time.time()
    try:
        for s in range(len(tokens)):
            t = tokens[s : s + 1]
            logits = model.logits_of(model.final_hidden_of(model.embed(t).requires_grad_()))
            F.cross_entropy(logits[0, :-1], t[0, 1:].to(logits.device), reduction="sum").backward()
            done = s + 1
            eta = (time.time() - start) / done * (len(tokens) - done)
            print(f"\r[fisher] window {done}/{len(tokens)}, ETA {eta:.0f} s", end="", flush=True)
        print(flush=True)
    finally:
        for blk in model.blocks:
            del blk.linear
    missing = wanted - acc.keys()
    if missing:
        raise ValueError(f"no gradient reached {sorted(missing)[:3]}")
    return {n: (g / g.mean()).to(torch.float32) for n, g in acc.items()}
