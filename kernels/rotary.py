"""Triton NeoX-style (rotate-half) rotary embedding, same math as the reference.

One program per token rotates all q heads and all k heads of that token:
``out1 = x1 * cos - x2 * sin``, ``out2 = x2 * cos + x1 * sin`` on the two halves
of ``head_dim``, in float32, with ``cos_sin_cache[pos] = cat(cos, sin)``.
Positions are read on the device (padded tokens just use whatever position
the padding carries, like the reference).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(
    src_ptr,
    dst_ptr,
    t,
    stride_t,
    stride_h,
    num_heads,
    cos,
    sin,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HALF)
    base = t * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(src_ptr + base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src_ptr + base + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    dst = dst_ptr + t * num_heads * (2 * HALF) + offs_h[:, None] * (2 * HALF) + offs_d[None, :]
    tl.store(dst, o1.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, o2.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    cache_ptr,
    q_out_ptr,
    k_out_ptr,
    num_q_heads,
    num_k_heads,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cache,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_ok = offs_d < HALF
    cos = tl.load(cache_ptr + pos * stride_cache + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    _rotate(q_ptr, q_out_ptr, t, stride_qt, stride_qh, num_q_heads, cos, sin, HALF, BLOCK_HQ, BLOCK_HALF)
    _rotate(k_ptr, k_out_ptr, t, stride_kt, stride_kh, num_k_heads, cos, sin, HALF, BLOCK_HK, BLOCK_HALF)


def rotary_embedding_triton(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[T, Hq, D]``, k ``[T, Hk, D]`` (strided views fine) -> new contiguous
    ``(q_out, k_out)`` of the same shapes and dtypes. ``cos_sin_cache [max_pos, D]``."""
    num_tokens, hq, d = q.shape
    hk = k.shape[1]
    assert d % 2 == 0 and k.shape[2] == d and cos_sin_cache.shape[-1] == d
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    cos_sin_cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    q_out = torch.empty((num_tokens, hq, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((num_tokens, hk, d), dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    half = d // 2
    block_half = triton.next_power_of_2(half)
    block_hq = triton.next_power_of_2(hq)
    _rotary_kernel[(num_tokens,)](
        positions,
        q,
        k,
        cos_sin_cache,
        q_out,
        k_out,
        hq,
        hk,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        HALF=half,
        BLOCK_HQ=block_hq,
        BLOCK_HK=triton.next_power_of_2(hk),
        BLOCK_HALF=block_half,
        num_warps=4 if block_hq * block_half >= 2048 else 2,
    )
    return q_out, k_out
