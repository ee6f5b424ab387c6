"""VPTQ on small synthetic layers with known answers: each step must lower the layer-output proxy loss
tr((W − Ŵ) H (W − Ŵ)ᵀ), and the permutation must be undone exactly."""
import weakref

import numpy as np
import pytest
import torch

from vq_gguf.kmeans import nearest
from vq_gguf.reference import dequantize
from vq_gguf.config import VQConfig
from vq_gguf.vptq import VPTQ, output_error, proxy_loss, shared_codebook


def layer(out_features=64, in_features=128, n_tokens=2048, seed=0):
    """A weight and a Hessian from correlated inputs with a few strong input channels, as in real LLMs."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(out_features, in_features, generator=g) * 0.05
    mix = torch.randn(in_features, in_features, generator=g) / in_features ** 0.5 + torch.eye(in_features)
    X = torch.randn(n_tokens, in_features, generator=g) @ mix
    X[:, :3] *= 20                                              # outlier input channels
    return W, (X.T @ X).to(torch.float64)


def loss(W, H, cfg):
    t = VPTQ(W, H, cfg).quantize()
    return proxy_loss(W, torch.from_numpy(dequantize(t)), H), t


def test_second_order_beats_nearest_centroid():
    W, H = layer()
    cfg = VQConfig(v=4, k=16, refit_rounds=0)
    l2, t = loss(W, H, cfg)
    # the same codebook with plain nearest-centroid codes, no error feedback
    C = torch.from_numpy(t.codebook[0].astype(np.float32))
    X = W.reshape(16, 4, 128).permute(0, 2, 1).reshape(-1, 4)
    W_nearest = C[nearest(X, C)[0]].reshape(16, 128, 4).permute(0, 2, 1).reshape(64, 128)
    assert l2 < 0.8 * proxy_loss(W, W_nearest, H)


def test_residual_lowers_error():
    W, H = layer(seed=1)
    base, _ = loss(W, H, VQConfig(v=4, k=16, refit_rounds=0))
    res, t = loss(W, H, VQConfig(v=4, k=16, k_res=16, refit_rounds=0))
    assert t.res_codebook is not None and res < 0.8 * base


def test_codebook_refit_lowers_error():
    W, H = layer(seed=2)
    paper, _ = loss(W, H, VQConfig(v=4, k=16, refit_rounds=0))
    refit, _ = loss(W, H, VQConfig(v=4, k=16, refit_rounds=2))
    assert refit < paper


def test_outlier_columns_lower_error_and_are_the_strongest():
    W, H = layer(seed=3)
    base, _ = loss(W, H, VQConfig(v=4, k=16, refit_rounds=0))
    out, t = loss(W, H, VQConfig(v=4, k=16, outlier_frac=0.03, v0=4, k0=16, refit_rounds=0))
    assert out < base
    assert {0, 1, 2} <= set(t.outlier_cols.tolist())


def test_permutation_is_undone_exactly():
    # W built from a small codebook: any correct assignment reproduces it exactly, in the original column order
    g = torch.Generator().manual_seed(4)
    C = torch.randn(16, 4, generator=g).to(torch.float16).to(torch.float32)
    codes = torch.randint(0, 16, (16, 128), generator=g)
    W = C[codes].permute(0, 2, 1).reshape(64, 128)
    _, H = layer(seed=4)
    for act_order in (True, False):
        t = VPTQ(W, H, VQConfig(v=4, k=16, act_order=act_order, kmeans_iters=50, refit_rounds=0)).quantize()
        np.testing.assert_allclose(dequantize(t), W.numpy(), atol=1e-3)


def test_dead_columns():
    W, H = layer(seed=5)
    H[7, :] = 0
    H[:, 7] = 0
    t = VPTQ(W, H, VQConfig(v=4, k=16)).quantize()
    assert np.isfinite(dequantize(t)).all()


def test_deterministic_under_seed():
    W, H = layer(seed=6)
    a = VPTQ(W, H, VQConfig(v=4, k=16, seed=3)).quantize()
    b = VPTQ(W, H, VQConfig(v=4, k=16, seed=3)).quantize()
    assert (a.codes == b.codes).all() and (a.codebook == b.codebook).all()


def test_column_groups_lower_error_and_use_their_own_codebook():
    W, H = layer(seed=7)
    W[:, 64:] *= 8                                              # two halves of very different scale
    one, _ = loss(W, H, VQConfig(v=4, k=16))
    two, t = loss(W, H, VQConfig(v=4, k=16, groups=2))
    assert t.codebook.shape == (2, 16, 4) and two < 0.8 * one
    assert np.abs(t.codebook[1]).max() > 4 * np.abs(t.codebook[0]).max()


def test_normalization_lowers_error_on_uneven_rows_and_columns():
    W, H = layer(seed=8)
    g = torch.Generator().manual_seed(8)
    W = W * torch.exp(torch.randn(64, 1, generator=g)) * torch.exp(torch.randn(1, 128, generator=g)) + 0.02
    plain, _ = loss(W, H, VQConfig(v=4, k=16))
    rows, t_rows = loss(W, H, VQConfig(v=4, k=16, row_scale=True))
    both, t_both = loss(W, H, VQConfig(v=4, k=16, row_scale=True, col_norm=True))
    assert t_rows.row_scale.shape == (64,) and t_both.col_norm.shape == (2, 128)
    assert rows < plain and both < rows


def test_everything_at_once_with_outliers_and_residual():
    W, H = layer(seed=9)
    cfg = VQConfig(v=4, k=16, k_res=4, groups=2, col_norm=True, row_scale=True, outlier_frac=0.03, k0=16)
    err, t = loss(W, H, cfg)
    base, _ = loss(W, H, VQConfig(v=4, k=16))
    assert np.isfinite(dequantize(t)).all() and err < base


def test_shared_codebook_recovers_a_common_codebook():
    """Three weights made of the same 16 vectors: one codebook fitted to all of them finds those vectors, so
    each weight quantizes almost exactly with it (far better than with 4); the weights keep it unchanged."""
    g = torch.Generator().manual_seed(10)
    truth = torch.randn(16, 4, generator=g)
    layers = []
    for seed in range(3):
        _, H = layer(seed=20 + seed)
        idx = torch.randint(16, (16, 128), generator=g)
        W = truth[idx].permute(0, 2, 1).reshape(64, 128)
        layers.append((W, H))

    def total(cfg):
        C = shared_codebook([lambda W=W, H=H: VPTQ(W, H, cfg) for W, H in layers], cfg)
        ts = [VPTQ(W, H, cfg, codebook=C).quantize() for W, H in layers]
        assert all((t.codebook == C.to(torch.float16).numpy()).all() for t in ts)
        return sum(proxy_loss(W, torch.from_numpy(dequantize(t)), H) / proxy_loss(W, torch.zeros_like(W), H)
                   for (W, H), t in zip(layers, ts))

    exact = total(VQConfig(v=4, k=16, refit_rounds=0))
    refit = total(VQConfig(v=4, k=16, refit_rounds=2))
    small = total(VQConfig(v=4, k=4, refit_rounds=2))
    assert exact < 1e-3 and refit <= exact * 1.01 + 1e-6 and small > 100 * exact


def test_shared_codebook_refit_lowers_error():
    layers = [layer(seed=30 + s) for s in range(3)]

    def total(rounds):
        cfg = VQConfig(v=4, k=16, refit_rounds=rounds, row_scale=True)
        C = shared_codebook([lambda W=W, H=H: VPTQ(W, H, cfg) for W, H in layers], cfg)
        return sum(proxy_loss(W, torch.from_numpy(dequantize(VPTQ(W, H, cfg, codebook=C).quantize())), H) for W, H in layers)

    assert total(2) < 0.99 * total(0)                   # 2.7 % with 12 Lloyd passes (over 3 % when k-means stopped after one)


def test_shared_codebook_keeps_a_rare_large_vector():
    """One vector of 40 standard deviations (in a strong input column) among 6144: the Lloyd passes run on
    512 of them, and the sample keeps the farthest ones, so the rare vector gets a centroid and is decoded
    close to its value (a uniform draw of 512 leaves it out 11 times in 12: decoded as 1.3)."""
    layers = [layer(seed=40 + s) for s in range(3)]
    layers[1][0][8:12, 1] = 2.0
    cfg = VQConfig(v=4, k=16)
    C = shared_codebook([lambda W=W, H=H: VPTQ(W, H, cfg) for W, H in layers], cfg, max_points=512)
    Wq = dequantize(VPTQ(*layers[1], cfg, codebook=C).quantize())
    assert np.abs(Wq[8:12, 1] - 2.0).max() < 0.2


def test_shared_codebook_is_refused_with_residual_or_groups():
    W, H = layer()
    C = torch.zeros(1, 16, 4)
    for cfg in (VQConfig(v=4, k=16, k_res=4), VQConfig(v=4, k=16, groups=2), VQConfig(v=4, k=32)):
        with pytest.raises(ValueError, match="shared codebook"):
            VPTQ(W, H, cfg, codebook=C)


def weighted_loss(W, Wq, H, g):
    """Σ_o g_o ‖ΔW_o X‖²: the loss channel weights make VPTQ minimise."""
    D = (W - Wq).to(torch.float64)
    return float((g.double() * ((D @ H) * D).sum(1)).sum())


def test_channel_weights_lower_the_weighted_loss():
    W, H = layer(seed=9)
    g = torch.ones(64)
    g[:16] = 50.0                                               # a quarter of the channels matter much more
    cfg = VQConfig(v=4, k=16)
    plain = torch.from_numpy(dequantize(VPTQ(W, H, cfg).quantize()))
    guided = torch.from_numpy(dequantize(VPTQ(W, H, cfg, channel_weight=g).quantize()))
    assert weighted_loss(W, guided, H, g) < 0.8 * weighted_loss(W, plain, H, g)
    assert weighted_loss(W, guided, H, torch.ones(64)) > weighted_loss(W, plain, H, torch.ones(64))
    # equal weights are the paper's loss: the same codes and codebook
    same = VPTQ(W, H, cfg, channel_weight=torch.full((64,), 3.0)).quantize()
    ref = VPTQ(W, H, cfg).quantize()
    assert (same.codes == ref.codes).all() and np.allclose(same.codebook, ref.codebook, atol=1e-3)


@pytest.mark.parametrize("bad", [torch.ones(63), torch.full((64,), float("nan")), -torch.ones(64)])
def test_channel_weights_are_checked(bad):
    W, H = layer()
    with pytest.raises(ValueError, match="channel weights"):
        VPTQ(W, H, VQConfig(v=4, k=16), channel_weight=bad)


def test_output_error_is_the_proxy_loss_of_the_inputs():
    """The held-out score from inputs X equals the relative proxy loss under their Hessian XᵀX."""
    g = torch.Generator().manual_seed(5)
    W, Wq, X = (torch.randn(*shape, generator=g) for shape in ((32, 64), (32, 64), (300, 64)))
    H = (X.T @ X).to(torch.float64)
    assert output_error(W, Wq, X) == pytest.approx(proxy_loss(W, Wq, H) / proxy_loss(W, torch.zeros_like(W), H), rel=1e-5)


def test_the_hessian_is_not_kept():
    """VPTQ factors H in its constructor and keeps no reference: the caller's last one frees it (at a wide
    input a Hessian is gigabytes, and the quantize loop hands each to its last weight)."""
    W, H = layer()
    ref = weakref.ref(H)
    vp = VPTQ(W, H, VQConfig(v=4, k=16))
    del H
    assert ref() is None
    vp.quantize()


def test_a_vector_length_that_does_not_divide_the_outputs_leaves_a_tail():
    """68 outputs at v = 6: 11 vector rows quantized as the first 66 outputs alone would be (rows do not
    interact in the loss), and the last 2 kept in F16 with row scale 1 (format.md §3)."""
    W, H = layer(out_features=68, seed=4)
    cfg = VQConfig(v=6, k=16, refit_rounds=1, row_scale=True)
    l, t = loss(W, H, cfg)
    head, _ = loss(W[:66], H, cfg)
    assert t.shape == (68, 128) and t.P == 11 and t.codes.shape == (11, 128) and t.tail.dtype == np.float16
    np.testing.assert_array_equal(t.tail, W[66:].numpy().astype(np.float16))
    np.testing.assert_array_equal(t.row_scale[66:], np.ones(2, np.float16))
    Wq = dequantize(t)
    np.testing.assert_array_equal(Wq[66:], W[66:].half().float().numpy())
    tail_loss = proxy_loss(W[66:], torch.from_numpy(Wq[66:]), H)
    assert l == pytest.approx(head + tail_loss, rel=1e-6)


def test_the_index_tensor_of_a_tail_holds_zeros_past_the_codes():
    from vq_gguf.vqtensor import VQTensor
    W, H = layer(out_features=34, in_features=64, seed=5)
    t = VPTQ(W, H, VQConfig(v=4, k=16, refit_rounds=0)).quantize()   # 8 vector rows and 2 tail rows
    (name, index, _), *sides = t.gguf_tensors("blk.0.attn_k.weight")
    assert index.shape == (34, 64 * 4 // 4 // 8) and not index[32:].any() and index[:32].any()
    assert [n for n, _, _ in sides] == ["blk.0.attn_k.vq_codebook", "blk.0.attn_k.vq_tail"]
    with pytest.raises(ValueError, match="outliers"):
        VPTQ(W, H, VQConfig(v=4, k=16, outlier_frac=0.05))


def test_every_tensor_on_the_chosen_device():
    """VPTQ names the device of every tensor it makes (a GPU run must not meet a CPU tensor): with torch's default
    device set to meta, any tensor made without a device is a meta tensor and fails the first op beside a real one.
    Run so on the CPU, every feature and the shared codebook give the same tensors as a plain run."""
    gen = torch.Generator().manual_seed(1)
    cases = [(layer(seed=30), VQConfig(v=4, k=16, k_res=8, outlier_frac=0.05, v0=2, k0=8, col_norm=True, groups=2)),
             (layer(out_features=66, seed=31), VQConfig(v=4, k=16, row_scale=True, act_order=False))]   # 2 tail rows
    g = [torch.rand(len(W), generator=gen) + 0.5 for (W, _), _ in cases]
    shared_cfg = VQConfig(v=4, k=16, row_scale=True)
    layers = [layer(seed=32), layer(seed=33)]

    def run():
        ts = [VPTQ(W, H, cfg, channel_weight=gi, device="cpu").quantize() for ((W, H), cfg), gi in zip(cases, g)]
        C = shared_codebook([lambda W=W, H=H: VPTQ(W, H, shared_cfg, device="cpu") for W, H in layers], shared_cfg)
        return ts + [VPTQ(*layers[0], shared_cfg, codebook=C, device="cpu").quantize()]

    plain = run()
    with torch.device("meta"):
        placed = run()
    def stored(t):   # what the file would hold: the index tensor and every side tensor
        return [(name, x.tobytes()) for name, x, _ in t.gguf_tensors("w.weight")]
    assert [stored(t) for t in plain] == [stored(t) for t in placed]
