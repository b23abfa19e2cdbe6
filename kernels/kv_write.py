"""Triton KV-cache write: scatter this step's K/V rows into the paged cache.

One program per token copies all its KV heads (``[num_kv_heads, head_dim]``)
of key and value into slot ``slot_mapping[t] = block * block_size + offset``.
Slots < 0 mark padded tokens (CUDA-graph padding) and are skipped in-kernel,
so the grid is the padded token count and nothing is read back to the host.

An FP8 cache (``torch.float8_e4m3fn``, read from the cache pointer's element type: its own
compiled variant) stores ``clamp(x / scale, -448, 448)`` rounded to e4m3, computed in
float32 (``to_cache``, shared with ``kernels.rope_kv`` and the attention kernel's
in-launch KV write); ``k_scale`` / ``v_scale`` are runtime float32 arguments, never
specialised on, and a 16-bit or float32 cache ignores them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import KV_FP8_DTYPE
from kernels.settings import TRITON_INTERPRETED

# Triton 3.9's interpreter rounds float32 -> e4m3 without carrying a rounded-up mantissa into
# the exponent (125.7 became 64, not 128): off-GPU, ``quantize_fp8`` rounds to the e4m3 grid
# in float32 first, so the conversion itself is exact. The GPU's conversion (cvt.rn.satfinite)
# is correct and runs alone.
_INTERPRETED = tl.constexpr(TRITON_INTERPRETED)


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """K and V caches of one dtype; of the 1-byte dtypes only float8_e4m3fn."""
    assert k_cache.dtype == v_cache.dtype, f"K cache {k_cache.dtype} != V cache {v_cache.dtype}"
    assert k_cache.element_size() > 1 or k_cache.dtype == KV_FP8_DTYPE, f"unsupported KV cache {k_cache.dtype}"


@triton.jit
def quantize_fp8(x, scale):
    """float32 ``x`` -> e4m3: ``clamp(x / scale, -448, 448)``, IEEE division, round to
    nearest even (``torch``'s ``(x / scale).clamp(-448, 448).to(torch.float8_e4m3fn)``)."""
    y = tl.clamp(tl.math.div_rn(x, scale), -448.0, 448.0)  # (reference.FP8_MAX)
    if _INTERPRETED:  # round to the e4m3 grid here (see _INTERPRETED): (|y| + c) - c, RNE
        a = tl.abs(y)
        ulp_exp = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) - 127, -6) - 3  # subnormals: 2^-9
        c = ((ulp_exp + 23 + 127) << 23).to(tl.float32, bitcast=True)
        a = (a + c) - c
        y = tl.where(y.to(tl.int32, bitcast=True) < 0, -a, a)
    return y.to(tl.float8e4nv)


@triton.jit
def to_cache(x, scale, CT: tl.constexpr):
    """``x`` as the cache stores it: quantized with ``scale`` into an FP8 cache, else cast
    to the cache dtype ``CT`` (``scale`` unused)."""
    if CT == tl.float8e4nv:
        return quantize_fp8(x.to(tl.float32), scale)
    else:
        return x.to(CT)


@triton.jit(do_not_specialize=["k_scale", "v_scale"])
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    num_heads,
    k_scale,
    v_scale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_vcb,
    stride_vct,
    stride_vch,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    page = slot // KV_BLOCK_SIZE
    in_page = slot % KV_BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(key_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    kc = k_cache_ptr + page * stride_kcb + in_page * stride_kct
    vc = v_cache_ptr + page * stride_vcb + in_page * stride_vct
    k = to_cache(k, k_scale, k_cache_ptr.dtype.element_ty)
    v = to_cache(v, v_scale, v_cache_ptr.dtype.element_ty)
    tl.store(kc + offs_h[:, None] * stride_kch + offs_d[None, :], k, mask=mask)
    tl.store(vc + offs_h[:, None] * stride_vch + offs_d[None, :], v, mask=mask)


def write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """In-place write; key/value ``[num_tokens, num_kv_heads, head_dim]`` (strided views
    of a fused QKV output are fine), caches ``[num_blocks, block_size, heads, head_dim]``.
    ``k_scale`` / ``v_scale``: the per-tensor scales of an FP8 cache (ignored otherwise)."""
    check_kv_cache(k_cache, v_cache)
    num_tokens = slot_mapping.shape[0]
    _, block_size, num_heads, head_dim = k_cache.shape
    key = key.view(key.shape[0], num_heads, head_dim) if key.dim() == 2 else key
    value = value.view(value.shape[0], num_heads, head_dim) if value.dim() == 2 else value
    assert key.shape[0] >= num_tokens and value.shape[0] >= num_tokens
    assert key.stride(-1) == 1 and value.stride(-1) == 1
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if num_tokens == 0:
        return
    block_h = triton.next_power_of_2(num_heads)
    block_d = triton.next_power_of_2(head_dim)
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        num_heads,
        float(k_scale),
        float(v_scale),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        KV_BLOCK_SIZE=block_size,
        num_warps=4 if block_h * block_d >= 1024 else 1,
    )
