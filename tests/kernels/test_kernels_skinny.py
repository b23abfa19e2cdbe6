"""The skinny GEMM (``kernels.skinny_gemm``: decode-sized batches, fused RMSNorm prologue,
SiLU*mul epilogue, peeled first chunks) under the interpreter against
``kernels.reference.skinny_linear_reference`` (run in an interpreted child pytest: see
``tests/interpreted.py``)."""

import pytest
import torch

from kernels import reference as ref
from tests.interpreted import INTERPRETED, delegate_all
from tests.kernels.test_kernels import TOL

if INTERPRETED:
    from kernels import skinny_gemm as sg
else:
    sg = None  # only the child touches triton

SKINNY_CASES = {  # name -> kwargs of skinny_linear (besides x, weight)
    "plain": {},
    "bias": {"bias": True},
    "norm": {"norm": True},
    "norm_residual": {"norm": True, "residual": True},
    "norm_residual_act": {"norm": True, "residual": True, "act": "silu_and_mul"},
    "act_bias_fp32_out": {"bias": True, "act": "silu_and_mul", "out_dtype": torch.float32},
    "norm_residual_act_pairs": {"norm": True, "residual": True, "act": "silu_and_mul_pairs"},
    "act_pairs_bias_fp32_out": {"bias": True, "act": "silu_and_mul_pairs", "out_dtype": torch.float32},
}


def skinny_case(m, n, k, dtype, spec, seed=11):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    kw = {"act": spec.get("act"), "out_dtype": spec.get("out_dtype")}
    if spec.get("bias"):
        kw["bias"] = torch.randn(n, generator=g).to(dtype)
    if spec.get("norm"):
        kw["norm_weight"] = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype)
        kw["eps"] = 1e-5
    if spec.get("residual"):
        kw["residual"] = torch.randn(m, k, generator=g).to(dtype)
    return x, w, kw


@pytest.mark.parametrize("case", list(SKINNY_CASES))
@pytest.mark.parametrize("m", [1, 5, 16, 33])  # 33: BLOCK_M 64 with masked rows
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_skinny_linear_dot(case, m, dtype):
    # k=96 with block_k 64: a masked K tail; n=40: a masked N tail
    x, w, kw = skinny_case(m, 40, 96, dtype, SKINNY_CASES[case])
    cfg = dict(use_dot=True, block_n=16, block_k=64, num_warps=4, num_stages=2)
    y, new_res = sg.skinny_linear_triton(x, w, config=cfg, **kw)
    y_exp, res_exp = ref.skinny_linear_reference(x, w, **kw)
    assert y.shape == y_exp.shape and y.dtype == y_exp.dtype
    tol = TOL[dtype] if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(y, y_exp, **tol)
    if "residual" in kw:
        torch.testing.assert_close(new_res, res_exp, **TOL[dtype])
    else:
        assert new_res is None


# W tiles loaded in the loop, register double-buffered, or the first one peeled (as
# before a PDL wait)
@pytest.mark.parametrize("w_tiles", ["loop", "prefetch", "preload", "preload2"])
@pytest.mark.parametrize("case", ["plain", "norm_residual_act", "act_bias_fp32_out", "norm_residual_act_pairs"])
# K=96: 32 divides it (no K mask), 64 leaves a tail, 128 is one masked chunk
@pytest.mark.parametrize("block_k", [32, 64, 128])
def test_skinny_linear_fma_batch_of_one(case, block_k, w_tiles):
    x, w, kw = skinny_case(1, 24, 96, torch.float32, SKINNY_CASES[case], seed=12)
    cfg = dict(
        use_dot=False,
        block_n=8,
        block_k=block_k,
        num_warps=2,
        num_stages=1,
        prefetch=w_tiles == "prefetch",
        preload={"preload": 1, "preload2": 2}.get(w_tiles, 0),
    )
    y, new_res = sg.skinny_linear_triton(x, w, config=cfg, **kw)
    y_exp, res_exp = ref.skinny_linear_reference(x, w, **kw)
    torch.testing.assert_close(y, y_exp, **TOL[torch.float32])
    if "residual" in kw:
        torch.testing.assert_close(new_res, res_exp, **TOL[torch.float32])


@pytest.mark.parametrize("m", [1, 2])  # the FMA path; the dot path (a second row to clobber)
@pytest.mark.parametrize("case", ["norm_residual", "norm_residual_act_pairs"])
def test_skinny_peeled_second_chunk_past_k_is_skipped(case, m):
    """K == BLOCK_K with two chunks peeled: the second is past K and must be skipped, not
    masked. x and the residual are column views of NaN-padded rows, so a read past K shows
    in y and a residual store past K lands in the next row of the new residual."""
    x, w, kw = skinny_case(m, 16, 64, torch.float32, SKINNY_CASES[case], seed=15)
    pad = torch.full((m, 128), float("nan"))
    xs, rs = pad.clone(), pad.clone()
    xs[:, :64], rs[:, :64] = x, kw["residual"]
    kw_view = dict(kw, residual=rs[:, :64])
    cfg = dict(use_dot=m > 1, block_n=8, block_k=64, num_warps=2, num_stages=1, preload=2)
    y, new_res = sg.skinny_linear_triton(xs[:, :64], w, config=cfg, **kw_view)
    y_exp, res_exp = ref.skinny_linear_reference(x, w, **kw)
    torch.testing.assert_close(y, y_exp, **TOL[torch.float32])
    torch.testing.assert_close(new_res, res_exp, **TOL[torch.float32])


@pytest.mark.parametrize("case", ["plain", "norm_residual_act", "norm_residual_act_pairs"])
@pytest.mark.parametrize("block_k,preload", [(64, 1), (128, 1), (32, 2), (64, 2), (128, 2)])
def test_skinny_linear_dot_first_chunks_peeled(case, block_k, preload):
    # K=96: with 2 chunks peeled, 32 leaves a loop, 64 peels all, 128 has no second chunk
    x, w, kw = skinny_case(5, 40, 96, torch.bfloat16, SKINNY_CASES[case], seed=13)
    cfg = dict(use_dot=True, block_n=16, block_k=block_k, num_warps=4, num_stages=2, preload=preload)
    y, new_res = sg.skinny_linear_triton(x, w, config=cfg, **kw)
    y_exp, res_exp = ref.skinny_linear_reference(x, w, **kw)
    torch.testing.assert_close(y, y_exp, atol=3e-2, rtol=3e-2)
    if "residual" in kw:
        torch.testing.assert_close(new_res, res_exp, **TOL[torch.bfloat16])


@pytest.mark.parametrize("bad", [3, -1, 1.5, "1"])
def test_skinny_preload_rejects_bad_values(bad):
    x, w, kw = skinny_case(1, 8, 32, torch.float32, {}, seed=14)
    with pytest.raises(ValueError, match="preload must be one of"):
        sg.skinny_linear_triton(
            x, w, config=dict(use_dot=False, block_n=8, block_k=32, num_warps=1, num_stages=1, preload=bad)
        )


def test_skinny_config_selection_uses_cpu_shapes_only():
    assert sg.m_class(1) == 1 and sg.m_class(16) == 16 and sg.m_class(17) is None
    assert sg.kind_of(True, True, True) == "norm_act" and sg.kind_of(False, False, True) == "plain_f32"
    assert sg.select_config(32, 64, 64, "plain") is None  # large batches: cuBLAS
    cfg = sg.select_config(1, 12345, 678, "plain")  # an untuned shape: the class default
    assert cfg == sg.DEFAULTS[("plain", 1)]
    x, w, kw = skinny_case(7, 40, 64, torch.float32, SKINNY_CASES["norm_residual"], seed=14)
    y, _ = sg.skinny_linear_triton(x, w, **kw)  # no config: selection, then fallback
    torch.testing.assert_close(y, ref.skinny_linear_reference(x, w, **kw)[0], **TOL[torch.float32])


def test_skinny_linear_wrong_eps_and_padded_rows():
    x, w, kw = skinny_case(3, 32, 64, torch.float32, SKINNY_CASES["norm_residual"], seed=13)
    y_exp, _ = ref.skinny_linear_reference(x, w, **kw)
    bad, _ = sg.skinny_linear_triton(x, w, **dict(kw, eps=1.0))
    assert not torch.allclose(bad, y_exp, atol=1e-3, rtol=1e-3)
    # rows beyond M are neither read into the result nor written
    y, _ = sg.skinny_linear_triton(x[:2], w, **dict(kw, residual=kw["residual"][:2]))
    torch.testing.assert_close(y, y_exp[:2], **TOL[torch.float32])


@pytest.mark.parametrize("use_dot", [False, True])
def test_skinny_pairs_layout_equals_stacked(use_dot):
    """The interleaved gate|up weight gives bit for bit the stacked weight's output."""
    m = 1 if not use_dot else 3
    x, w, kw = skinny_case(m, 48, 64, torch.bfloat16, SKINNY_CASES["norm_residual_act"], seed=15)
    inter = w.shape[0] // 2
    w_pairs = torch.stack([w[:inter], w[inter:]], dim=1).reshape_as(w)
    cfg = dict(use_dot=use_dot, block_n=8, block_k=32, num_warps=2, num_stages=1, prefetch=True)
    y, res = sg.skinny_linear_triton(x, w, config=cfg, **kw)
    y_p, res_p = sg.skinny_linear_triton(x, w_pairs, config=cfg, **dict(kw, act="silu_and_mul_pairs"))
    assert torch.equal(y, y_p) and torch.equal(res, res_p)
    y_wrong, _ = sg.skinny_linear_triton(x, w, config=cfg, **dict(kw, act="silu_and_mul_pairs"))
    assert not torch.allclose(y_wrong.float(), y.float(), atol=1e-2, rtol=1e-2)


delegate_all(globals(), __file__)  # parent process: each test reports its child run
