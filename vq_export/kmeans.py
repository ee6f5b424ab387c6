"""Weighted k-means with torch on the points' device: k-means++ seeding, chunked distances, deterministic under a
seed. The random draws come from a CPU generator whatever the device, so a GPU run samples the same points (its
sums, rounded in another order, can still move a centroid by a last bit)."""
from __future__ import annotations

import torch

CHUNK = 1 << 24  # entries of the distance matrix computed at once (64 MiB)
TAIL_POINTS = 1 << 10  # rows farthest from the weighted mean always in the Lloyd sample (see kmeans)


def nearest(X: torch.Tensor, C: torch.Tensor, lane_w: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Index of the nearest centroid of each row of X, and the squared distance to it; with lane_w [n, v] the
    distance is Σ_e lane_w[i, e] (x_ie − c_e)². Chunks of rows, each one product (`scores`)."""
    idx = torch.empty(X.shape[0], dtype=torch.long, device=X.device)
    dist = torch.empty(X.shape[0], dtype=X.dtype, device=X.device)
    rows = max(1, CHUNK // C.shape[0])
    terms = centroid_terms(C) if lane_w is None else None
    for s in range(0, X.shape[0], rows):
        x = X[s : s + rows]
        w = None if lane_w is None else lane_w[s : s + rows]
        m, idx[s : s + rows] = scores(x, terms or centroid_terms(C, w), w).min(1)
        dist[s : s + rows] = m + (x * x if w is None else w * x * x).sum(1)
    return idx, dist.clamp_min_(0)


def centroid_terms(C: torch.Tensor, lane_w: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What `scores` needs of C, computed once for many searches with the same lane weights [P, v] (GPTQ's
    column loop: every column's P vectors): Cᵀ, and the bias ‖c‖² [k], or lane_w (C⊙C)ᵀ [P, k]."""
    return C.T.contiguous(), (C * C).sum(1) if lane_w is None else lane_w @ (C * C).T


def scores(x: torch.Tensor, terms: tuple[torch.Tensor, torch.Tensor], lane_w: torch.Tensor | None = None) -> torch.Tensor:
    """[rows, k]: the distance of each row of x to each centroid less ‖x‖²_w, the same for every centroid:
    bias − 2 (w⊙x)·c, one product."""
    Ct, bias = terms
    return torch.addmm(bias, x if lane_w is None else lane_w * x, Ct, alpha=-2)


def nearest_in(x: torch.Tensor, terms: tuple[torch.Tensor, torch.Tensor], lane_w: torch.Tensor | None = None) -> torch.Tensor:
    """nearest(x, C, lane_w)[0] with C's terms computed beforehand (centroid_terms)."""
    return scores(x, terms, lane_w).argmin(1)


def draw(p: torch.Tensor, gen: torch.Generator) -> int:
    """One index drawn with probability ∝ p ≥ 0 (not all zero), by inverse CDF: a tenth of the time of
    torch.multinomial, which k-means++ calls k times on 2¹⁶ points."""
    cdf = p.to(torch.float64).cumsum(0)
    u = cdf[-1:] * torch.rand(1, dtype=torch.float64, generator=gen, device="cpu").to(cdf.device)
    return min(int(torch.searchsorted(cdf, u, right=True)), len(p) - 1)


def kmeans_pp(X: torch.Tensor, w: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """k-means++ seeding with lane weights w [n, v]: each new centroid drawn with probability ∝ the weighted D²."""
    n = X.shape[0]
    C = torch.empty(k, X.shape[1], dtype=X.dtype, device=X.device)
    C[0] = X[draw(w.sum(1), gen)]
    d = (w * (X - C[0]) ** 2).sum(1)
    for i in range(1, k):
        C[i] = X[draw(d, gen) if d.sum() > 0 else int(torch.randint(n, (1,), generator=gen, device="cpu"))]
        d = torch.minimum(d, (w * (X - C[i]) ** 2).sum(1))
    return C


def kmeans(X: torch.Tensor, k: int, weights: torch.Tensor | None = None, *, iters: int = 25,
           seed: int = 0, tol: float = 1e-6, max_seed_points: int = 1 << 16,
           max_points: int = 1 << 16, tail_points: int = TAIL_POINTS) -> torch.Tensor:
    """Weighted Lloyd iterations; returns the centroids [k, v] (callers assign with `nearest`, most of them to a
    rounded codebook or inside the second-order pass).

    Minimises Σ_i w_i ‖x_i − c_{a(i)}‖², or with lane weights [n, v] Σ_i Σ_e w_ie (x_ie − c_{a(i)e})². Seeding
    runs on at most max_seed_points rows (chosen by weight), the Lloyd passes on at most max_points rows
    (each pass is memory-bound on its n × k distances: 2¹⁶ rows are 256 per centroid at k = 256, and a third of
    a 576 × 1536 weight's vectors at v = 4). The sample is stratified: the tail_points rows farthest from the
    weighted mean (weighted squared distance) always, the rest drawn uniformly and weighted up by the ratio
    drawn, so that the rare large weights a uniform draw mostly misses (a −9.25 among weights of standard
    deviation 0.11) can get centroids of their own. Empty clusters are re-seeded with the points that
    currently cost the most.
    """
    X = X.to(torch.float32)
    n, dev = X.shape[0], X.device
    w = torch.ones(n, device=dev) if weights is None else weights.to(dev, torch.float32).clamp_min(0)
    if w.sum() <= 0:
        w = torch.ones_like(w)
    gen = torch.Generator("cpu").manual_seed(seed)
    if n <= k:
        return torch.cat([X, X[torch.randint(n, (k - n,), generator=gen, device="cpu").to(dev)]]) if n < k else X.clone()
    m = 0
    if n > max_points:
        m = min(tail_points, max_points // 2)
        W = w if w.dim() == 2 else w[:, None]
        tail = torch.topk((W * (X - (W * X).sum(0) / W.sum(0).clamp_min(1e-30)) ** 2).sum(1), m).indices
        rest = torch.ones(n, dtype=torch.bool, device=dev)
        rest[tail] = False
        rest = rest.nonzero().flatten()
        pick = torch.cat([tail, rest[torch.randperm(len(rest), generator=gen, device="cpu")[:max_points - m].to(dev)]])
        up = torch.cat([torch.ones(m, device=dev), torch.full((max_points - m,), len(rest) / (max_points - m), device=dev)])
        X, w, n = X[pick], w[pick] * (up[:, None] if w.dim() == 2 else up), max_points
    lane_w = w if w.dim() == 2 else None              # per-lane weights need the weighted distance
    W = w if lane_w is not None else w[:, None].expand_as(X)
    if n > max_seed_points:  # the tail (rows [0, m)) and a draw by weight from the rest
        drawn = torch.multinomial(W[m:].sum(1).cpu(), max_seed_points - m, replacement=False, generator=gen)
        sub = torch.cat([torch.arange(m, device=drawn.device), m + drawn]).to(dev)
    else:
        sub = torch.arange(n, device=dev)
    C = kmeans_pp(X[sub], W[sub], k, gen)

    prev = float("inf")
    for _ in range(iters):
        idx, dist = nearest(X, C, lane_w)
        cost_i = dist if lane_w is not None else w * dist
        cost = float(cost_i.sum())
        wsum = torch.zeros(k, X.shape[1], device=dev).index_add_(0, idx, W)
        C_new = torch.zeros_like(C).index_add_(0, idx, X * W) / wsum.clamp_min(1e-30)
        empty = (wsum.sum(1) <= 0).nonzero().flatten()
        if len(empty):
            worst = torch.topk(cost_i, len(empty)).indices
            C_new[empty] = X[worst]
        C = C_new
        if cost >= prev * (1 - tol):                    # converged (the first pass always goes on)
            break
        prev = cost
    return C
