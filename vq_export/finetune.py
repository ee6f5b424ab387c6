"""End-to-end fine-tuning with the indices fixed: train the codebooks and the RMSNorm weights so that the
quantized model's next-token distribution matches the float model's (KL-divergence on the logits) over the
calibration windows. Resumable: a checkpoint is written atomically every few steps."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from .model import LINEARS, Llama
from .vqtensor import VQTensor


class VQWeight(torch.nn.Module):
    """A VQ weight as a differentiable function of its codebooks (codes, permutation and outliers fixed)."""

    def __init__(self, t: VQTensor):
        super().__init__()
        if t.groups != 1 or t.col_norm is not None or t.row_scale is not None:
            raise ValueError("fine-tuning supports one codebook group without column norm or row scale")
        self.shape = t.shape
        self.v = t.v
        self.register_buffer("codes", torch.from_numpy(t.codes.astype(np.int64)))
        self.C = torch.nn.Parameter(torch.from_numpy(t.codebook[0].astype(np.float32)))
        self.R = None if t.res_codebook is None else torch.nn.Parameter(torch.from_numpy(t.res_codebook[0].astype(np.float32)))
        if t.res_codes is not None:
            self.register_buffer("res_codes", torch.from_numpy(t.res_codes.astype(np.int64)))
        self.perm = None if t.perm is None else torch.from_numpy(t.perm.astype(np.int64))
        self.outliers = None
        if t.outlier_cols is not None:
            self.O = torch.nn.Parameter(torch.from_numpy(t.outlier_codebook.astype(np.float32)))
            self.outliers = (torch.from_numpy(t.outlier_cols.astype(np.int64)), torch.from_numpy(t.outlier_idx.astype(np.int64)))

    def forward(self) -> torch.Tensor:
        out_features, in_features = self.shape
        vals = self.C[self.codes]                                             # [P, in, v]
        if self.R is not None:
            vals = vals + self.R[self.res_codes]
        W = vals.permute(0, 2, 1).reshape(out_features, in_features)          # stored column order
        if self.perm is not None:
            W = torch.empty_like(W).index_copy(1, self.perm, W)
        if self.outliers is not None:
            cols, idx = self.outliers                                         # [n_o], [n_o, out/v0]
            corr = self.O[idx].reshape(len(cols), out_features).T             # [out, n_o]
            W = W.index_add(1, cols, corr)
        return W

    def write_back(self, t: VQTensor) -> None:
        t.codebook = self.C.detach().to(torch.float16).numpy()[None]
        if self.R is not None:
            t.res_codebook = self.R.detach().to(torch.float16).numpy()[None]
        if self.outliers is not None:
            t.outlier_codebook = self.O.detach().to(torch.float16).numpy()


def finetune(src, vq: dict[str, VQTensor], tokens: torch.Tensor, *, steps: int, lr: float = 1e-4,
             batch: int = 2, checkpoint: Path | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    """Train in place: writes the tuned codebooks into `vq`; returns the tuned norm weights by GGUF name."""
    teacher = Llama(src)
    student = Llama(src)
    weights = {name: VQWeight(t) for name, t in vq.items()}
    norms = {}
    for i, blk in enumerate(student.blocks):
        for n in ("attn_norm", "ffn_norm"):
            blk.w[n] = norms[f"blk.{i}.{n}.weight"] = blk.w[n].clone().requires_grad_(True)
        blk.linear = _linear(blk, i, weights)
    student.out_norm = norms["output_norm.weight"] = student.out_norm.clone().requires_grad_(True)
    params = [p for w in weights.values() for p in w.parameters()] + list(norms.values())
    opt = torch.optim.Adam(params, lr=lr)
    start = 0
    if checkpoint is not None and checkpoint.exists():
        state = torch.load(checkpoint)
        with torch.no_grad():
            for p, saved in zip(params, state["params"]):
                p.copy_(saved)
        opt.load_state_dict(state["opt"])
        start = state["step"]
    gen = torch.Generator().manual_seed(seed)
    order = [torch.randperm(tokens.shape[0], generator=gen) for _ in range(steps * batch // tokens.shape[0] + 1)]
    order = torch.cat(order)
    bar = tqdm(range(start, steps), desc="fine-tune (KL to float)", unit="step", dynamic_ncols=True, initial=start, total=steps)
    t0 = time.time()
    for step in bar:
        x = tokens[order[step * batch:(step + 1) * batch]]
        with torch.no_grad():
            target = F.log_softmax(teacher(x), -1)
        logp = F.log_softmax(_forward(student, x), -1)
        loss = F.kl_div(logp, target, log_target=True, reduction="batchmean") / x.shape[1]
        opt.zero_grad()
        loss.backward()
        opt.step()
        bar.set_postfix(kl=f"{loss.item():.4f}")
        if checkpoint is not None and ((step + 1) % 10 == 0 or step + 1 == steps):
            tmp = checkpoint.with_suffix(".tmp")
            torch.save({"params": [p.detach() for p in params], "opt": opt.state_dict(), "step": step + 1}, tmp)
            tmp.replace(checkpoint)
    for name, w in weights.items():
        w.write_back(vq[name])
    print(f"[finetune] {steps - start} steps in {time.time() - t0:.0f} s", flush=True)
    return {n: p.detach().numpy().copy() for n, p in norms.items()}


def _linear(blk, i: int, weights: dict[str, VQWeight]):
    def linear(name: str, x: torch.Tensor) -> torch.Tensor:
        w = weights.get(f"blk.{i}.{name}.weight")
        return x @ (w() if w is not None else blk.w[name]).T
    return linear


def _forward(model: Llama, tokens: torch.Tensor) -> torch.Tensor:
    x = model.embed(tokens)
    for blk in model.blocks:
        x = blk(x)
    return model.logits(x)


def kl_to_float(src, vq: dict[str, VQTensor], tokens: torch.Tensor, batch: int = 2) -> float:
    """Mean per-token KL-divergence of the quantized model (codebooks as they are now) from the float one."""
    teacher, student = Llama(src), Llama(src)
    weights = {name: VQWeight(t) for name, t in vq.items()}
    for i, blk in enumerate(student.blocks):
        blk.linear = _linear(blk, i, weights)
    total = 0.0
    with torch.no_grad():
        for s in range(0, tokens.shape[0], batch):
            x = tokens[s:s + batch]
            total += float(F.kl_div(F.log_softmax(_forward(student, x), -1), F.log_softmax(teacher(x), -1),
                                    log_target=True, reduction="sum"))
    return total / tokens.numel()
