"""The interleaved gate|up layout: the loader's placement of checkpoint rows, and that the
MLP computes the same function as the stacked layout (CPU, reference ops)."""

import pytest
import torch

from kernels import ops
from workers.models.layers import MergedColumnLinear


def test_interleaved_parts_land_as_row_pairs():
    m = MergedColumnLinear(4, [(2, 3), (0, 3)], bias=True, dtype=torch.float32, interleave=True)
    gate, up = torch.arange(20.0).view(5, 4), 100 + torch.arange(12.0).view(3, 4)
    m.load_part(m.weight, gate, 0)
    m.load_part(m.weight, up, 1)
    m.load_part(m.bias, gate[:, 0], 0)
    m.load_part(m.bias, up[:, 0], 1)
    want = torch.stack([gate[2:5], up[0:3]], dim=1).reshape(6, 4)  # rows g2 u0 g3 u1 g4 u2
    assert torch.equal(m.weight.data, want)
    assert torch.equal(m.bias.data, want[:, 0])


def test_interleave_needs_equal_parts():
    with pytest.raises(ValueError, match="equal lengths"):
        MergedColumnLinear(4, [(0, 3), (0, 2)], bias=False, dtype=torch.float32, interleave=True)


@pytest.mark.parametrize("m", [1, 5])
def test_pairs_mlp_equals_stacked(m):
    g = torch.Generator().manual_seed(3)
    hidden, inter = 16, 12
    x = torch.randn(m, hidden, generator=g)
    res = torch.randn(m, hidden, generator=g)
    nw = 1 + 0.1 * torch.randn(hidden, generator=g)
    gate, up = torch.randn(inter, hidden, generator=g), torch.randn(inter, hidden, generator=g)
    stacked = torch.cat([gate, up])
    pairs = torch.stack([gate, up], dim=1).reshape(2 * inter, hidden)
    y_s, r_s = ops.linear(x, stacked, residual=res, norm_weight=nw, act="silu_and_mul")
    y_p, r_p = ops.linear(x, pairs, residual=res, norm_weight=nw, act="silu_and_mul_pairs")
    torch.testing.assert_close(y_p, y_s)
    assert torch.equal(r_p, r_s)
    torch.testing.assert_close(ops.silu_and_mul(x @ pairs.T, pairs=True), ops.silu_and_mul(x @ stacked.T))
    y_wrong, _ = ops.linear(x, stacked, residual=res, norm_weight=nw, act="silu_and_mul_pairs")
    assert not torch.allclose(y_wrong, y_s, atol=1e-3)
