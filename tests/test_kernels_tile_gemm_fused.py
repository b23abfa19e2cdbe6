"""The tile GEMM with its split sum, residual add and RMSNorm in one launch
(``kernels.tile_gemm_fused``) under the interpreter, against the two-launch path and the
plain-torch reference (run in an interpreted child pytest: see ``tests/interpreted.py``)."""

import pytest
import torch

from tests.interpreted import INTERPRETED, delegate_all

if INTERPRETED:
    from kernels import tile_gemm, tile_gemm_fused
    from kernels.attention_splits import _semaphores
else:
    tile_gemm = tile_gemm_fused = _semaphores = None  # only the child touches triton


def _cfg(bm, bn, bk, split):
    return dict(block_m=bm, block_n=bn, block_k=bk, split_k=split, num_warps=4, num_stages=2)


def _case(m, n, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    res = torch.randn(m, n, generator=g).to(dtype)
    nw = (1 + torch.rand(n, generator=g)).to(dtype)
    return x, w, res, nw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k,cfg", [
    (5, 40, 96, _cfg(16, 16, 32, 3)),     # 3 ragged N tiles, 3 splits of one chunk
    (16, 64, 128, _cfg(16, 32, 32, 2)),   # a full row block, 2 tiles x 2 splits of 2 chunks
    (19, 48, 64, _cfg(16, 16, 32, 1)),    # 2 row blocks (ragged), no split: tiles still merge
    (8, 96, 256, _cfg(16, 32, 64, 4)),    # 4 splits
    (40, 64, 64, _cfg(32, 16, 32, 2)),    # 2 row blocks of 32, the second ragged
])
def test_fused_add_norm_equals_the_two_launches(monkeypatch, dtype, m, n, k, cfg):
    """The new residual equals the two-launch path's bit for bit; the normalised rows within
    one rounding (the sum of squares reduces per tile, then over tiles), and both within
    float64's exact add + norm."""
    x, w, res, nw = _case(m, n, k, dtype, m * n + k)
    monkeypatch.setenv("SYNCLESS_TILE_FUSED_SUM", "0")
    out2, res2 = tile_gemm.tile_linear_add_norm_triton(x, w, cfg, res, nw, 1e-6)
    monkeypatch.setenv("SYNCLESS_TILE_FUSED_SUM", "1")
    before = _semaphores(x.device, 1, pool="tile_gemm").clone()
    out1, res1 = tile_gemm.tile_linear_add_norm_triton(x, w, cfg, res, nw, 1e-6)
    assert torch.equal(res1, res2)
    one_ulp = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    torch.testing.assert_close(out1, out2, atol=one_ulp * 8, rtol=one_ulp * 2)
    s = x.double() @ w.double().t() + res.double()
    exact = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * nw.double()
    torch.testing.assert_close(out1.double(), exact, atol=5e-2, rtol=5e-2)
    # every counter re-armed for the next launch / graph replay
    assert torch.equal(_semaphores(x.device, 1, pool="tile_gemm"), before)
    assert int(before.abs().sum()) == 0


@pytest.mark.parametrize("dtype,use", [  # logits: 16-bit GEMMs widened to float32
    (dt, use) for dt in (torch.float32, torch.bfloat16, torch.float16)
    for use in ("plain", "act", "logits") if (dt, use) != (torch.float32, "logits")])
@pytest.mark.parametrize("m,n,k,cfg", [
    (5, 40, 96, _cfg(16, 16, 32, 3)),     # ragged N tiles, 3 splits
    (40, 64, 128, _cfg(32, 32, 32, 2)),   # 2 row blocks, the second ragged
    (8, 96, 256, _cfg(16, 32, 64, 4)),    # 4 splits
])
def test_fused_split_sum_equals_the_two_launches(monkeypatch, dtype, use, m, n, k, cfg):
    """Plain, SiLU*mul pairs and float32 logits: the split sum in the GEMM's launch gives the
    two-launch path's result bit for bit (the same float32 order, the same rounding)."""
    x, w, _, _ = _case(m, n, k, dtype, m + n + k)
    kw = dict(act="silu_and_mul_pairs") if use == "act" else (
        dict(out_dtype=torch.float32) if use == "logits" else {})
    monkeypatch.setenv("SYNCLESS_TILE_FUSED_SUM", "0")
    two = tile_gemm.tile_linear_triton(x, w, cfg, **kw)
    monkeypatch.setenv("SYNCLESS_TILE_FUSED_SUM", "1")
    one = tile_gemm.tile_linear_triton(x, w, cfg, **kw)
    assert one.dtype == two.dtype and torch.equal(one, two)
    ref = tile_gemm.tile_linear_reference(x, w, **kw)
    torch.testing.assert_close(one.float(), ref.float(), atol=3e-2, rtol=3e-2)
    assert int(_semaphores(x.device, 1, pool="tile_gemm").abs().sum()) == 0  # re-armed


def test_fused_launches_back_to_back_see_their_own_inputs(monkeypatch):
    """Consecutive launches reuse the counters: each result is its own inputs' (a counter
    left armed would make a later launch's last program skip or repeat the merge)."""
    monkeypatch.setenv("SYNCLESS_TILE_FUSED_SUM", "1")
    cfg = _cfg(16, 16, 32, 2)
    for seed in range(3):
        x, w, res, nw = _case(7, 48, 64, torch.float32, 100 + seed)
        out, new_res = tile_gemm.tile_linear_add_norm_triton(x, w, cfg, res, nw, 1e-6)
        s = x.double() @ w.double().t() + res.double()
        torch.testing.assert_close(new_res.double(), s, atol=1e-5, rtol=1e-5)
        exact = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * nw.double()
        torch.testing.assert_close(out.double(), exact, atol=1e-5, rtol=1e-5)


def test_fused_path_normalises_in_row_chunks_and_declines_too_wide_rows(monkeypatch):
    """Step 3 normalises ``MAX_FUSED_ELEMS // next_pow2(N)`` rows at a time (a 32-row block of
    1,024 columns: two chunks of 16); a row wider than ``MAX_FUSED_ELEMS`` does not fit the
    last program's registers: the fused entry point declines and the caller takes two
    launches. Here with the limit lowered, so that small shapes take several chunks."""
    assert tile_gemm_fused.rows_a_chunk(32, 1024) == 16
    assert tile_gemm_fused.applies(1024)
    assert not tile_gemm_fused.applies(32768)
    monkeypatch.setattr(tile_gemm_fused, "MAX_FUSED_ELEMS", 4 * 64)
    x, w, res, nw = _case(29, 40, 64, torch.float32, 7)  # 4-row chunks of a 32-row block
    cfg = _cfg(32, 16, 32, 2)
    assert tile_gemm_fused.rows_a_chunk(32, 40) == 4
    out, new_res = tile_gemm_fused.tile_linear_add_norm_fused(x, w, cfg, res, nw, 1e-6)
    s = x.double() @ w.double().t() + res.double()
    torch.testing.assert_close(new_res.double(), s, atol=1e-5, rtol=1e-5)
    exact = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * nw.double()
    torch.testing.assert_close(out.double(), exact, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(tile_gemm_fused, "MAX_FUSED_ELEMS", 32)  # not one row of 40 (64)
    assert tile_gemm_fused.tile_linear_add_norm_fused(x, w, cfg, res, nw, 1e-6) is None


delegate_all(globals(), __file__)  # parent process: each test reports its child run
