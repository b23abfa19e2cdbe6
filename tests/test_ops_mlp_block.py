"""``ops.mlp_block`` off the GPU path: the three ``linear`` calls it stands for (its
``SYNCLESS_FUSED_MLP`` switch: tests/test_kernel_switches.py)."""

import torch

from kernels import ops, reference as ref


def test_mlp_block_cpu_is_the_three_linear_calls():
    g = torch.Generator().manual_seed(5)
    h, a, inter = 24, 40, 20
    attn, res = torch.randn(3, a, generator=g), torch.randn(3, h, generator=g)
    wo, nw = torch.randn(h, a, generator=g), 1 + 0.1 * torch.randn(h, generator=g)
    wgu, wd = torch.randn(2 * inter, h, generator=g), torch.randn(h, inter, generator=g)
    out, new_res = ops.mlp_block(attn, wo, res, nw, 1e-5, wgu, wd)
    o = attn @ wo.T
    x, exp_res = ref.rms_norm_reference(o, nw, 1e-5, res)
    gu = x @ wgu.T
    exp = (torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]) @ wd.T
    torch.testing.assert_close(out, exp)
    torch.testing.assert_close(new_res, exp_res)
