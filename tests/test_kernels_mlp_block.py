"""The one-launch batch-1 MLP block (``kernels.mlp_block``) under the interpreter against the
three unfused ``linear`` calls it replaces (run in an interpreted child pytest: see
``tests/interpreted.py``). The interpreter runs programs one after another, so the grid is
one program here (its grid barriers pass at once); the multi-program barrier is tested on
the GPU (``tests/test_kernels_gpu_decode.py``)."""

import pytest
import torch

from kernels import reference as ref
from tests.interpreted import INTERPRETED, delegate_all

if INTERPRETED:
    from kernels import mlp_block as mb
else:
    mb = None  # only the child touches triton


def block_case(h, a, inter, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    attn = torch.randn(1, a, generator=g).to(dtype)
    wo = (torch.randn(h, a, generator=g) / a ** 0.5).to(dtype)
    res = torch.randn(1, h, generator=g).to(dtype)
    nw = (1 + 0.1 * torch.randn(h, generator=g)).to(dtype)
    wgu = (torch.randn(2 * inter, h, generator=g) / h ** 0.5).to(dtype)
    wd = (torch.randn(h, inter, generator=g) / inter ** 0.5).to(dtype)
    return attn, wo, res, nw, wgu, wd


def unfused(attn, wo, res, nw, eps, wgu, wd):
    o, _ = ref.skinny_linear_reference(attn, wo)
    act, new_res = ref.skinny_linear_reference(o, wgu, residual=res, norm_weight=nw, eps=eps,
                                               act="silu_and_mul")
    return ref.skinny_linear_reference(act, wd)[0], new_res


@pytest.mark.parametrize("depth", [1, 2, "dot"])  # register tiles ahead, or tensor-core form
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h,a,inter,block_n,block_k", [
    (32, 64, 48, 4, 32),   # K chunks exact (64/32, 32/32), a ragged chunk in the down phase (48)
    (24, 40, 20, 8, 16),   # ragged K tails everywhere, a ragged row block (24 over 8: exact; 40 gate|up rows: 5)
    (20, 32, 36, 16, 64),  # one wide chunk, ragged row blocks in every phase
])
def test_mlp_block_matches_unfused(dtype, h, a, inter, block_n, block_k, depth):
    attn, wo, res, nw, wgu, wd = block_case(h, a, inter, dtype, seed=h * a + inter)
    eps = 1e-5
    bar = mb._barrier(attn.device)
    if depth == "dot":
        cfg = dict(block_n=max(16, block_n), block_k=block_k, num_warps=2, use_dot=True,
                   num_stages=2)
    else:
        cfg = dict(block_n=block_n, block_k=block_k, num_warps=2, depth=depth)
    out, new_res = mb.mlp_block_triton(attn, wo, res, nw, eps, wgu, wd, max_programs=1,
                                       config=cfg)
    exp, exp_res = unfused(attn, wo, res, nw, eps, wgu, wd)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out, exp, **tol)
    torch.testing.assert_close(new_res, exp_res, **tol)
    assert bar.tolist() == [0, 0, 0]  # re-armed for the next launch
    out2, _ = mb.mlp_block_triton(attn, wo, res, nw, eps, wgu, wd, max_programs=1, config=cfg)
    torch.testing.assert_close(out2, out, atol=0, rtol=0)


def test_mlp_block_rejects_shapes_that_do_not_chain():
    attn, wo, res, nw, wgu, wd = block_case(16, 32, 24, torch.float32, seed=1)
    with pytest.raises(ValueError, match="do not chain"):
        mb.mlp_block_triton(attn, wo, res, nw, 1e-6, wgu[:-1], wd, max_programs=1)
    with pytest.raises(ValueError, match="do not chain"):
        mb.mlp_block_triton(torch.cat([attn, attn]), wo, res, nw, 1e-6, wgu, wd, max_programs=1)
    with pytest.raises(ValueError, match="power of 2"):
        mb.mlp_block_triton(attn, wo, res, nw, 1e-6, wgu, wd, max_programs=1,
                            config=dict(use_dot=True, block_n=8))
    with pytest.raises(ValueError, match="depth"):
        mb.mlp_block_triton(attn, wo, res, nw, 1e-6, wgu, wd, max_programs=1,
                            config=dict(depth=3))


delegate_all(globals(), __file__)
