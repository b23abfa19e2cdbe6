"""Triton KV-cache write: scatter this step's K/V rows into the paged cache.

One program per token copies all its KV heads (``[num_kv_heads, head_dim]``)
of key and value into slot ``slot_mapping[t] = block * block_size + offset``.
Slots < 0 mark padded tokens (CUDA-graph padding) and are skipped in-kernel,
so the grid is the padded token count and nothing is read back to the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    num_heads,
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
    tl.store(kc + offs_h[:, None] * stride_kch + offs_d[None, :], k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc + offs_h[:, None] * stride_vch + offs_d[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """In-place write; key/value ``[num_tokens, num_kv_heads, head_dim]`` (strided views
    of a fused QKV output are fine), caches ``[num_blocks, block_size, heads, head_dim]``."""
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
