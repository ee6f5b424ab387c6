"""Output-channel weights from the end loss (vq_export/fisher.py) on the tiny model: each is the mean squared
gradient of the next-token loss with respect to that output, checked against autograd on the whole output."""
import torch
import torch.nn.functional as F

from tests import tiny_model
from vq_gguf.fisher import channel_fisher
from vq_gguf.model import Model


def test_channel_fisher_matches_autograd():
    model = Model(tiny_model.source())
    tokens = torch.randint(0, tiny_model.N_VOCAB, (3, 12), generator=torch.Generator().manual_seed(0))
    names = ["blk.0.ffn_down.weight", "blk.0.attn_v.weight"]
    g = channel_fisher(model, tokens, names)
    assert set(g) == set(names)

    # the same quantity by perturbing the output: y + δ, ∂ℓ/∂δ per window
    blk, short = model.blocks[0], "attn_v"
    expect = 0
    for t in tokens:
        delta = torch.zeros(1, 12, blk.w[short].shape[0], requires_grad=True)
        base = blk.linear
        blk.linear = lambda name, x: base(name, x) + (delta if name == short else 0)
        logits = model.forward(t[None])
        F.cross_entropy(logits[0, :-1], t[1:], reduction="sum").backward()
        del blk.linear
        expect = expect + delta.grad.double().pow(2).sum((0, 1))
    expect = expect / expect.mean()
    assert torch.allclose(g["blk.0.attn_v.weight"].double(), expect, rtol=1e-4)
    assert abs(float(g["blk.0.ffn_down.weight"].mean()) - 1) < 1e-5 and (g["blk.0.ffn_down.weight"] > 0).all()
    assert not any("linear" in vars(b) for b in model.blocks)   # the observers are removed
