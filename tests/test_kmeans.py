import torch

from vq_gguf.kmeans import centroid_terms, draw, kmeans, nearest, nearest_in


def cost(X, C, w):
    idx, d = nearest(X, C)
    return float((w * d).sum())


def test_deterministic_under_seed():
    X = torch.randn(5000, 4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(kmeans(X, 32, seed=7), kmeans(X, 32, seed=7))


def test_weighted_cost_decreases_with_iterations():
    g = torch.Generator().manual_seed(1)
    X = torch.randn(4000, 4, generator=g)
    w = torch.rand(4000, generator=g) ** 4
    costs = [cost(X, kmeans(X, 16, w, iters=i, seed=3), w) for i in (0, 1, 3, 10)]
    assert all(b <= a * (1 + 1e-6) for a, b in zip(costs, costs[1:])), costs
    assert costs[-1] < costs[0]
    assert costs[3] < 0.99 * costs[1]                   # Lloyd goes on after its first pass


def test_weights_pull_centroids():
    # two clusters; with one heavily weighted point the centroid of its cluster moves onto it
    X = torch.tensor([[0.0], [1.0], [10.0], [11.0]])
    w = torch.tensor([1.0, 1000.0, 1.0, 1.0])
    C = kmeans(X, 2, w, seed=0)
    assert torch.isclose(C.min(), torch.tensor(1.0), atol=1e-2)


def test_fewer_rows_than_centroids_are_all_kept():
    X = torch.randn(5, 3, generator=torch.Generator().manual_seed(2))
    C = kmeans(X, 8, seed=0)
    assert C.shape == (8, 3) and torch.equal(C[:5], X)
    assert (C[5:, None] == X[None]).all(-1).any(1).all()              # the padding repeats rows


def test_lloyd_on_a_sample_fits_every_row():
    g = torch.Generator().manual_seed(4)
    X = torch.randn(6000, 4, generator=g)
    w = torch.rand(6000, generator=g)
    C = kmeans(X, 16, w, seed=0, max_points=2000)       # 125 rows a centroid (the quantizer has 256)
    full = cost(X, kmeans(X, 16, w, seed=0), w)
    assert cost(X, C, w) < 1.05 * full


def test_the_sample_keeps_rare_large_rows():
    # 100 000 rows of standard deviation 0.1 and three far outliers, Lloyd on 4096 rows: a uniform draw keeps
    # each outlier with probability 4 %, the stratified sample keeps all three, and each gets its own centroid
    g = torch.Generator().manual_seed(6)
    X = 0.1 * torch.randn(100_000, 2, generator=g)
    far = torch.tensor([[-9.0, 0.0], [0.0, 6.0], [5.0, 5.0]])
    X[[11, 5000, 77_777]] = far
    lane_w = torch.rand(100_000, 2, generator=g) + 0.5
    for weights in (None, lane_w):
        C = kmeans(X, 32, weights, seed=0, max_points=4096)
        assert torch.allclose(C[nearest(far, C)[0]], far, atol=1e-3)
        C0 = kmeans(X, 32, weights, seed=0, max_points=4096, tail_points=0)       # the uniform draw
        assert (C0[nearest(far, C0)[0]] - far).norm(dim=1).max() > 3
    # the rest of the sample is weighted up: the bulk's centroids stay as good as a uniform draw's
    assert cost(X[100:], C, torch.ones(len(X) - 100)) < 1.1 * cost(X[100:], C0, torch.ones(len(X) - 100))


def test_draw_follows_the_weights_and_never_picks_a_zero():
    gen = torch.Generator().manual_seed(5)
    p = torch.tensor([0.0, 1.0, 0.0, 3.0, 0.0])
    counts = torch.bincount(torch.tensor([draw(p, gen) for _ in range(4000)]), minlength=5)
    assert counts[0] == counts[2] == counts[4] == 0
    assert 0.70 < counts[3] / 4000 < 0.80                # 3/4, ± 5 standard deviations


def test_nearest_and_nearest_in_against_brute_force_with_and_without_lane_weights(monkeypatch):
    import vq_gguf.kmeans as km
    monkeypatch.setattr(km, "CHUNK", 256 * 50)           # 50 rows a chunk: the lane weights must follow the rows
    g = torch.Generator().manual_seed(6)
    X, C = torch.randn(144, 4, generator=g), torch.randn(256, 4, generator=g)
    lw = torch.rand(144, 4, generator=g) ** 3
    for w in (None, lw):
        d = ((torch.ones_like(X) if w is None else w)[:, None].double() * (X[:, None] - C[None]).double() ** 2).sum(-1)
        idx, dist = nearest(X, C, w)
        assert torch.all(d.gather(1, idx[:, None])[:, 0] <= d.min(1).values + 1e-5)
        assert torch.allclose(dist.double(), d.gather(1, idx[:, None])[:, 0], atol=1e-5)
        assert torch.equal(nearest_in(X, centroid_terms(C, w), w), idx)
