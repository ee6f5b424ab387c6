"""VPTQ for one linear layer: Hessian-weighted k-means codebooks, then channel-independent second-order
assignment (GPTQ's column-by-column error feedback, where a column's vectors are v output channels), residual
and outlier codebooks, and a closed-form refit of the codebooks to the layer's output error.

W is [out, in], H = XᵀX over the layer's calibration inputs [in, in]. The loss everything minimises is the
layer-output error ‖(W − Ŵ)Xᵀ‖² = tr((W − Ŵ) H (W − Ŵ)ᵀ).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from .config import VQConfig
from .distributed import Ranks
from .kmeans import TAIL_POINTS, centroid_terms, kmeans, nearest, nearest_in
from .vqtensor import VQTensor, split_tail, to_vectors


def f16(x: torch.Tensor) -> torch.Tensor:
    """Round to the F16 values the file will hold."""
    return x.to(torch.float16).to(torch.float32)


def proxy_loss(W: torch.Tensor, Wq: torch.Tensor, H: torch.Tensor) -> float:
    """tr((W − Ŵ) H (W − Ŵ)ᵀ): the layer's output error summed over the calibration tokens."""
    D = (W - Wq).to(torch.float64)
    return float(((D @ H.to(torch.float64)) * D).sum())


def output_error(W: torch.Tensor, Wq: torch.Tensor, X: torch.Tensor) -> float:
    """‖(W − Ŵ)Xᵀ‖² / ‖WXᵀ‖²: the output error relative to the output, from the inputs X [tokens, in]
    themselves (few tokens: cheaper than their Hessian)."""
    def sq(D: torch.Tensor) -> float:
        return float((D @ X.T).to(torch.float64).pow(2).sum())
    return sq(W - torch.as_tensor(Wq, device=W.device)) / sq(W)


class VPTQ:
    """Quantizes one weight. Usage: VPTQ(W, H, cfg).quantize() -> VQTensor. The constructor normalizes W and
    factors H; it keeps no reference to H, so a caller that passes its last one frees it then.

    With col_norm / row_scale the codebooks quantize Wn, where W = u ⊙rows (Wn ⊙cols s + t) (format.md §5).
    The column scaling moves into the Hessian (H' = S H S) and the row scale into lane weights u² of every
    distance, k-means and refit, so each step still minimises the true output error.

    Where v does not divide the outputs, the last out % v rows are the weight's tail, kept in F16 (format.md §3):
    rows do not interact in the loss, so everything here works on the rows above it (W0) and loses nothing.

    Everything runs on `device` (W, H and every matrix made from them; the codes and codebooks come back to
    the CPU in the VQTensor). On a GPU the same steps give the same file up to the order in which sums are
    rounded, which can tip a code between two nearly equidistant centroids (docs/quantizer.md, "Devices").
    """

    def __init__(self, W: np.ndarray | torch.Tensor, H: np.ndarray | torch.Tensor, cfg: VQConfig,
                 codebook: torch.Tensor | None = None, channel_weight: torch.Tensor | None = None,
                 device: str | torch.device = "cpu"):
        """`codebook` [1, k, v]: a fixed main codebook (one several weights share, see shared_codebook): no
        k-means and no refit of it here. `channel_weight` [out]: g_o, the weight of output channel o's error in
        the loss Σ_o g_o ‖ΔW_o X‖² (fisher.py; None: all 1, the paper's loss)."""
        self.device = dev = torch.device(device)
        W = torch.as_tensor(W, dtype=torch.float32, device=dev)          # on the CPU, not a copy: never written
        self.cfg = cfg
        self.codebook = None if codebook is None else codebook.to(dev)
        self.g = None if channel_weight is None else torch.as_tensor(channel_weight, dtype=torch.float32, device=dev)
        if self.g is not None and (self.g.shape != (W.shape[0],) or not torch.isfinite(self.g).all() or (self.g < 0).any()):
            raise ValueError(f"channel weights must be {W.shape[0]} finite values ≥ 0")
        if not cfg.fits(*W.shape):
            raise ValueError(f"v = {cfg.v} (outliers: v0 = {cfg.v0}) does not fit a weight of {W.shape[0]} output "
                             f"channels and {W.shape[1]} input columns")
        self.W0, self.tail = split_tail(W, cfg.v)
        self.g = None if self.g is None else self.g[:self.W0.shape[0]]
        if codebook is not None and (cfg.k_res or cfg.outlier_frac or cfg.groups != 1 or codebook.shape != (1, cfg.k, cfg.v)):
            raise ValueError(f"a shared codebook {tuple(codebook.shape)} needs one group of [{cfg.k}, {cfg.v}] "
                             "without residual or outlier codebooks")
        out_features, in_features = self.W0.shape
        if in_features % cfg.groups:
            raise ValueError(f"{cfg.groups} column groups do not divide {in_features} input columns")
        self.P = out_features // cfg.v
        self.group = torch.arange(in_features, device=dev) // (in_features // cfg.groups)   # per original column
        self._prepare(torch.as_tensor(H, dtype=torch.float64, device=dev))

    # --- normalization and Hessian preparation ------------------------------------------------------

    def _prepare(self, H: torch.Tensor) -> None:
        cfg = self.cfg
        W = self.W0.clone()
        diag = torch.diag(H).clone()
        dead = diag == 0                                             # inputs that are always zero
        diag[dead] = 1
        W[:, dead] = 0
        self.u = self.s = self.t = self.lanes = None
        if cfg.row_scale:
            self.u = W.pow(2).mean(1).sqrt().half().float()           # the F16 value the file stores
            self.u[self.u == 0] = 1
            W = W / self.u[:, None]
            self.lanes = self.u ** 2                                 # [out]: the weight of each row's error
        if self.g is not None:
            self.lanes = self.g if self.lanes is None else self.lanes * self.g
        if cfg.col_norm:
            self.t = W.mean(0)
            self.s = W.std(0, unbiased=False)
            self.s[self.s == 0] = 1
            W = (W - self.t) / self.s
            diag = diag * (self.s.double() * self.s.double())        # H' = S H S
        self.W, self.diag = W, diag
        self.perm = torch.argsort(diag, descending=True) if cfg.act_order else torch.arange(len(diag), device=self.device)
        # At in = 14336 one float64 Hessian is 1.6 GB: beside the caller's, one copy is factored in place and
        # freed before the refit's float32 one is made.
        Hp = self._permuted(H, dead, torch.float64)
        Hp.diagonal().add_(cfg.damp * diag.mean())
        F = Hp.mT                                                    # column-major, as LAPACK factors in place
        torch.linalg.cholesky(F, out=F)                              # H = LLᵀ
        torch.cholesky_inverse(F, out=F)                             # H⁻¹
        torch.linalg.cholesky(F, out=F)                              # H⁻¹ = MMᵀ, so Hp (= Fᵀ) holds Mᵀ
        self.U = Hp.to(torch.float32)                                # upper factor of H⁻¹
        del Hp, F
        self.Hp = self._permuted(H, dead, torch.float32)             # undamped: the loss the refit minimises
        self.gp = self.group[self.perm]                              # group of each permuted column
        # an outlier codebook value o stands for o / s_j in Wn's terms
        self.ounit = (1 / self.s[self.perm]) if self.s is not None else torch.ones(len(self.perm), device=self.device)

    def _permuted(self, H: torch.Tensor, dead: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """H' = S H S in the order perm, the dead inputs' diagonal 1, in `dtype`: computed in float64 and
        rounded 1024 rows at a time, so a float32 copy is made without a float64 one."""
        n, step = len(self.perm), 1024
        out = torch.empty(n, n, dtype=dtype, device=self.device)
        sp = None if self.s is None else self.s.double()[self.perm]
        dead_p = dead[self.perm]
        for r in range(0, n, step):
            rows = H[self.perm[r:r + step, None], self.perm]
            d = dead_p[r:r + step].nonzero().flatten()
            rows[d, r + d] = 1
            if sp is not None:
                rows.mul_(torch.outer(sp[r:r + step], sp))
            out[r:r + step] = rows
        return out

    # --- codebooks ----------------------------------------------------------------------------------

    def _weights(self, cols: torch.Tensor, v: int) -> torch.Tensor:
        """k-means weights of the vectors of permuted columns `cols` (as to_vectors orders them): the column's
        Hessian diagonal, times the lanes' row weights with row_scale or channel weights ([n, v] then)."""
        P = self.W.shape[0] // v
        w = self.diag[self.perm][cols].to(torch.float32).repeat_interleave(P)
        return w if self.lanes is None else w[:, None] * self._lane_w(v).repeat(len(cols), 1)

    def _lane_w(self, v: int) -> torch.Tensor | None:
        """[out/v, v] row weights of one column's vectors (None without row_scale and channel weights)."""
        return None if self.lanes is None else self.lanes.view(-1, v).to(torch.float32)

    def _grouped_kmeans(self, Wp: torch.Tensor, k: int, seed: int) -> torch.Tensor:
        """[G, k, v] codebooks, each Hessian-weighted k-means over its group's columns, rounded to F16."""
        cfg = self.cfg
        books = []
        for g in range(cfg.groups):
            cols = (self.gp == g).nonzero().flatten()
            X = to_vectors(Wp[:, cols], cfg.v)
            books.append(kmeans(X, k, self._weights(cols, cfg.v), iters=cfg.kmeans_iters, seed=seed + 16 * g))
        return f16(torch.stack(books))

    # --- the second-order assignment loop -----------------------------------------------------------

    def _assign(self, C: torch.Tensor, R: torch.Tensor | None, O: torch.Tensor | None, n_out: int):
        """GPTQ-style pass over the permuted columns. Returns codes [P, in], residual codes, outlier codes
        [n_out, out/v0] and the quantized permuted weight, and the error-compensated targets."""
        # thousands of small ops: one thread is faster than two that must meet at every op, and much faster
        # when other processes hold the cores (k-means and the refit, large ops, keep every thread)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return self._assign_columns(C, R, O, n_out)
        finally:
            torch.set_num_threads(threads)

    def _assign_columns(self, C, R, O, n_out):
        """The loop itself, on transposed matrices (row j = permuted column j: contiguous, one op to update)."""
        cfg, P, v = self.cfg, self.P, self.cfg.v
        WT = self.W[:, self.perm].T.contiguous()                      # [in, out]
        n = WT.shape[0]
        QT, targetT = torch.zeros_like(WT), torch.zeros_like(WT)
        codes = torch.zeros(n, P, dtype=torch.long, device=self.device)
        rcodes = torch.zeros(n, P, dtype=torch.long, device=self.device) if R is not None else None
        ocodes = torch.zeros(n_out, WT.shape[1] // cfg.v0, dtype=torch.long, device=self.device) if O is not None else None
        U, lw, lw0 = self.U, self._lane_w(v), (self._lane_w(cfg.v0) if O is not None else None)
        main = [centroid_terms(Cg, lw) for Cg in C]
        res = [centroid_terms(Rg, lw) for Rg in R] if R is not None else None
        out = centroid_terms(O, lw0) if O is not None else None
        group, u_diag = self.gp.tolist(), U.diagonal().tolist()
        for i1 in range(0, n, cfg.block):
            i2 = min(i1 + cfg.block, n)
            W1 = WT[i1:i2]                                            # updated in place: WT's rows i1..i2 are done after
            E1 = torch.zeros_like(W1)
            for j in range(i2 - i1):
                col = i1 + j
                g = group[col]
                w = W1[j]
                targetT[col] = w
                x = w.view(P, v)
                c = nearest_in(x, main[g], lw)
                q = C[g][c]
                codes[col] = c
                if R is not None:
                    r = nearest_in(x - q, res[g], lw)
                    q = q + R[g][r]
                    rcodes[col] = r
                q = q.reshape(-1)
                if O is not None and col < n_out:
                    unit = self.ounit[col]
                    o = nearest_in(((w - q) / unit).view(-1, cfg.v0), out, lw0)
                    q = q + O[o].reshape(-1) * unit
                    ocodes[col] = o
                QT[col] = q
                e = (w - q) / u_diag[col]
                W1[j + 1:].addr_(U[col, col + 1:i2], e, alpha=-1)
                E1[j] = e
            WT[i2:].addmm_(U[i1:i2, i2:].T, E1, alpha=-1)
        return (codes.T.contiguous(), None if rcodes is None else rcodes.T.contiguous(), ocodes,
                QT.T.contiguous(), targetT.T.contiguous())

    # --- codebook refit with the assignment fixed ---------------------------------------------------

    def _refit(self, codes: torch.Tensor, rcodes: torch.Tensor | None, C: torch.Tensor, R: torch.Tensor | None,
               Qout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Codebooks minimising tr((W − Ŵ) H (W − Ŵ)ᵀ) for fixed codes, in closed form.

        Ŵ is linear in the stacked codebooks Z = [C_0..C_G-1; R_0..R_G-1] (K rows, v lanes):
        Ŵ[p·v+e, j] = Z[a(p, j), e] + Z[b(p, j), e]. With A_p the one-hot of row p's codes ([n, K]), the normal
        equations of lane e are (Σ_p λ_pe A_pᵀ H A_p) Z_e = Σ_p λ_pe A_pᵀ H W_(p·v+e)ᵀ, λ the row weights (1 without
        row_scale). Unused entries are held at their old value by a small ridge.
        """
        v, P, G = self.cfg.v, self.P, self.cfg.groups
        H = self.Hp
        K1 = C.shape[1]
        Z0 = torch.cat([C.reshape(-1, v)] + ([R.reshape(-1, v)] if R is not None else []))
        K = Z0.shape[0]
        idx = [codes + K1 * self.gp[None, :]]
        if rcodes is not None:
            idx.append(rcodes + G * K1 + R.shape[1] * self.gp[None, :])
        Wp = self.W[:, self.perm] - Qout                                # what the codebooks must represent
        HW = Wp @ H                                                     # [out, n]
        dev = self.device
        lam_pe = torch.ones(P, v, device=dev) if self.lanes is None else self._lane_w(v)
        M = torch.zeros(v, K, K, device=dev)
        B = torch.zeros(K, v, device=dev)
        n = H.shape[0]
        Mp = torch.zeros(K, K, device=dev)
        for p in range(P):
            AtH = torch.zeros(K, n, device=dev)                         # A_pᵀ H, by rows (H is symmetric)
            for a in idx:
                AtH.index_add_(0, a[p], H)
                B.index_add_(0, a[p], HW[p * v:(p + 1) * v].T * lam_pe[p])
            Mp.zero_()
            for a in idx:
                Mp.index_add_(1, a[p], AtH)                             # (A_pᵀ H) A_p
            M += lam_pe[p][:, None, None] * Mp
        M, B = M.to(torch.float64), B.to(torch.float64)
        Z = torch.empty(K, v, dtype=torch.float64, device=dev)
        for e in range(v):
            lam = 1e-6 * float(torch.diag(M[e]).mean()) + 1e-12
            Z[:, e] = torch.linalg.solve(M[e] + lam * torch.eye(K, dtype=M.dtype, device=dev),
                                         B[:, e] + lam * Z0[:, e].to(torch.float64))
        Z = f16(Z.to(torch.float32))
        C = Z[:G * K1].reshape(G, K1, v)
        return (C, Z[G * K1:].reshape(G, -1, v)) if R is not None else (C, None)

    # --- driver -------------------------------------------------------------------------------------

    def quantize(self) -> VQTensor:
        cfg, P, v = self.cfg, self.P, self.cfg.v
        out_features, in_features = self.W0.shape
        Wp = self.W[:, self.perm]
        n_out = int(round(cfg.outlier_frac * in_features))

        C = self._grouped_kmeans(Wp, cfg.k, cfg.seed) if self.codebook is None else self.codebook
        R = O = None
        if n_out:
            lw = self._lane_w(v)
            first = torch.stack([C[self.gp[j]][nearest(Wp[:, j].view(P, v), C[self.gp[j]], lw)[0]].reshape(-1)
                                 for j in range(n_out)], 1)
            err = (Wp[:, :n_out] - first) / self.ounit[:n_out]
            O = f16(kmeans(to_vectors(err, cfg.v0), cfg.k0, self._weights(torch.arange(n_out, device=self.device), cfg.v0),
                           iters=cfg.kmeans_iters, seed=cfg.seed + 2))
        codes, rcodes, ocodes, Q, target = self._assign(C, None, O, n_out)
        if cfg.k_res:
            R = self._grouped_kmeans(target - Q, cfg.k_res, cfg.seed + 1)
            codes, rcodes, ocodes, Q, target = self._assign(C, R, O, n_out)
        for _ in range(cfg.refit_rounds if self.codebook is None else 0):
            Qout = self._outlier_part(ocodes, O, n_out)
            C, R = self._refit(codes, rcodes, C, R, Qout)
            codes, rcodes, ocodes, Q, target = self._assign(C, R, O, n_out)
        return self._tensor(codes, rcodes, ocodes, C, R, O, n_out)

    def _outlier_part(self, ocodes, O, n_out) -> torch.Tensor:
        """The outlier codebook's contribution to the permuted normalized weight (zero without outliers)."""
        out = torch.zeros_like(self.W)
        if O is not None:
            out[:, :n_out] = O[ocodes].reshape(n_out, -1).T * self.ounit[:n_out]
        return out

    def _tensor(self, codes, rcodes, ocodes, C, R, O, n_out) -> VQTensor:
        """Store the codes in the original column order (the permutation is absorbed), on the CPU."""
        def host(x: torch.Tensor, dtype) -> np.ndarray:
            return x.cpu().numpy().astype(dtype)
        inv = torch.argsort(self.perm)
        t = VQTensor(shape=tuple(self.W0.shape), codes=host(codes[:, inv], np.uint32), codebook=host(C, np.float16))
        if R is not None:
            t.res_codes = host(rcodes[:, inv], np.uint32)
            t.res_codebook = host(R, np.float16)
        if self.s is not None:
            t.col_norm = host(torch.stack([self.s, self.t]), np.float32)
        if self.u is not None:
            t.row_scale = host(self.u, np.float16)
        if O is not None:
            t.outlier_cols = host(self.perm[:n_out], np.int32)
            t.outlier_idx = host(ocodes, np.int16)
            t.outlier_codebook = host(O, np.float16)
        return t.add_tail(self.tail.cpu().numpy())


def shared_codebook(layers: list[Callable[[], VPTQ]], cfg: VQConfig, max_points: int = 1 << 18,
                    ranks: Ranks = Ranks()) -> torch.Tensor:
    """One [1, k, v] codebook for several weights (format.md 4.1): Hessian-weighted k-means over their vectors
    (normalized as cfg says; Lloyd passes on a sample of max_points of them, which keeps k = 4096 over 30
    tensors to minutes, stratified as `kmeans` does with its TAIL_POINTS farthest vectors per weight always in it),
    then cfg.refit_rounds rounds of second-order assignment of each weight with the centroids moved to the
    weighted mean of the error-compensated targets assigned to them (all vectors).
    `layers[i]()` makes weight i's VPTQ, so only one Hessian is held at once; the work runs on its device. Over
    several ranks (distributed.py) rank 0 runs the k-means and each rank assigns every world-th weight; the sums
    are kept per weight, on the CPU, and added in weight order, so the codebook does not depend on the number of
    ranks. The codebook comes back on the CPU."""
    v = cfg.v

    def vectors(vp: VPTQ, Wp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        X, w = to_vectors(Wp, v), vp._weights(torch.arange(Wp.shape[1], device=vp.device), v)
        return X, (w if w.dim() == 2 else w[:, None].expand_as(X))

    C = torch.empty(1, cfg.k, v, device="cpu")
    if ranks.main:
        X, w = zip(*(vectors(vp, vp.W[:, vp.perm]) for vp in (make() for make in layers)))
        X, w = torch.cat(X), torch.cat(w)
        C = f16(kmeans(X, cfg.k, w, iters=cfg.kmeans_iters, seed=cfg.seed, max_points=max_points,
                       tail_points=TAIL_POINTS * len(layers)))[None].cpu()
        del X, w
    C = ranks.broadcast(C)
    for _ in range(cfg.refit_rounds):
        S = torch.zeros(len(layers), cfg.k, v, dtype=torch.float64, device="cpu")
        N = torch.zeros(len(layers), cfg.k, v, dtype=torch.float64, device="cpu")
        for i in range(ranks.rank, len(layers), ranks.world):
            vp = layers[i]()
            codes, _, _, _, target = vp._assign(C.to(vp.device), None, None, 0)
            X, w = vectors(vp, target)
            idx = codes.T.reshape(-1)                     # to_vectors' order: column j, vector row p at j·P + p
            S[i].index_add_(0, idx.cpu(), (X * w).double().cpu())
            N[i].index_add_(0, idx.cpu(), w.double().cpu())
        S, N = ranks.gather(S).sum(0), ranks.gather(N).sum(0)
        C = f16(torch.where(N > 0, S / N.clamp_min(1e-300), C[0].double()).float())[None]
    return C
