"""The input rotations of `tools.layer_proxy --rotate`: orthogonal, and the Hadamard one block-diagonal with blocks
of the largest power of two that divides the width (what a kernel could apply to the activations)."""
import pytest
import torch

from vq_gguf.tools.layer_proxy import input_rotation


@pytest.mark.parametrize("n, block", [(576, 64), (1536, 512), (96, 32), (4096, 4096)])
def test_hadamard_rotation(n, block):
    U = input_rotation("hadamard", n).double()
    assert torch.allclose(U @ U.T, torch.eye(n, dtype=torch.float64), atol=1e-6)
    assert torch.allclose(U.abs()[:block, :block], torch.full((block, block), block ** -0.5, dtype=torch.float64))
    blocks = torch.arange(n) // block
    assert not U[blocks[:, None] != blocks[None, :]].any()
    assert not torch.equal(U, input_rotation("hadamard", n, seed=1))  # the signs are drawn


def test_orthogonal_rotation():
    U = input_rotation("orthogonal", 576).double()
    assert torch.allclose(U @ U.T, torch.eye(576, dtype=torch.float64), atol=1e-5)
    assert (U == 0).sum() == 0
