"""GPU tests of the one-launch split sum (``kernels.tile_gemm_fused``, ``SYNCLESS_TILE_FUSED_SUM``)
at the Qwen3-0.6B decode shapes: equal to the two-launch path (the arrival counters order the
partials' stores before the last program's loads on a real GPU, which the interpreter's
sequential programs cannot show), eagerly and replayed in a CUDA graph with new inputs."""

import pytest
import torch

from tests.test_gpu_tile_gemm import _cfg

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CASES = [  # (m, n, k, config, use): the shipped table's configs and the gate_up candidate
    (8, 1024, 2048, _cfg(16, 64, 64, 8, stages=4), "add_norm"),      # o_proj, 2-16 rows
    (16, 1024, 3072, _cfg(16, 32, 128, 8), "add_norm"),              # down, 2-16 rows
    (24, 1024, 3072, _cfg(32, 32, 128, 8), "add_norm"),              # down, 17-32 rows
    (100, 1024, 2048, _cfg(64, 32, 64, 4, stages=4), "add_norm"),    # o_proj, 2 row blocks
    (8, 6144, 1024, _cfg(16, 32, 64, 2, stages=4), "act"),           # gate|up pairs
    (40, 1024, 2048, _cfg(32, 32, 128, 4), "plain"),
]


def _run(x, w, cfg, use, res, nw):
    from kernels.tile_gemm import tile_linear_add_norm_triton, tile_linear_triton

    if use == "add_norm":
        return tile_linear_add_norm_triton(x, w, cfg, res, nw, 1e-6)
    return (tile_linear_triton(x, w, cfg, act="silu_and_mul_pairs" if use == "act" else None),)


def _inputs(m, n, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).to(torch.bfloat16)
    res = torch.randn(m, n, device="cuda", generator=g).to(torch.bfloat16)
    nw = (torch.rand(n, device="cuda", generator=g) + 0.5).to(torch.bfloat16)
    return x, w, res, nw


def _same(fused, two, use):
    if use == "add_norm":  # the new residual bit for bit; the normed rows within one rounding
        assert torch.equal(fused[1], two[1])
        torch.testing.assert_close(fused[0], two[0], atol=2e-2, rtol=1e-2)
    else:
        assert torch.equal(fused[0], two[0])


@cuda
@pytest.mark.parametrize("m,n,k,cfg,use", CASES)
def test_fused_split_sum_equals_two_launches_on_gpu(monkeypatch, m, n, k, cfg, use):
    x, w, res, nw = _inputs(m, n, k, m + n)
    monkeypatch.setenv("SYNCLESS_TILE_FUSED_SUM", "0")
    two = _run(x, w, cfg, use, res, nw)
    monkeypatch.setenv("SYNCLESS_TILE_FUSED_SUM", "1")
    for _ in range(3):  # back to back: the counters re-arm
        _same(_run(x, w, cfg, use, res, nw), two, use)


@cuda
@pytest.mark.parametrize("m,n,k,cfg,use", [CASES[0], CASES[3], CASES[4]])
def test_fused_split_sum_in_cuda_graph_replays(monkeypatch, m, n, k, cfg, use):
    """Captured once, replayed with new inputs: each replay equals the two-launch path on
    those inputs, and the counters are all re-armed after the replays."""
    from kernels.attention_splits import _semaphores

    x, w, res, nw = _inputs(m, n, k, 1)
    monkeypatch.setenv("SYNCLESS_TILE_FUSED_SUM", "1")
    _run(x, w, cfg, use, res, nw)  # compiles, allocates the counters outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _run(x, w, cfg, use, res, nw)
    for seed in (2, 3, 4):
        x2, _, res2, _ = _inputs(m, n, k, seed)
        x.copy_(x2)
        res.copy_(res2)
        graph.replay()
        torch.cuda.synchronize()
        monkeypatch.setenv("SYNCLESS_TILE_FUSED_SUM", "0")
        _same([o.clone() for o in outs], _run(x, w, cfg, use, res, nw), use)
        monkeypatch.setenv("SYNCLESS_TILE_FUSED_SUM", "1")
    assert int(_semaphores(x.device, 1, pool="tile_gemm").abs().sum()) == 0
