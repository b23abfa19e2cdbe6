"""FP8 weight-only (W8A16) skinny GEMM: e4m3 weights with per-row scales times 16-bit
activations (``kernels.skinny_gemm`` with ``weight_scale``) under the interpreter against
``kernels.reference.skinny_linear_reference(..., weight_scale=)`` (an interpreted child pytest:
see ``tests/interpreted.py``), ``kernels.ops.linear``'s FP8 routing by batch size on the CPU,
sm_90 compiles on this CPU, and GPU tests at the Llama-3.1-8B shapes (``-m gpu``).

The FP8 weights are built on the host by torch (the interpreter's float -> e4m3 cast is
wrong, see ``kernels.fp8_quant``); its e4m3 -> float widening is exact for every finite code
(checked below), so the kernel needs no interpreter workaround."""

import pytest
import torch

from kernels import reference as ref
from kernels.fp8_reference import quantize_rows_reference, quantize_weight_fp8
from tests.interpreted import INTERPRETED, delegate_all
from tests.kernels.test_kernels import TOL
from tests.kernels.test_kernels_skinny import SKINNY_CASES, skinny_case

if INTERPRETED:
    import triton
    import triton.language as tl

    from kernels import skinny_gemm as sg

    @triton.jit
    def _widen_kernel(q_ptr, f32_ptr, bf16_ptr, f16_ptr):
        offs = tl.arange(0, 256)
        q = tl.load(q_ptr + offs)
        tl.store(f32_ptr + offs, q.to(tl.float32))
        tl.store(bf16_ptr + offs, q.to(tl.bfloat16))
        tl.store(f16_ptr + offs, q.to(tl.float16))
else:
    sg = None  # only the child touches triton

FP8 = torch.float8_e4m3fn
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def fp8_case(m, n, k, dtype, spec, seed=11):
    """``skinny_case`` with its weight quantized to e4m3 on the host: ``(x, wq, ws, kw)``."""
    x, w, kw = skinny_case(m, n, k, dtype, spec, seed)
    wq, ws = quantize_weight_fp8(w.float())
    return x, wq, ws, kw


def _check(x, wq, ws, kw, cfg, tol):
    y, new_res = sg.skinny_linear_triton(x, wq, config=cfg, weight_scale=ws, **kw)
    y_exp, res_exp = ref.skinny_linear_reference(x, wq, weight_scale=ws, **kw)
    assert y.shape == y_exp.shape and y.dtype == y_exp.dtype
    torch.testing.assert_close(y, y_exp, **tol)
    if "residual" in kw:
        torch.testing.assert_close(new_res, res_exp, **TOL.get(x.dtype, TOL[torch.bfloat16]))
    else:
        assert new_res is None


def _tol(dtype):
    return TOL[torch.float32] if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)


def test_interpreter_widens_every_finite_e4m3_code_exactly():
    """All 256 codes to float32 / bf16 / fp16 against torch: exact, except the two NaN codes
    (0x7f, 0xff), which the interpreter reads as +-480; a quantized weight never holds them
    (values are clamped to +-448)."""
    q = torch.arange(256, dtype=torch.uint8).view(FP8)
    outs = [torch.empty(256, dtype=d) for d in (torch.float32, torch.bfloat16, torch.float16)]
    _widen_kernel[(1,)](q, *outs)
    exp = q.float()
    finite = ~exp.isnan()
    assert int(finite.sum()) == 254
    for out in outs:
        assert torch.equal(out.float()[finite], exp[finite])
    assert outs[0][~finite].abs().tolist() == [480.0, 480.0]  # (NaN in torch and on the GPU)


@pytest.mark.parametrize("case", list(SKINNY_CASES))
@pytest.mark.parametrize("m", [1, 3, 16, 40])  # 40: a 64-row M block (FP8's 33-64 class)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_skinny_dot(case, m, dtype):
    # k=96 with block_k 64: a masked K tail; n=40: a masked N tail
    x, wq, ws, kw = fp8_case(m, 40, 96, dtype, SKINNY_CASES[case])
    cfg = dict(use_dot=True, block_n=16, block_k=64, num_warps=4, num_stages=2)
    _check(x, wq, ws, kw, cfg, _tol(dtype))


@pytest.mark.parametrize("w_tiles", ["loop", "prefetch", "preload", "preload2"])
@pytest.mark.parametrize("case", list(SKINNY_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_skinny_fma_batch_of_one(case, w_tiles, dtype):
    x, wq, ws, kw = fp8_case(1, 24, 96, dtype, SKINNY_CASES[case], seed=12)
    cfg = dict(
        use_dot=False,
        block_n=8,
        block_k=64,
        num_warps=2,
        num_stages=1,
        prefetch=w_tiles == "prefetch",
        preload={"preload": 1, "preload2": 2}.get(w_tiles, 0),
    )
    _check(x, wq, ws, kw, cfg, _tol(dtype))


def test_fp8_scale_is_per_weight_row():
    """Unit FP8 weights with one distinct scale a row: y[:, n] = sum(x) * scale[n], for the
    stacked gate|up rows (the up half's scales at I + n) and the row pairs alike."""
    x = torch.rand(2, 32) + 0.5
    wq = torch.ones(16, 32).to(FP8)
    ws = torch.arange(1, 17, dtype=torch.float32) / 16
    for use_dot, m in ((False, 1), (True, 2)):
        cfg = dict(use_dot=use_dot, block_n=4, block_k=32, num_warps=1, num_stages=1)
        y, _ = sg.skinny_linear_triton(x[:m], wq, config=cfg, weight_scale=ws)
        torch.testing.assert_close(y, x[:m].sum(1, keepdim=True) * ws, **TOL[torch.float32])
        for act in ("silu_and_mul", "silu_and_mul_pairs"):
            y, _ = sg.skinny_linear_triton(x[:m], wq, config=cfg, weight_scale=ws, act=act)
            y_exp, _ = ref.skinny_linear_reference(x[:m], wq, weight_scale=ws, act=act)
            torch.testing.assert_close(y, y_exp, **TOL[torch.float32])


def test_fp8_weight_scale_is_validated():
    x, wq, ws, kw = fp8_case(1, 16, 32, torch.bfloat16, {})
    cfg = dict(use_dot=False, block_n=8, block_k=32, num_warps=1, num_stages=1)
    with pytest.raises(ValueError, match="needs its weight_scale"):
        sg.skinny_linear_triton(x, wq, config=cfg)
    with pytest.raises(ValueError, match="goes with an FP8 weight"):
        sg.skinny_linear_triton(x, wq.to(torch.bfloat16), config=cfg, weight_scale=ws)
    for bad in (ws.double(), ws[:8], torch.stack([ws, ws], 1)[:, 0]):
        with pytest.raises(ValueError, match="weight_scale must be"):
            sg.skinny_linear_triton(x, wq, config=cfg, weight_scale=bad)
    with pytest.raises(ValueError, match="goes with an FP8 weight"):  # the handoff: 16-bit only
        g = torch.ones(16, dtype=torch.bfloat16)
        sg.launch_skinny(
            x,
            wq,
            None,
            x.new_empty(1, 16),
            x.new_zeros(1, 16),
            g,
            x.new_empty(1, 16),
            torch.empty(1, 2),
            1e-6,
            None,
            cfg,
            epi_norm=True,
            weight_scale=ws,
        )
    with pytest.raises(AssertionError, match="pre-normed"):
        sg.skinny_linear_triton(x, wq, config=cfg, weight_scale=ws, prenormed_ss=torch.ones(1, 2))


@pytest.mark.parametrize("case", ["norm_residual_act_pairs", "act_bias_fp32_out", "plain"])
def test_ops_linear_fp8_routes_by_batch_size(case):
    """On the CPU: up to ``SKINNY_MAX_M`` rows the weight-only reference (``input_scale``
    ignored), from ``SKINNY_MAX_M + 1`` the W8A8 one (quantized activations), as on the GPU."""
    from kernels import ops

    assert ops.SKINNY_MAX_M == 16
    spec = SKINNY_CASES[case]
    for m in (1, 16, 17):
        x, wq, ws, kw = fp8_case(m, 48, 64, torch.bfloat16, spec, seed=m)
        static = torch.tensor([0.05])
        y, new_res = ops.linear(x, wq, weight_scale=ws, input_scale=static, **kw)
        if m <= 16:
            y_exp, res_exp = ref.skinny_linear_reference(x, wq, weight_scale=ws, **kw)
        else:
            xn, res_exp = x, None
            if kw.get("norm_weight") is not None:
                xn, res_exp = ref.rms_norm_reference(x, kw["norm_weight"], kw["eps"], kw.get("residual"))
            xq, xs = quantize_rows_reference(xn, static)
            y_exp = (xq.float() @ wq.float().T) * xs[:, None] * ws[None, :]
            y_exp = (y_exp + kw["bias"].float() if kw.get("bias") is not None else y_exp).to(x.dtype)
            if kw.get("act"):
                y_exp = ref.silu_and_mul_reference(y_exp, pairs=kw["act"] == "silu_and_mul_pairs")
            y_exp = y_exp.to(kw["out_dtype"]) if kw.get("out_dtype") else y_exp
        assert torch.equal(y, y_exp), m
        assert (new_res is None) == (res_exp is None) and (new_res is None or torch.equal(new_res, res_exp))


# ---- compiled for Hopper on this CPU (no device; in the parent process, not interpreted) ----


@pytest.mark.parametrize(
    "variant",
    [
        dict(USE_DOT=False, PREFETCH=False, PRELOAD=1, ACT=2, BLOCK_N=8),  # batch 1, gate|up pairs
        dict(USE_DOT=False, PREFETCH=True, ACT=1, BLOCK_N=4),
        dict(USE_DOT=False, PREFETCH=False, PRELOAD=2, ACT=0, HAS_NORM=False, HAS_RES=False, BLOCK_N=8),
        dict(USE_DOT=True, PREFETCH=False, PRELOAD=1, ACT=2, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256),
        dict(USE_DOT=True, PREFETCH=False, ACT=1, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256),
    ],
)
@pytest.mark.skipif(INTERPRETED, reason="compiles the real kernel: the parent process runs it")
def test_compile_fp8_skinny_for_hopper(variant):
    """The FP8 variants compile for sm_90: e4m3 tiles widened in registers."""
    from kernels.skinny_gemm_kernel import _skinny_kernel
    from tests.kernels.test_kernels_compile import SKINNY, _compile

    const = {**SKINNY, **variant, "HAS_WSCALE": True}
    compiled = _compile(
        _skinny_kernel, const, {"ss_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32"}, floats=("eps",)
    )
    assert "e4m3" in compiled.asm["ptx"]


# ---- GPU (run with -m gpu) ----

GPU_SHAPES = {  # Llama-3.1-8B decode projections: (N, K, variant)
    "qkv": (6144, 4096, "norm_res"),
    "o_proj": (4096, 4096, "plain"),
    "gate_up": (28672, 4096, "norm_res_act_pairs"),
    "down": (4096, 14336, "plain"),
}


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("m", [1, 8, 16])
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_gpu_fp8_skinny_matches_reference(shape, m):
    """``ops.linear`` with an FP8 weight at decode sizes (the weight-only skinny launch, tiles
    from the packaged table or the fallback) against the float32 weight-only reference; the
    W8A8 path's activation quantization would be ~3e-2 off."""
    from kernels import ops
    from tests.kernels.test_kernels_gpu import no_sync, rel_err, skinny_inputs

    n, k, variant = GPU_SHAPES[shape]
    torch.manual_seed(m + n)
    x, w, kw = skinny_inputs(m, n, k, variant)
    wq, ws = quantize_weight_fp8(w.float())
    with no_sync():
        y, new_res = ops.linear(x, wq, weight_scale=ws, **kw)
    y_exp, res_exp = ref.skinny_linear_reference(x, wq, weight_scale=ws, **kw)
    assert y.shape == y_exp.shape and y.dtype == torch.bfloat16
    assert rel_err(y, y_exp) < 1e-2, rel_err(y, y_exp)
    if "residual" in kw:
        torch.testing.assert_close(new_res, res_exp, atol=0, rtol=8e-3)


# the CPU tests run in the interpreted child; the GPU ones (which that child deselects) and
# the sm_90 compiles (which need the compiled, not the interpreted, kernel objects) here
_GPU_TESTS = {n: fn for n, fn in globals().items() if n.startswith(("test_gpu_", "test_compile_"))}
delegate_all(globals(), __file__)
globals().update(_GPU_TESTS)
