"""Fused attention prologue: [q/k RMSNorm] + rotary + KV-cache write, one launch.

Replaces up to five launches per layer (Qwen3: q norm, k norm, rotary, KV write,
plus the copies that made the strided q/k views contiguous; Llama: rotary and KV
write). One program per token reads that token's q, k and v straight from the
fused QKV projection output (strided views), and

* optionally RMS-normalises every q and k head over ``head_dim`` (Qwen3's
  ``q_norm`` / ``k_norm``), with the reference's rounding:
  ``((x * rstd) -> dtype) * w -> dtype``;
* rotates q and k NeoX-style (rotate-half) in float32 with
  ``cos_sin_cache[pos] = cat(cos, sin)``, rounding to the dtype as the
  reference does;
* writes the rotated k and the untouched v into the paged cache at
  ``slot_mapping[t]``; slots < 0 (CUDA-graph padding) are skipped in-kernel; an FP8
  cache stores them quantized with ``k_scale`` / ``v_scale`` (``kernels.kv_write.to_cache``:
  the rotated k is rounded to the model dtype first, as the reference's is);
* stores the rotated q into a new contiguous ``[T, Hq, D]`` tensor.

The math is exactly ``rms_norm_reference`` -> ``rotary_embedding_reference`` ->
``write_kv_reference`` (see ``kernels.reference.rope_and_write_kv_reference``).
Positions and slots are read on the device; the grid is the (padded) token
count, a CPU int, so the launch is CUDA-graph capturable and never syncs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.kv_write import check_kv_cache, to_cache
from kernels.pdl import wait_and_release


@triton.jit
def _load_halves(
    ptr, t, stride_t, stride_h, num_heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr
):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HALF)
    base = t * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(ptr + base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + base + HALF, mask=mask, other=0.0).to(tl.float32)
    return x1, x2, mask


@triton.jit
def _norm_rotate(
    x1, x2, w_ptr, eps, cos, sin, HAS_NORM: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, DT: tl.constexpr
):
    if HAS_NORM:
        offs_d = tl.arange(0, BLOCK_HALF)
        d_ok = offs_d < HALF
        w1 = tl.load(w_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        var = (tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF)
        rstd = tl.rsqrt(var + eps)
        x1 = ((x1 * rstd[:, None]).to(DT).to(tl.float32) * w1[None, :]).to(DT).to(tl.float32)
        x2 = ((x2 * rstd[:, None]).to(DT).to(tl.float32) * w2[None, :]).to(DT).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    return o1, o2


@triton.jit(do_not_specialize=["k_scale", "v_scale"])
def _rope_kv_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    cache_ptr,
    qw_ptr,
    kw_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    num_q_heads,
    num_kv_heads,
    eps,
    k_scale,
    v_scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_vcb,
    stride_vct,
    stride_vch,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    Q_NORM: tl.constexpr,
    K_NORM: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    t = tl.program_id(0).to(tl.int64)
    DT = q_out_ptr.dtype.element_ty
    wait_and_release(USE_PDL)  # positions and q/k/v come from this step's kernels
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_ok = offs_d < HALF
    cos = tl.load(cache_ptr + pos * stride_cache + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + offs_d, mask=d_ok, other=0.0).to(tl.float32)

    # q: norm + rotate, stored contiguous [T, Hq, 2 * HALF]
    q1, q2, q_mask = _load_halves(q_ptr, t, stride_qt, stride_qh, num_q_heads, HALF, BLOCK_HQ, BLOCK_HALF)
    q1, q2 = _norm_rotate(q1, q2, qw_ptr, eps, cos, sin, Q_NORM, HALF, BLOCK_HALF, DT)
    offs_hq = tl.arange(0, BLOCK_HQ)
    q_dst = q_out_ptr + t * num_q_heads * (2 * HALF) + offs_hq[:, None] * (2 * HALF) + offs_d[None, :]
    tl.store(q_dst, q1.to(DT), mask=q_mask)
    tl.store(q_dst + HALF, q2.to(DT), mask=q_mask)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # padded tokens write no KV
        k1, k2, k_mask = _load_halves(k_ptr, t, stride_kt, stride_kh, num_kv_heads, HALF, BLOCK_HK, BLOCK_HALF)
        k1, k2 = _norm_rotate(k1, k2, kw_ptr, eps, cos, sin, K_NORM, HALF, BLOCK_HALF, DT)
        page = slot // KV_BLOCK_SIZE
        in_page = slot % KV_BLOCK_SIZE
        offs_hk = tl.arange(0, BLOCK_HK)
        CT = k_cache_ptr.dtype.element_ty
        kc = k_cache_ptr + page * stride_kcb + in_page * stride_kct + offs_hk[:, None] * stride_kch + offs_d[None, :]
        tl.store(kc, to_cache(k1.to(DT), k_scale, CT), mask=k_mask)
        tl.store(kc + HALF, to_cache(k2.to(DT), k_scale, CT), mask=k_mask)
        vsrc = v_ptr + t * stride_vt + offs_hk[:, None] * stride_vh + offs_d[None, :]
        v1 = tl.load(vsrc, mask=k_mask, other=0.0)
        v2 = tl.load(vsrc + HALF, mask=k_mask, other=0.0)
        vc = v_cache_ptr + page * stride_vcb + in_page * stride_vct + offs_hk[:, None] * stride_vch + offs_d[None, :]
        tl.store(vc, to_cache(v1, v_scale, v_cache_ptr.dtype.element_ty), mask=k_mask)
        tl.store(vc + HALF, to_cache(v2, v_scale, v_cache_ptr.dtype.element_ty), mask=k_mask)


def rope_and_write_kv_triton(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q ``[T, Hq, D]``, k/v ``[T, Hk, D]`` (strided views of a fused QKV output are fine);
    caches ``[num_blocks, block_size, Hk, D]``; returns the rotated q, contiguous.
    ``k_scale`` / ``v_scale``: the per-tensor scales of an FP8 cache (ignored otherwise)."""
    check_kv_cache(k_cache, v_cache)
    num_tokens, hq, d = q.shape
    hk = k.shape[1]
    _, block_size, cache_heads, cache_d = k_cache.shape
    assert d % 2 == 0 and k.shape[2] == d and v.shape[1:] == k.shape[1:]
    assert cache_heads == hk and cache_d == d and cos_sin_cache.shape[-1] == d
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    assert slot_mapping.shape[0] >= num_tokens
    q_out = torch.empty((num_tokens, hq, d), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    half = d // 2
    block_half = triton.next_power_of_2(half)
    block_hq = triton.next_power_of_2(hq)
    _rope_kv_kernel[(num_tokens,)](
        positions,
        q,
        k,
        v,
        cos_sin_cache,
        q_norm_weight if q_norm_weight is not None else q,
        k_norm_weight if k_norm_weight is not None else k,
        q_out,
        k_cache,
        v_cache,
        slot_mapping,
        hq,
        hk,
        float(eps),
        float(k_scale),
        float(v_scale),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos_sin_cache.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        HALF=half,
        BLOCK_HQ=block_hq,
        BLOCK_HK=triton.next_power_of_2(hk),
        BLOCK_HALF=block_half,
        KV_BLOCK_SIZE=block_size,
        Q_NORM=q_norm_weight is not None,
        K_NORM=k_norm_weight is not None,
        num_warps=4 if block_hq * block_half >= 2048 else 2,
        **pdl.launch_kwargs(q),
    )
    return q_out
