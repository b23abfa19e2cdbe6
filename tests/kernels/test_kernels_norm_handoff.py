"""The RMSNorm handoff (``kernels.norm_handoff``) under the interpreter, against the unfused
reference chain ``linear -> rms_norm(+ residual) -> linear (+ act)`` (run in an interpreted
child pytest: see ``tests/interpreted.py``)."""

import pytest
import torch

from kernels import reference as ref
from tests.interpreted import INTERPRETED, delegate_all

if INTERPRETED:
    from kernels import fused_norm_ops
    from kernels import skinny_gemm as sg
else:
    fused_norm_ops = sg = None  # only the child touches triton


def _chain(m, k_in, hidden, n_out, dtype, seed, act=None, bias=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k_in, generator=g).to(dtype)
    w1 = (torch.randn(hidden, k_in, generator=g) / k_in**0.5).to(dtype)
    res = torch.randn(m, hidden, generator=g).to(dtype)
    gamma = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    w2 = (torch.randn(n_out, hidden, generator=g) / hidden**0.5).to(dtype)
    b2 = torch.randn(n_out if act is None else n_out, generator=g).to(dtype) if bias else None
    return x, w1, res, gamma, w2, b2


# hidden 40 with block_n 8: 5 partials; block_k 32 over K 96 / 40: masked K tails
@pytest.mark.parametrize("act", [None, "silu_and_mul", "silu_and_mul_pairs"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_n", [8, 16])
def test_handoff_equals_the_unfused_chain(act, dtype, block_n):
    """Producer epilogue (residual add, s * g, sum-of-squares partials) + consumer (plain
    stream, rstd at the end) == linear, RMSNorm with the residual, linear (+ act)."""
    m, k_in, hidden, n_out, eps = 1, 96, 40, 48, 1e-5
    x, w1, res, gamma, w2, b2 = _chain(m, k_in, hidden, n_out, dtype, seed=21, act=act, bias=act is None)
    cfg1 = dict(use_dot=False, block_n=block_n, block_k=32, num_warps=2, num_stages=1)
    pn, new_res = sg.linear_handoff_triton(x, w1, res, gamma, eps, cfg1)
    assert pn.ss.shape == (m, -(-hidden // block_n))
    cfg2 = dict(use_dot=False, block_n=8, block_k=32, num_warps=2, num_stages=1)
    y, _ = sg.skinny_linear_triton(pn.sg, w2, b2, act=act, eps=pn.eps, config=cfg2, prenormed_ss=pn.ss)

    o = torch.nn.functional.linear(x, w1)
    y_exp, res_exp = ref.skinny_linear_reference(o, w2, b2, residual=res, norm_weight=gamma, eps=eps, act=act)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(new_res, res_exp, **tol)
    torch.testing.assert_close(y, y_exp, **tol)
    # the partials are sum(s^2) of this program's columns: their total is the row's
    torch.testing.assert_close(pn.ss.sum(-1), new_res.float().pow(2).sum(-1), **tol)
    # and the same handed-over state, materialised, is the reference norm
    normed, _ = ref.rms_norm_reference(o, gamma, eps, res)
    torch.testing.assert_close(pn.materialise(), normed, **tol)


def test_handoff_consumer_matches_the_fused_prologue():
    """At bf16 the handoff's consumer and the fused-prologue kernel differ only by the order
    of the sum of squares: their outputs agree to bf16 rounding, and a wrong partial (one
    dropped) is caught."""
    m, k_in, hidden, n_out, eps = 1, 64, 64, 32, 1e-6
    x, w1, res, gamma, w2, _ = _chain(m, k_in, hidden, n_out, torch.bfloat16, seed=5)
    cfg = dict(use_dot=False, block_n=8, block_k=32, num_warps=2, num_stages=1)
    pn, new_res = sg.linear_handoff_triton(x, w1, res, gamma, eps, cfg)
    o, _ = sg.skinny_linear_triton(x, w1, config=cfg)
    y_fused, res_fused = sg.skinny_linear_triton(o, w2, residual=res, norm_weight=gamma, eps=eps, config=cfg)
    y, _ = sg.skinny_linear_triton(pn.sg, w2, eps=eps, config=cfg, prenormed_ss=pn.ss)
    assert torch.equal(new_res, res_fused)
    torch.testing.assert_close(y, y_fused, atol=2e-2, rtol=2e-2)
    bad = pn.ss.clone()
    bad[0, 0] = 0.0
    y_bad, _ = sg.skinny_linear_triton(pn.sg, w2, eps=eps, config=cfg, prenormed_ss=bad)
    assert not torch.allclose(y_bad.float(), y_fused.float(), atol=2e-2, rtol=2e-2)


def test_handoff_applies_only_on_cuda():
    """Off CUDA (and under the interpreter) the producer declines: the model keeps the
    fused-prologue path, which is the reference on the CPU."""
    x, w1, res, gamma, w2, _ = _chain(1, 32, 32, 32, torch.bfloat16, seed=3)
    assert fused_norm_ops.linear_handoff(x, w1, res, gamma, 1e-6, w2) is None


delegate_all(globals(), __file__)  # parent process: each test reports its child run
