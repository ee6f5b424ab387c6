"""VPTQ for one linear layer: Hessian-weighted k-means codebooks, then channel-independent second-order
assignment (GPTQ's column-by-column error feedback, where a column's vectors are v output channels), residual
and outlier codebooks, and a closed-form refit of the codebooks to the layer's output error.

W is [out, in], H = XᵀX over the layer's calibration inputs [in, in]. The loss everything minimises is the
layer-output error ‖(W − Ŵ)Xᵀ‖² = tr((W − Ŵ) H (W − Ŵ)ᵀ).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .kmeans import kmeans, nearest
from .vqtensor import VQTensor


@dataclass(frozen=True)
class VPTQConfig:
    v: int                       # vector length (output channels per vector)
    k: int                       # main codebook size
    k_res: int = 0               # residual codebook size (0: none)
    outlier_frac: float = 0.0    # share of input columns (largest Hessian diagonal) with an outlier codebook
    v0: int = 4                  # outlier vector length
    k0: int = 256                # outlier codebook size
    act_order: bool = True       # columns in descending diag(H) order
    damp: float = 0.01           # added to diag(H), relative to its mean
    block: int = 128             # columns per lazy-update block
    kmeans_iters: int = 30
    refit_rounds: int = 2        # codebook refit + re-assignment rounds (0: the paper's fixed k-means codebook)
    seed: int = 0

    @property
    def index_bits(self) -> int:
        return _log2(self.k) + (_log2(self.k_res) if self.k_res else 0)


def _log2(k: int) -> int:
    b = int(k).bit_length() - 1
    if k < 2 or (1 << b) != k or b > 16:
        raise ValueError(f"codebook size {k} is not a power of two in [2, 65536]")
    return b


def f16(x: torch.Tensor) -> torch.Tensor:
    """Round to the F16 values the file will hold."""
    return x.to(torch.float16).to(torch.float32)


def proxy_loss(W: torch.Tensor, Wq: torch.Tensor, H: torch.Tensor) -> float:
    """tr((W − Ŵ) H (W − Ŵ)ᵀ): the layer's output error summed over the calibration tokens."""
    D = (W - Wq).to(torch.float64)
    return float(((D @ H.to(torch.float64)) * D).sum())


class VPTQ:
    """Quantizes one weight. Usage: VPTQ(W, H, cfg).quantize() -> VQTensor."""

    def __init__(self, W: np.ndarray | torch.Tensor, H: np.ndarray | torch.Tensor, cfg: VPTQConfig):
        self.W = torch.as_tensor(W, dtype=torch.float32).clone()
        self.H = torch.as_tensor(H, dtype=torch.float64).clone()
        self.cfg = cfg
        out_features, in_features = self.W.shape
        if out_features % cfg.v or (cfg.outlier_frac and out_features % cfg.v0):
            raise ValueError(f"vector lengths {cfg.v}/{cfg.v0} do not divide {out_features} output channels")
        self.P = out_features // cfg.v

    # --- Hessian preparation ------------------------------------------------------------------------

    def _prepare(self) -> None:
        H, W = self.H, self.W
        dead = torch.diag(H) == 0
        H[dead, dead] = 1
        W[:, dead] = 0
        self.diag = torch.diag(H).clone()
        H = H + self.cfg.damp * self.diag.mean() * torch.eye(H.shape[0], dtype=H.dtype)  # self.H stays undamped
        self.perm = torch.argsort(self.diag, descending=True) if self.cfg.act_order else torch.arange(H.shape[0])
        L = torch.linalg.cholesky(H[self.perm][:, self.perm])
        self.U = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True).to(torch.float32)  # upper factor of H⁻¹
        self.Hp = self.H[self.perm][:, self.perm]                    # undamped: the loss the refit minimises

    # --- codebooks ----------------------------------------------------------------------------------

    def _vectors(self, Wp: torch.Tensor, v: int) -> torch.Tensor:
        """[out, n] -> [n*P, v], vector (column j, vector row p) at row j*P + p."""
        return Wp.T.reshape(-1, v)

    def _column_weights(self, v: int, n_cols: int, P: int) -> torch.Tensor:
        return self.diag[self.perm][:n_cols].repeat_interleave(P).to(torch.float32)

    # --- the second-order assignment loop -----------------------------------------------------------

    def _assign(self, C: torch.Tensor, R: torch.Tensor | None, O: torch.Tensor | None, n_out: int):
        """GPTQ-style pass over the permuted columns. Returns codes [P, in], residual codes, outlier codes
        [n_out, out/v0] and the quantized permuted weight, and the error-compensated targets."""
        cfg, P, v = self.cfg, self.P, self.cfg.v
        Wp = self.W[:, self.perm].clone()
        n = Wp.shape[1]
        Q = torch.zeros_like(Wp)
        target = torch.zeros_like(Wp)
        codes = torch.zeros(P, n, dtype=torch.long)
        rcodes = torch.zeros(P, n, dtype=torch.long) if R is not None else None
        ocodes = torch.zeros(n_out, Wp.shape[0] // cfg.v0, dtype=torch.long) if O is not None else None
        U = self.U
        for i1 in range(0, n, cfg.block):
            i2 = min(i1 + cfg.block, n)
            W1 = Wp[:, i1:i2].clone()
            E1 = torch.zeros_like(W1)
            for j in range(i2 - i1):
                col = i1 + j
                w = W1[:, j]
                target[:, col] = w
                x = w.view(P, v)
                c, _ = nearest(x, C)
                q = C[c]
                codes[:, col] = c
                if R is not None:
                    r, _ = nearest(x - q, R)
                    q = q + R[r]
                    rcodes[:, col] = r
                q = q.reshape(-1)
                if O is not None and col < n_out:
                    o, _ = nearest((w - q).view(-1, cfg.v0), O)
                    q = q + O[o].reshape(-1)
                    ocodes[col] = o
                Q[:, col] = q
                e = (w - q) / U[col, col]
                W1[:, j:] -= e[:, None] * U[col, col:i2][None, :]
                E1[:, j] = e
            Wp[:, i2:] -= E1 @ U[i1:i2, i2:]
        return codes, rcodes, ocodes, Q, target

    # --- codebook refit with the assignment fixed ---------------------------------------------------

    def _refit(self, codes: torch.Tensor, rcodes: torch.Tensor | None, C: torch.Tensor, R: torch.Tensor | None,
               Qout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Codebooks minimising tr((W − Ŵ) H (W − Ŵ)ᵀ) for fixed codes, in closed form.

        Ŵ is linear in the stacked codebook Z = [C; R] (K rows, v lanes): Ŵ[p·v+e, j] = Z[a(p, j), e] + Z[b(p, j), e].
        With A_p the one-hot of row p's codes ([n, K]), the normal equations are (Σ_p A_pᵀ H A_p) Z = Σ_p A_pᵀ H Wᵀ_p,
        the same K×K matrix for every lane. Unused entries are held at their old value by a small ridge.
        """
        v, P = self.cfg.v, self.P
        H = self.Hp.to(torch.float32)
        K1 = C.shape[0]
        Z0 = torch.cat([C, R]) if R is not None else C
        K = Z0.shape[0]
        idx = [codes] + ([rcodes + K1] if rcodes is not None else [])
        Wp = self.W[:, self.perm] - Qout                                # what the codebooks must represent
        HW = Wp @ H                                                     # [out, n]
        M = torch.zeros(K, K)
        B = torch.zeros(K, v)
        n = H.shape[0]
        for p in range(P):
            AtH = torch.zeros(K, n)                                     # A_pᵀ H, by rows (H is symmetric)
            for a in idx:
                AtH.index_add_(0, a[p], H)
                B.index_add_(0, a[p], HW[p * v:(p + 1) * v].T)
            for a in idx:
                M.index_add_(1, a[p], AtH)                              # (A_pᵀ H) A_p
        M, B = M.to(torch.float64), B.to(torch.float64)
        lam = 1e-6 * float(torch.diag(M).mean()) + 1e-12
        Z = torch.linalg.solve(M + lam * torch.eye(K, dtype=M.dtype), B + lam * Z0.to(torch.float64))
        Z = f16(Z.to(torch.float32))
        return (Z[:K1], Z[K1:]) if R is not None else (Z, None)

    # --- driver -------------------------------------------------------------------------------------

    def quantize(self) -> VQTensor:
        # thousands of small ops: one thread is faster than two that must meet at every op, and much faster
        # when other processes hold the cores
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return self._quantize()
        finally:
            torch.set_num_threads(threads)

    def _quantize(self) -> VQTensor:
        cfg, P, v = self.cfg, self.P, self.cfg.v
        out_features, in_features = self.W.shape
        self._prepare()
        Wp = self.W[:, self.perm]
        n_out = int(round(cfg.outlier_frac * in_features))

        weights = self._column_weights(v, in_features, P)
        C = f16(kmeans(self._vectors(Wp, v), cfg.k, weights, iters=cfg.kmeans_iters, seed=cfg.seed)[0])
        R = O = None
        if n_out:
            first = C[nearest(self._vectors(Wp, v), C)[0]].reshape(in_features, out_features).T
            err = (Wp - first)[:, :n_out]
            O = f16(kmeans(self._vectors(err, cfg.v0), cfg.k0, self._column_weights(cfg.v0, n_out, out_features // cfg.v0),
                           iters=cfg.kmeans_iters, seed=cfg.seed + 2)[0])
        codes, rcodes, ocodes, Q, target = self._assign(C, None, O, n_out)
        if cfg.k_res:
            R = f16(kmeans(self._vectors(target - Q, v), cfg.k_res, weights, iters=cfg.kmeans_iters, seed=cfg.seed + 1)[0])
            codes, rcodes, ocodes, Q, target = self._assign(C, R, O, n_out)
        for _ in range(cfg.refit_rounds):
            Qout = self._outlier_part(ocodes, O, n_out)
            C, R = self._refit(codes, rcodes, C, R, Qout)
            codes, rcodes, ocodes, Q, target = self._assign(C, R, O, n_out)
        self.loss = proxy_loss(self.W, self._unpermute(Q), self.H)
        return self._tensor(codes, rcodes, ocodes, C, R, O, n_out)

    def _outlier_part(self, ocodes, O, n_out) -> torch.Tensor:
        """The outlier codebook's contribution to the permuted weight (zero without outliers)."""
        out = torch.zeros_like(self.W)
        if O is not None:
            out[:, :n_out] = O[ocodes].reshape(n_out, -1).T
        return out

    def _unpermute(self, Qp: torch.Tensor) -> torch.Tensor:
        Q = torch.empty_like(Qp)
        Q[:, self.perm] = Qp
        return Q

    def _tensor(self, codes, rcodes, ocodes, C, R, O, n_out) -> VQTensor:
        """Store the codes in the original column order (the permutation is absorbed: one codebook group)."""
        inv = torch.argsort(self.perm)
        t = VQTensor(shape=tuple(self.W.shape), codes=codes[:, inv].numpy().astype(np.uint32),
                     codebook=C.to(torch.float16).numpy()[None])
        if R is not None:
            t.res_codes = rcodes[:, inv].numpy().astype(np.uint32)
            t.res_codebook = R.to(torch.float16).numpy()[None]
        if O is not None:
            t.outlier_cols = self.perm[:n_out].numpy().astype(np.int32)
            t.outlier_idx = ocodes.numpy().astype(np.int16)
            t.outlier_codebook = O.to(torch.float16).numpy()
        return t
