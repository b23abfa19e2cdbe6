"""Per-row (per-token) FP8 e4m3 quantization of activations in one Triton launch.

``quantize_rows_triton(x)`` is ``kernels.fp8_reference.quantize_rows_reference`` on the device:
one program a row finds the row's amax, stores its scale and writes the scaled, clamped,
rounded row (with a static scale: only the last step, the scale read from device memory).
The division is IEEE (``div_rn``) and the cast rounds to nearest even, so the result equals
the reference bit for bit.

No host syncs; the grid is ``(M,)`` and ``M`` enters the kernel nowhere else, so every batch
size shares one compilation (per ``K``, input dtype and mode). CUDA-graph capturable.

Under ``TRITON_INTERPRET=1`` (CPU tensors) the interpreter's own float -> e4m3 cast is wrong
(no carry into the exponent on rounding up: 0.0303 becomes 0.0156; subnormals flushed), so
there the code is built from the bits (``_e4m3_rne``): the same values, slower.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_reference import FP8_DTYPE, FP8_MAX, SCALE_FLOOR

MAX_BLOCK_K = 4096  # a longer row is walked in chunks (twice: amax, then the cast)
FP8_MAX_C = tl.constexpr(FP8_MAX)
SCALE_FLOOR_C = tl.constexpr(SCALE_FLOOR)


@triton.jit
def _e4m3_rne(v):
    """``v`` (float32, ``|v| <= 448``) -> e4m3fn rounded to nearest even, from the bits."""
    bits = v.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # the binade; subnormals share -6's
    # |v| * 2^(3 - e) lies in [0, 16) exactly (a power-of-two scaling): its integer part is
    # 8 + mantissa (or the subnormal mantissa); round it to nearest even by the 2^23 trick
    t = tl.abs(v) * ((130 - e) << 23).to(tl.float32, bitcast=True)
    n = ((t + 8388608.0) - 8388608.0).to(tl.int32)
    code = ((e + 6) << 3) + n  # a round-up to 16 carries into the exponent by itself
    code = tl.where(bits < 0, code | 0x80, code)
    return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _scale_and_cast(x, scale, EXACT_CAST: tl.constexpr):
    y = tl.math.div_rn(x, scale)
    y = tl.minimum(tl.maximum(y, -FP8_MAX_C), FP8_MAX_C)
    if EXACT_CAST:
        q = _e4m3_rne(y)
    else:
        q = y.to(tl.float8e4nv)  # cvt.rn.satfinite on sm_89+
    return q


@triton.jit
def _quant_rows_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    static_ptr,
    K,
    stride_xm,
    stride_qm,
    BLOCK_K: tl.constexpr,
    STATIC: tl.constexpr,
    EXACT_CAST: tl.constexpr,
):
    """One row: ``scale = max(amax, floor) / 448`` (or the static one), stored; then the row
    divided by it, clamped and cast. (No ``M`` argument: nothing to specialise on it.)"""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    offs = tl.arange(0, BLOCK_K)
    if STATIC:
        scale = tl.load(static_ptr).to(tl.float32)
    else:
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_row + k0 + offs, mask=(k0 + offs) < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.math.div_rn(tl.maximum(tl.max(amax, 0), SCALE_FLOOR_C), FP8_MAX_C)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        ok = (k0 + offs) < K
        x = tl.load(x_row + k0 + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(q_row + k0 + offs, _scale_and_cast(x, scale, EXACT_CAST), mask=ok)


def quantize_rows_triton(
    x: torch.Tensor, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (bf16/fp16/fp32, unit stride along K) -> ``(xq [M, K] e4m3, scale [M]
    float32)``: per-row dynamic scales, or ``static_scale`` (one float32 value on ``x``'s
    device, shape ``[]`` or ``[1]``) for every row. Contract of ``quantize_rows_reference``."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"quantize_rows: expected a 2-D tensor with unit stride along K, got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"quantize_rows: unsupported dtype {x.dtype}")
    m, k = x.shape
    if k == 0:
        raise ValueError("quantize_rows: empty rows")
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((m,), dtype=torch.float32, device=x.device)
    if static_scale is not None:
        if static_scale.numel() != 1 or static_scale.dtype != torch.float32:
            raise ValueError("quantize_rows: static_scale must be one float32 value")
        if static_scale.device != x.device:
            raise ValueError("quantize_rows: static_scale must be on x's device (no host copy)")
    if m == 0:
        return q, s
    block_k = min(triton.next_power_of_2(k), MAX_BLOCK_K)
    _quant_rows_kernel[(m,)](
        x,
        q,
        s,
        s if static_scale is None else static_scale,
        k,
        x.stride(0),
        q.stride(0),
        BLOCK_K=block_k,
        STATIC=static_scale is not None,
        EXACT_CAST=not x.is_cuda,
        num_warps=4 if block_k <= 1024 else 8,
    )
    return q, s
