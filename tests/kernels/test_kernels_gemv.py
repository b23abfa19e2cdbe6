"""The persistent batch-1 GEMV (``kernels.gemv``) under the interpreter against
``kernels.reference.skinny_linear_reference`` (run in an interpreted child pytest: see
``tests/interpreted.py``)."""

import pytest
import torch

from kernels import reference as ref
from tests.interpreted import INTERPRETED, delegate_all
from tests.kernels.test_kernels_skinny import SKINNY_CASES, skinny_case

if INTERPRETED:
    from kernels import gemv
else:
    gemv = None  # only the child touches triton

# the skinny GEMM's cases and inputs: the GEMV has the same contract at M = 1 (but only
# the stacked gate|up layout; the interleaved one is the skinny GEMM's)
CASES = {name: spec for name, spec in SKINNY_CASES.items() if "pairs" not in name}


def make_case(n, k, dtype, spec, seed):
    return skinny_case(1, n, k, dtype, spec, seed=seed)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "n,k,block_k,programs",
    [
        (40, 96, 32, 3),  # 10 row blocks over 3 programs (4/3/3 rounds), K in 3 exact chunks
        (38, 96, 64, 4),  # ragged last row block, a masked K tail, 2-3 rounds
        (24, 64, 64, 64),  # more programs allowed than row blocks: one block each, one K chunk
    ],
)
def test_gemv_matches_reference(case, dtype, n, k, block_k, programs):
    spec = CASES[case]
    x, w, kw = make_case(n * (2 if spec.get("act") else 1), k, dtype, spec, seed=n + k)
    cfg = dict(block_n=4, block_k=block_k, num_warps=2)
    y, new_res = gemv.gemv_triton(x, w, config=cfg, max_programs=programs, **kw)
    y_exp, res_exp = ref.skinny_linear_reference(x, w, **kw)
    assert y.shape == y_exp.shape and y.dtype == y_exp.dtype
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(y, y_exp, **tol)
    if "residual" in kw:
        # bf16: the interpreter's fp32 -> bf16 cast is not round-to-nearest (one ulp apart)
        res_tol = dict(atol=0, rtol=0) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(new_res, res_exp, **res_tol)
    else:
        assert new_res is None


def test_gemv_every_output_row_written_once():
    # Random weights with a distinct row each: a row block skipped or computed twice by the
    # flat (row block, K chunk) walk shows up as a wrong row, not only as a tolerance miss.
    x, w, kw = make_case(52, 128, torch.float32, {}, seed=3)
    for programs in (1, 2, 5, 13, 100):
        y, _ = gemv.gemv_triton(x, w, config=dict(block_n=4, block_k=32, num_warps=1), max_programs=programs)
        torch.testing.assert_close(y, x @ w.T, atol=1e-4, rtol=1e-4)


def test_gemv_grid_size_balances_rounds():
    assert gemv.grid_size(1536, 528) == 512  # 3 rounds each, not 2.9
    assert gemv.grid_size(10, 3) == 3
    assert gemv.grid_size(5, 64) == 5
    assert gemv.grid_size(3584, 528) == 512  # 7 rounds each
    for n_blocks in range(1, 200):
        for cap in (1, 7, 64):
            p = gemv.grid_size(n_blocks, cap)
            assert 1 <= p <= cap and -(-n_blocks // p) == -(-n_blocks // cap)


def test_gemv_bad_input():
    with pytest.raises(ValueError, match=r"x \[1, K\]"):
        gemv.gemv_triton(torch.randn(2, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match="unknown activation"):
        gemv.gemv_triton(torch.randn(1, 8), torch.randn(4, 8), act="gelu")
    with pytest.raises(ValueError, match="residual"):
        gemv.gemv_triton(torch.randn(1, 8), torch.randn(4, 8), residual=torch.randn(1, 8))
    with pytest.raises(ValueError, match="even"):
        gemv.gemv_triton(torch.randn(1, 8), torch.randn(5, 8), act="silu_and_mul")


delegate_all(globals(), __file__)
