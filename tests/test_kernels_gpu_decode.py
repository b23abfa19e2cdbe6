"""Decode-path kernels added for batch-1 latency, on CUDA (``-m gpu``): the split Triton
argmax against ``torch.argmax``, the skinny GEMM with its bulk L2 prefetch of each
program's weight rows (eagerly and inside a CUDA graph) and the one-launch step-input
preparation against its torch reference. Every call runs under
``torch.cuda.set_sync_debug_mode("error")``. Imports fine on a CPU-only machine."""

import pytest
import torch

from tests.test_kernels_gpu import no_sync, reference_fp64, rel_err, skinny_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("rows,vocab", [(1, 128256), (7, 151936), (256, 151936), (3, 1000)])
def test_argmax_matches_torch(rows, vocab):
    from kernels.argmax import argmax_triton

    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, vocab, device="cuda", generator=g) * 4
    x[0, vocab - 1] = 1e4  # the winner in the last, ragged tile
    if rows > 2:
        x[1, 5] = x[1, vocab // 2] = 1e4  # a tie across splits: the lower index
        x[2, vocab // 3] = float("nan")
    with no_sync():
        got = argmax_triton(x)
        got_bf16 = argmax_triton(x.to(torch.bfloat16))
    assert torch.equal(got, x.argmax(dim=-1))
    assert torch.equal(got_bf16, x.to(torch.bfloat16).argmax(dim=-1))


PREFETCH = 4096  # bytes of each row (K = 1000 rows are shorter: whole rows)


@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("variant", ["plain", "norm_res", "norm_res_act", "norm_act_bias"])
@pytest.mark.parametrize("n,k", [(4096, 1024), (1000, 1000), (2 * 1042, 4096)])
def test_skinny_linear_with_l2_prefetch(n, k, variant, m):
    """The prefetch only hints the cache: results equal the reference (ragged last rows too)."""
    from kernels.skinny_gemm import fallback_config, skinny_linear_triton

    x, w, kw = skinny_inputs(m, n, k, variant)
    cfg = dict(fallback_config(m), prefetch_l2=PREFETCH)
    with no_sync():
        y, _ = skinny_linear_triton(x, w, config=cfg, **kw)
    assert rel_err(y, reference_fp64(x, w, kw)[0]) < 1e-2


def test_skinny_linear_l2_prefetch_in_cuda_graph():
    from kernels.skinny_gemm import fallback_config, skinny_linear_triton

    x, w, kw = skinny_inputs(1, 6144, 1024, "norm_res_act")
    cfg = dict(fallback_config(1), prefetch_l2=True)
    xs = x.clone()
    skinny_linear_triton(xs, w, config=cfg, **kw)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, _ = skinny_linear_triton(xs, w, config=cfg, **kw)
    for _ in range(3):
        xs.copy_(torch.randn_like(xs))
        g.replay()
        torch.cuda.synchronize()
        assert rel_err(out, reference_fp64(xs, w, kw)[0]) < 1e-2


@pytest.mark.parametrize("q_lens,short", [([1], False), ([1] * 64, False), ([3, 1, 17, 5], True)])
def test_prepare_inputs_matches_reference(q_lens, short):
    from kernels import reference as ref
    from kernels.input_prep import prepare_inputs_triton
    from tests.test_kernels_input_prep import make_case

    case = [t.cuda() if torch.is_tensor(t) else t for t in make_case(q_lens, short_capacity=short)]
    with no_sync():
        got = prepare_inputs_triton(*case)
    for g_, w in zip(got, ref.prepare_inputs_reference(*case)):
        assert g_.dtype == w.dtype and torch.equal(g_, w)
