"""A llama-family forward pass in torch over the GGUF tensors, for calibration (Hessians, fine-tuning).

It reads the weights exactly as llama.cpp does: GGUF names, Q/K rows in llama.cpp's order, RoPE on adjacent
pairs (LLAMA_ROPE_TYPE_NORM), grouped-query attention, SwiGLU, RMSNorm. A test holds its logits against the
patched llama.cpp's on the same tokens, so the Hessians are those of the model llama.cpp runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .names import LINEAR_KINDS
from .source import SourceModel



@dataclass
class Hyper:
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    eps: float
    rope_base: float

    @classmethod
    def of(cls, src: SourceModel) -> "Hyper":
        kv = {m.key: m.value for m in src.metadata}
        a = src.arch
        n_embd = kv[f"{a}.embedding_length"]
        n_head = kv[f"{a}.attention.head_count"]
        return cls(n_layer=kv[f"{a}.block_count"], n_head=n_head, n_head_kv=kv.get(f"{a}.attention.head_count_kv", n_head),
                   head_dim=kv.get(f"{a}.rope.dimension_count", n_embd // n_head),
                   eps=kv.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-5), rope_base=kv.get(f"{a}.rope.freq_base", 10000.0))


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, base: float) -> torch.Tensor:
    """x [batch, heads, seq, dim]: rotate adjacent pairs (x[2i], x[2i+1]) by pos * base^(-2i/dim)."""
    seq, dim = x.shape[-2], x.shape[-1]
    inv = base ** (-torch.arange(0, dim, 2, dtype=torch.float32, device=x.device) / dim)
    ang = torch.arange(seq, dtype=torch.float32, device=x.device)[:, None] * inv[None, :]
    cos, sin = ang.cos(), ang.sin()
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)


class Block:
    """One transformer block; `weights` maps the linear names (attn_q, ...) and norms to tensors, and
    `linear` can be swapped to observe or replace each matmul."""

    def __init__(self, hp: Hyper, weights: dict[str, torch.Tensor]):
        self.hp, self.w = hp, weights

    def linear(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w[name].T

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        hp = self.hp
        b, t, _ = x.shape
        h = rms_norm(x, self.w["attn_norm"], hp.eps)
        q = self.linear("attn_q", h).view(b, t, hp.n_head, hp.head_dim).transpose(1, 2)
        k = self.linear("attn_k", h).view(b, t, hp.n_head_kv, hp.head_dim).transpose(1, 2)
        v = self.linear("attn_v", h).view(b, t, hp.n_head_kv, hp.head_dim).transpose(1, 2)
        q, k = rope(q, hp.rope_base), rope(k, hp.rope_base)
        rep = hp.n_head // hp.n_head_kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + self.linear("attn_output", a)
        h = rms_norm(x, self.w["ffn_norm"], hp.eps)
        return x + self.linear("ffn_down", F.silu(self.linear("ffn_gate", h)) * self.linear("ffn_up", h))


class Llama:
    """The whole model. A block linear missing from `src` is one a swapped `Block.linear` supplies (fine-tuning's
    VQ weights); reading it otherwise is a KeyError."""

    def __init__(self, src: SourceModel, device: str | torch.device = "cpu"):
        self.hp = Hyper.of(src)
        t = {k: torch.from_numpy(v).to(device) for k, v in src.tensors.items()}
        self.tok_embd = t["token_embd.weight"]
        self.out_norm = t["output_norm.weight"]
        self.head = t.get("output.weight", self.tok_embd)
        self.blocks = []
        for i in range(self.hp.n_layer):
            names = {n: f"blk.{i}.{n}.weight" for n in (*LINEAR_KINDS, "attn_norm", "ffn_norm")}
            self.blocks.append(Block(self.hp, {n: t[full] for n, full in names.items() if full in t}))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok_embd[tokens]

    def final_hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """The output norm's result: what the head multiplies (logits = final_hidden @ head.T)."""
        return self.final_hidden_of(self.embed(tokens))

    def final_hidden_of(self, x: torch.Tensor) -> torch.Tensor:
        """final_hidden from the token embeddings x [N, L, d] (which may require grad, to reach every linear)."""
        for blk in self.blocks:
            x = blk(x)
        return rms_norm(x, self.out_norm, self.hp.eps)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.final_hidden(tokens) @ self.head.T

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.forward(tokens)
