"""FP8 (e4m3) weights: the plain-torch references (``kernels.fp8_reference``), and the Triton
activation quantizer and GEMM (``kernels.fp8_quant``, ``kernels.fp8_gemm``) against them under
the interpreter (an interpreted child pytest: see ``tests/interpreted.py``); GPU tests at the
Llama-3.1-8B shapes (``-m gpu``)."""

import re

import pytest
import torch

from kernels import fp8_reference as ref  # plain torch
from tests.interpreted import INTERPRETED, delegate_all
from tests.kernels.launch_recorder import LaunchRecorder

if INTERPRETED:
    from kernels import fp8_gemm, fp8_quant
else:
    fp8_gemm = fp8_quant = None  # only the child touches triton (the GPU tests import their own)

FP8 = torch.float8_e4m3fn
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def _operands(m, n, k, seed, device="cpu", bias_dtype=None):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, generator=g, device=device)
    w = torch.randn(n, k, generator=g, device=device) / k**0.5
    xq, xs = ref.quantize_rows_reference(x)
    wq, ws = ref.quantize_weight_fp8(w)
    bias = None if bias_dtype is None else torch.randn(n, generator=g, device=device).to(bias_dtype)
    return x, w, xq, xs, wq, ws, bias


def _assert_close_to_fp32(y, y32, out_dtype, rtol=1e-5, abs_sum=None):
    """``y`` against the float32 reference output: float32 to ``rtol`` of the output's
    magnitude (another summation order), 16-bit within one rounding of the float32 value (the
    interpreter's bf16 cast truncates)."""
    assert y.dtype == out_dtype and y.shape == y32.shape
    diff = (y.float() - y32).abs()
    # ``abs_sum`` (sum_k |x_k w_k|, scaled): summation-order error is relative to it, not to |y|
    scale = y32.abs().amax().clamp_min(1e-6) if abs_sum is None else abs_sum
    if out_dtype == torch.float32:
        bound = rtol * (y32.abs() + scale)
    else:
        bound = torch.finfo(out_dtype).eps * y32.abs() + rtol * scale
    bad = diff > bound
    assert not bool(bad.any()), f"{int(bad.sum())} of {y.numel()} off; worst {float((diff - bound).max())}"


# ---- the references (plain torch) ----


def test_quantize_weight_roundtrip_error_bound():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 320, generator=g) * torch.logspace(-4, 2, 48)[:, None]  # rows of any magnitude
    w[3, ::7] = 0.0
    w[5] = 0.0  # an all-zero row: the floor scale, zeros back
    w[7, :10] = torch.logspace(-9, -1, 10)  # subnormals of the row's scale
    wq, scale = ref.quantize_weight_fp8(w)
    assert wq.dtype == FP8 and wq.shape == w.shape and scale.dtype == torch.float32 and scale.shape == (48,)
    back = ref.dequantize_fp8(wq, scale)
    err = (back - w).abs()
    rowmax = w.abs().amax(1, keepdim=True)
    # half of the top binade's spacing (32 at 256..448) is the largest rounding: 16/448 of the max
    assert bool((err <= rowmax * (16 / 448) * (1 + 1e-5) + 1e-30).all())
    # per element: half a step of 3 mantissa bits, or half the subnormal step 2^-9 * scale
    assert bool((err <= w.abs() * 2**-4 + scale[:, None] * 2**-10 * (1 + 1e-5)).all())
    assert bool((back[w == 0] == 0).all()) and bool((wq[w == 0].float() == 0).all())
    assert torch.equal(scale[5], torch.tensor(ref.SCALE_FLOOR, dtype=torch.float32) / 448)
    # each row's largest magnitude lands on +-448
    assert bool((wq.float().abs().amax(1)[rowmax[:, 0] > 0] == 448).all())


def test_quantize_rows_reference_static_scale():
    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16) * 30
    s = torch.tensor([0.05])
    q, scale = ref.quantize_rows_reference(x, s)
    assert scale.shape == (6,) and bool((scale == 0.05).all())
    # independent of the reference's code: divide, saturate, let torch round
    exp = (x.float() / torch.tensor(0.05)).clamp(-448, 448).to(FP8)
    assert torch.equal(_bits(q), _bits(exp))
    assert float(q.float().abs().max()) == 448.0  # 30 sigma / 0.05 saturates
    with pytest.raises(ValueError, match="one value"):
        ref.quantize_rows_reference(x, torch.ones(2))


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_reference_end_to_end_error_is_small(out_dtype):
    """Quantize both operands, multiply: close to the unquantized product (relative to the
    output's magnitude), with the bias carried exactly."""
    x, w, xq, xs, wq, ws, bias = _operands(24, 96, 512, seed=2, bias_dtype=torch.bfloat16)
    y = ref.fp8_linear_reference(xq, xs, wq, ws, bias, out_dtype).double()
    exact = x.double() @ w.double().T + bias.double()
    rel = float((y - exact).norm() / exact.norm())
    assert 0 < rel < 0.05, rel
    assert float((y - exact).abs().max()) < 0.1 * float(exact.abs().max())
    # and the reference's own math: the dequantized operands' float64 product
    deq = ref.dequantize_fp8(xq, xs).double() @ ref.dequantize_fp8(wq, ws).double().T + bias.double()
    tol = 1e-5 if out_dtype == torch.float32 else 2**-8
    assert float(((y - deq).abs() / (deq.abs() + 1e-3 * deq.abs().max())).max()) < tol


# ---- the Triton quantizer (interpreted) ----


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,k", [(1, 64), (7, 300), (3, 4100)])  # 4100: two chunks, the last ragged
@pytest.mark.parametrize("static", [False, True])
def test_quantize_rows_triton_matches_reference(dtype, m, k, static):
    g = torch.Generator().manual_seed(m * k)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-3, 3, m)[:, None]).to(dtype)
    x[0, :5] = 0.0
    x[-1, -1] = -0.0
    s = torch.tensor([0.0123]) if static else None
    q, scale = fp8_quant.quantize_rows_triton(x, s)
    q_ref, scale_ref = ref.quantize_rows_reference(x, s)
    assert q.dtype == FP8 and q.shape == (m, k) and scale.dtype == torch.float32 and scale.shape == (m,)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(_bits(q), _bits(q_ref))  # bit for bit: IEEE division, nearest-even cast


def test_quantize_rows_triton_rounding_ties_saturation_and_subnormals():
    """Every finite e4m3 value, the midpoints between neighbours (ties go to the even code),
    values just either side of each midpoint, beyond 448 (saturate), subnormals, -0.0: with
    a static scale of 1 the kernel's cast must equal torch's of the clamped value."""
    pos = torch.arange(0, 127, dtype=torch.uint8).view(FP8).float()  # 0 .. 448, ascending
    mids = (pos[1:] + pos[:-1]) / 2
    around = torch.cat([mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])
    vals = torch.cat([pos, around, torch.tensor([449.0, 464.0, 465.0, 1e4, 2.0**-10, 2.0**-11, 3e-3])])
    vals = torch.cat([vals, -vals, torch.tensor([-0.0])])
    one = torch.tensor([1.0])
    q, _ = fp8_quant.quantize_rows_triton(vals[None, :], one)
    exp = vals.clamp(-448, 448).to(FP8)
    bad = _bits(q[0]) != _bits(exp)
    assert not bool(bad.any()), (vals[bad][:8], q[0][bad][:8].float(), exp[bad][:8].float())


def test_quantize_rows_triton_zero_rows_strided_input_and_empty_batch():
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    x[2] = 0.0
    view = x[:, 16:80]  # row stride 96, not the row length
    q, scale = fp8_quant.quantize_rows_triton(view)
    q_ref, scale_ref = ref.quantize_rows_reference(view)
    assert torch.equal(scale, scale_ref) and torch.equal(_bits(q), _bits(q_ref))
    assert bool((q[2].float() == 0).all())
    assert torch.equal(scale[2], torch.tensor(ref.SCALE_FLOOR, dtype=torch.float32) / 448)
    q0, s0 = fp8_quant.quantize_rows_triton(torch.empty(0, 64))
    assert q0.shape == (0, 64) and s0.shape == (0,)
    with pytest.raises(ValueError, match="one float32 value"):
        fp8_quant.quantize_rows_triton(x, torch.ones(1, dtype=torch.float64))


# ---- the Triton GEMM (interpreted) ----


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(
    "m,kind",
    [(1, "skinny"), (5, "skinny"), (16, "skinny"), (40, "tile"), (300, "prefill")],
)
@pytest.mark.parametrize("n,k", [(72, 200), (136, 256)])  # 200: K not a multiple of BLOCK_K
def test_fp8_gemm_matches_reference_per_class(m, kind, n, k, with_bias, out_dtype):
    x, w, xq, xs, wq, ws, bias = _operands(m, n, k, seed=m + n + k, bias_dtype=torch.bfloat16 if with_bias else None)
    cfg = fp8_gemm.select_fp8_config(m, n, k)
    assert cfg["kind"] == kind
    y = fp8_gemm.fp8_gemm_triton(xq, xs, wq, ws, bias, out_dtype)
    y32 = ref.fp8_linear_reference(xq, xs, wq, ws, bias, torch.float32)
    _assert_close_to_fp32(y, y32, out_dtype)
    # independent of the reference: the dequantized operands' float64 product
    deq = ref.dequantize_fp8(xq, xs).double() @ ref.dequantize_fp8(wq, ws).double().T
    if bias is not None:
        deq += bias.double()
    _assert_close_to_fp32(y, deq.float(), out_dtype, rtol=2e-5)


@pytest.mark.parametrize(
    "m,n,k,cfg",
    [
        (9, 72, 640, dict(block_m=16, block_n=32, block_k=128, group_m=1, split_k=4)),  # 5 blocks: 2,2,1,0
        (20, 48, 96, dict(block_m=16, block_n=16, block_k=32, group_m=1, split_k=3)),  # even K, 3 slices
        (70, 72, 50, dict(block_m=16, block_n=16, block_k=32, group_m=2, split_k=1)),  # 5x5 tiles, groups of 2
        (70, 72, 200, dict(block_m=32, block_n=16, block_k=64, group_m=3, split_k=2)),  # grouped and split
        (5, 72, 200, dict(block_m=16, block_n=64, block_k=128, group_m=1, split_k=2)),
    ],
)
def test_fp8_gemm_forced_configs_write_every_tile(m, n, k, cfg):
    """Split slices (an empty one too), grouped tile orders with a ragged last group: every
    output element written once with the right row and column scales."""
    cfg = dict(cfg, num_warps=4, num_stages=2, fast_accum=False)
    _, _, xq, xs, wq, ws, bias = _operands(m, n, k, seed=7, bias_dtype=torch.float32)
    xs = xs * torch.arange(1, m + 1)  # distinct row and column scales: a misplaced tile shows
    ws = ws * torch.arange(1, n + 1).flip(0)
    y = fp8_gemm.fp8_gemm_triton(xq, xs, wq, ws, bias, torch.float32, config=cfg)
    _assert_close_to_fp32(y, ref.fp8_linear_reference(xq, xs, wq, ws, bias, torch.float32), torch.float32)


def test_fp8_gemm_pipeline_end_to_end_close_to_unquantized():
    """The device path as a layer runs it (quantize the activations, then the GEMM) against
    the bf16 model's unquantized product."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(12, 384, generator=g).to(torch.bfloat16)
    w = (torch.randn(80, 384, generator=g) / 20).to(torch.bfloat16)
    wq, ws = ref.quantize_weight_fp8(w)
    xq, xs = fp8_quant.quantize_rows_triton(x)
    y = fp8_gemm.fp8_gemm_triton(xq, xs, wq, ws).double()
    exact = x.double() @ w.double().T
    assert float((y - exact).norm() / exact.norm()) < 0.05


def test_select_fp8_config_classes_and_splits():
    sel = fp8_gemm.select_fp8_config
    for m, kind, bm in ((1, "skinny", 16), (16, "skinny", 16), (17, "tile", 64), (256, "tile", 64)):
        assert (sel(m, 4096, 4096)["kind"], sel(m, 4096, 4096)["block_m"]) == (kind, bm)
    pre = sel(257, 4096, 4096)
    assert pre["kind"] == "prefill" and pre["block_m"] == 128 and pre["block_k"] == 128
    assert pre["block_n"] in (128, 256) and pre["group_m"] > 1 and pre["split_k"] == 1
    # decode: 64 N tiles of 64 -> split to >= 2 programs an SM, in equal slices of K
    for n, k in ((4096, 4096), (6144, 4096), (4096, 14336), (1024, 2048)):
        c = sel(1, n, k)
        programs = -(-n // c["block_n"]) * c["split_k"]
        assert c["split_k"] > 1 and (programs >= 2 * fp8_gemm.NUM_SMS or c["split_k"] == fp8_gemm.MAX_SPLIT_K)
        assert (k // c["block_k"]) % c["split_k"] == 0
    assert sel(1, 28672, 4096)["split_k"] == 1  # enough tiles already
    assert sel(4096, 4096, 4096)["split_k"] == 1
    for m in (1, 8, 64, 256, 1024):
        fp8_gemm.check_config(sel(m, 4096, 4096))


def test_fp8_gemm_rejects_bad_operands():
    _, _, xq, xs, wq, ws, _ = _operands(4, 32, 64, seed=1)
    with pytest.raises(ValueError, match="operands must be"):
        fp8_gemm.fp8_gemm_triton(xq.float(), xs, wq, ws)
    with pytest.raises(ValueError, match="do not fit"):
        fp8_gemm.fp8_gemm_triton(xq[:, :32], xs, wq, ws)
    with pytest.raises(ValueError, match="float32"):
        fp8_gemm.fp8_gemm_triton(xq, xs.double(), wq, ws)
    with pytest.raises(ValueError, match="power of two"):
        cfg = dict(fp8_gemm.select_fp8_config(4, 32, 64), block_n=24)
        fp8_gemm.fp8_gemm_triton(xq, xs, wq, ws, config=cfg)
    empty = fp8_gemm.fp8_gemm_triton(xq[:0], xs[:0], wq, ws)
    assert empty.shape == (0, 32) and empty.dtype == torch.bfloat16


@pytest.mark.parametrize("n,k", [(4096, 4096), (1000, 2000)])  # 1000, 2000: not % 128 (% 16 for N)
def test_batch_sizes_of_a_class_share_one_compilation(monkeypatch, n, k):
    """Every batch size of a class launches the same variant (``M`` and the split count are
    not specialised), split or not; the quantizer one for all batch sizes."""
    recs = {name: LaunchRecorder(getattr(fp8_gemm, name)) for name in ("_fp8_gemm_kernel", "_split_reduce_kernel")}
    for name, rec in recs.items():
        monkeypatch.setattr(fp8_gemm, name, rec)
    qrec = LaunchRecorder(fp8_quant._quant_rows_kernel)
    monkeypatch.setattr(fp8_quant, "_quant_rows_kernel", qrec)
    wq = torch.zeros(n, k, dtype=FP8)
    ws = torch.ones(n)
    for lo, hi in ((1, 16), (17, 256), (257, 600)):
        for rec in (*recs.values(), qrec):
            rec.calls.clear()
        splits = set()
        for m in range(lo, hi + 1, 1 if hi == 16 else 7):
            xq, xs = fp8_quant.quantize_rows_triton(torch.zeros(m, k, dtype=torch.bfloat16))
            fp8_gemm.fp8_gemm_triton(xq, xs, wq, ws)
            splits.add(fp8_gemm.select_fp8_config(m, n, k)["split_k"])
        assert len(recs["_fp8_gemm_kernel"].variants()) == 1, (lo, hi)
        assert len(recs["_split_reduce_kernel"].variants()) <= 1 and len(qrec.variants()) == 1
        if lo == 1:
            assert splits != {1} and recs["_split_reduce_kernel"].calls  # the split path is covered


# ---- compiled for Hopper on this CPU (no device; in the parent process, not interpreted) ----


def _compile_sm90(fn, const: dict, ptrs: dict[str, str]):
    """``tests.kernels.sm90.compile_sm90`` with every unspecialised int treated as the JIT does
    (% 16 where not in ``do_not_specialize``); returns (PTX, spill bytes)."""
    from tests.kernels.sm90 import compile_sm90, resource_usage

    opts = {k: const.pop(k) for k in ("num_warps", "num_stages") if k in const}
    ints = tuple(p.name for p in fn.params if not p.name.endswith("_ptr") and p.name not in const)
    kernel = compile_sm90(fn, const, ptrs, default_ptr="*fp32", aligned_ints=ints, options=opts)
    return kernel.asm["ptx"], resource_usage(kernel.asm["cubin"])[1]


@pytest.mark.parametrize("m", [1, 64, 1024])
@pytest.mark.parametrize("fast_accum", [False, True])
@pytest.mark.parametrize("out", ["bf16", "fp32"])
def test_compile_fp8_gemm_for_hopper(m, fast_accum, out):
    """The configs compile for sm_90 with a cp.async pipeline and no register spills: e4m3
    wgmma from 64 rows; below that ``mma.sync`` on fp16 copies
    (Triton's fallback: the fp8 tiles converted in registers)."""
    from kernels import fp8_gemm as g8

    cfg = g8.select_fp8_config(m, 4096, 4096)
    const = dict(BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], GROUP_M=cfg["group_m"])
    const.update(EVEN_K=True, HAS_BIAS=out == "bf16", FAST_ACCUM=fast_accum)
    const.update(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if out == "fp32":
        const["b_ptr"] = None
    ptrs = dict(x_ptr="*fp8e4nv", w_ptr="*fp8e4nv", xs_ptr="*fp32", ws_ptr="*fp32", b_ptr="*bf16", part_ptr="*fp32")
    ptx, spilled = _compile_sm90(g8._fp8_gemm_kernel, const, dict(ptrs, out_ptr=f"*{out}"))
    if cfg["block_m"] >= 64:
        assert re.search(r"wgmma.mma_async\S*e4m3.e4m3", ptx)
    else:
        assert re.search(r"mma.sync\S*f16", ptx) and "cvt.rn.f16x2.e4m3x2" in ptx
    assert "cp.async" in ptx
    assert spilled in (0, None)


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("static", [False, True])
def test_compile_quantizer_and_split_reduce_for_hopper(dtype, static):
    """The quantizer takes the native nearest-even saturating cast and the IEEE division."""
    from kernels import fp8_gemm as g8
    from kernels import fp8_quant as q8

    const = dict(BLOCK_K=4096, STATIC=static, EXACT_CAST=False, num_warps=8)
    ptx, spilled = _compile_sm90(q8._quant_rows_kernel, const, dict(x_ptr=f"*{dtype}", q_ptr="*fp8e4nv"))
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "div.rn.f32" in ptx and spilled in (0, None)
    const = dict(BLOCK_R=16, BLOCK_C=128, HAS_BIAS=True, num_warps=4)
    ptrs = dict(part_ptr="*fp32", xs_ptr="*fp32", ws_ptr="*fp32", b_ptr=f"*{dtype}", out_ptr=f"*{dtype}")
    _, spilled = _compile_sm90(g8._split_reduce_kernel, const, ptrs)
    assert spilled in (0, None)


# ---- GPU (run with -m gpu) ----

GPU_SHAPES = [(4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("m,k", [(1, 4096), (8, 14336), (256, 4096), (1024, 14336), (4096, 4096)])
def test_gpu_quantize_rows_matches_reference(m, k, static):
    from kernels import fp8_quant as q8

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 3
    s = torch.tensor([0.02], device="cuda") if static else None
    q, scale = q8.quantize_rows_triton(x, s)
    q_ref, scale_ref = ref.quantize_rows_reference(x, s)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(_bits(q), _bits(q_ref))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("m", [1, 8, 64, 256, 1024])
@pytest.mark.parametrize("n,k", GPU_SHAPES)
def test_gpu_fp8_gemm_matches_reference(m, n, k):
    from kernels import fp8_gemm as g8

    if n > 100000 and m > 256:
        pytest.skip("the logits shape at prefill sizes: covered by the smaller ones")
    _, _, xq, xs, wq, ws, bias = _operands(m, n, k, seed=m + n, device="cuda", bias_dtype=torch.bfloat16)
    y32 = ref.fp8_linear_reference(xq, xs, wq, ws, bias, torch.float32)
    abs_sum = (
        ref.fp8_linear_reference(xq.float().abs(), xs, wq.float().abs(), ws, None, torch.float32) + bias.float().abs()
    )
    cfg = g8.select_fp8_config(m, n, k)
    # another summation order, and wgmma's reduced-precision partial sums inside each
    # BLOCK_K chunk: 1e-4 of sum_k |x_k w_k| (relative to |y| it missed 1 in 10^7 on an H100)
    y = g8.fp8_gemm_triton(xq, xs, wq, ws, None, torch.float32, config=cfg)
    _assert_close_to_fp32(y + bias.float(), y32, torch.float32, 1e-4, abs_sum)
    y = g8.fp8_gemm_triton(xq, xs, wq, ws, bias, torch.bfloat16, config=cfg)
    _assert_close_to_fp32(y, y32, torch.bfloat16, 1e-4, abs_sum)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("m", [1, 64, 1024])
def test_gpu_fp8_gemm_fast_accum_is_close(m):
    """Hopper's reduced-precision fp8 accumulation (``fast_accum``): still well within the
    quantization error (``2e-2`` of the output's magnitude)."""
    from kernels import fp8_gemm as g8

    n, k = 4096, 14336
    _, _, xq, xs, wq, ws, _ = _operands(m, n, k, seed=m, device="cuda")
    cfg = dict(g8.select_fp8_config(m, n, k), fast_accum=True)
    y32 = ref.fp8_linear_reference(xq, xs, wq, ws, None, torch.float32)
    _assert_close_to_fp32(g8.fp8_gemm_triton(xq, xs, wq, ws, None, torch.float32, config=cfg), y32, torch.float32, 2e-2)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("m", [1, 8, 200])
def test_gpu_fp8_layer_in_a_cuda_graph(m):
    """Quantize + GEMM captured in a CUDA graph (no host syncs): a replay on new activations
    equals the eager result, and the pipeline stays close to the bf16 product."""
    from kernels import fp8_gemm as g8
    from kernels import fp8_quant as q8

    n, k = 6144, 4096
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    wq, ws = ref.quantize_weight_fp8(w)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

    def layer():
        xq, xs = q8.quantize_rows_triton(x)
        return g8.fp8_gemm_triton(xq, xs, wq, ws)

    layer()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = layer()
    x.copy_(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, layer())  # deterministic: no atomics in the split-K path
    exact = x.double() @ w.double().T
    assert float((y.double() - exact).norm() / exact.norm()) < 0.05


# the CPU tests run in the interpreted child; the GPU ones (which that child deselects) and
# the sm_90 compiles (which need the compiled, not the interpreted, kernel objects) here
_GPU_TESTS = {n: fn for n, fn in globals().items() if n.startswith(("test_gpu_", "test_compile_"))}
delegate_all(globals(), __file__)
globals().update(_GPU_TESTS)


def test_cublas_takes_large_fp8_batches_on_hopper_only():
    """``kernels.fp8_linear.use_cublas``: above 128 rows on sm_90+ (rowwise-scaled cuBLASLt),
    never below, never on sm_89, never for dimensions cuBLASLt refuses."""
    from kernels.fp8_linear import CUBLAS_MIN_ROWS, use_cublas

    assert CUBLAS_MIN_ROWS == 129
    assert use_cublas(129, 4096, 4096, (9, 0)) and use_cublas(4096, 28672, 4096, (10, 0))
    assert not use_cublas(128, 4096, 4096, (9, 0))
    assert not use_cublas(4096, 4096, 4096, (8, 9))
    assert not use_cublas(4096, 4100, 4096, (9, 0)) and not use_cublas(4096, 4096, 4104, (9, 0))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("m", [17, 128, 129, 1024])
@pytest.mark.parametrize("static", [False, True])
def test_gpu_w8a8_linear_matches_reference_on_both_routes(m, static):
    """``w8a8_linear`` (the Triton FP8 GEMM up to 128 rows, cuBLASLt above) against the
    float32 reference of the same quantized operands, with a bias; and replayed from a CUDA
    graph (the mixed-step graphs capture it) with the same result."""
    from kernels.fp8_linear import w8a8_linear
    from kernels.fp8_quant import quantize_rows_triton

    n, k = 6144, 4096
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
    wq, ws = ref.quantize_weight_fp8(torch.randn(n, k, generator=g, device="cuda") / k**0.5)
    bias = torch.randn(n, generator=g, device="cuda").to(torch.bfloat16)
    s = torch.tensor([0.01], device="cuda") if static else None
    xq, xs = quantize_rows_triton(x, s)
    y32 = ref.fp8_linear_reference(xq, xs, wq, ws, bias, torch.float32)
    abs_sum = ref.fp8_linear_reference(xq.float().abs(), xs, wq.float().abs(), ws, None, torch.float32)
    y = w8a8_linear(x, wq, ws, s, bias)
    _assert_close_to_fp32(y, y32, torch.bfloat16, 1e-4, abs_sum + bias.float().abs())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_g = w8a8_linear(x, wq, ws, s, bias)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y_g, y)
