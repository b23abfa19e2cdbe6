"""The RMSNorm handoff (``kernels.norm_handoff``) on CUDA (``-m gpu``) at the Llama-3.1-8B
batch-1 shapes that take it: o_proj -> norm + gate|up (pairs) and down -> norm + QKV, against
the fp64 reference chain and the fused-prologue path, eagerly and with PDL inside a CUDA graph.
Every call runs under ``torch.cuda.set_sync_debug_mode("error")``."""

import pytest
import torch

from tests.kernels.test_kernels_gpu import no_sync, use_kernel_settings

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _case(k_in, hidden, n_out, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, k_in, device="cuda", generator=g).to(torch.bfloat16)
    w1 = (torch.randn(hidden, k_in, device="cuda", generator=g) / k_in**0.5).to(**bf)
    res = torch.randn(1, hidden, device="cuda", generator=g).to(**bf)
    gamma = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=g)).to(**bf)
    w2 = (torch.randn(n_out, hidden, device="cuda", generator=g) / hidden**0.5).to(**bf)
    return x, w1, res, gamma, w2


@pytest.mark.parametrize(
    "k_in,hidden,n_out,act",
    [
        (4096, 4096, 28672, "silu_and_mul_pairs"),  # o_proj -> gate|up
        (14336, 4096, 6144, None),  # down -> QKV
    ],
)
@pytest.mark.parametrize("graph", [False, True])
def test_handoff_matches_reference_and_fused_path(k_in, hidden, n_out, act, graph, monkeypatch):
    from kernels import fused_norm_ops, ops, reference

    use_kernel_settings(monkeypatch, pdl="on")
    x, w1, res, gamma, w2 = _case(k_in, hidden, n_out, seed=hidden + n_out)
    eps = 1e-5

    def handoff():
        handed = fused_norm_ops.linear_handoff(x, w1, res, gamma, eps, w2, act)
        assert handed is not None, "the 8B batch-1 shapes take the handoff"
        return fused_norm_ops.linear_prenormed(handed[0], w2, act=act), handed[1]

    def fused():
        o, _ = ops.linear(x, w1)
        return ops.linear(o, w2, residual=res, norm_weight=gamma, eps=eps, act=act)

    with no_sync():
        if graph:
            handoff()  # compile outside the capture
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                y, new_res = handoff()
            g.replay()
        else:
            y, new_res = handoff()
        y_f, res_f = fused()
    torch.cuda.synchronize()
    o64 = torch.nn.functional.linear(x.double(), w1.double()).to(torch.bfloat16)
    y_ref, res_ref = reference.skinny_linear_reference(
        o64.double(), w2.double(), residual=res.double(), norm_weight=gamma.double(), eps=eps, act=act
    )
    assert torch.equal(new_res, res_f)
    torch.testing.assert_close(new_res.double(), res_ref, atol=2e-2, rtol=2e-2)
    err = (y.double() - y_ref).abs().max() / y_ref.abs().max()
    err_f = (y_f.double() - y_ref).abs().max() / y_ref.abs().max()
    assert err < 2e-2 and err <= 2 * err_f + 1e-3, (err, err_f)
