"""In-kernel attention prologue for decode: [per-head RMSNorm] + NeoX rotary on rows of heads.

Used by ``kernels.paged_attention`` when it takes over ``kernels.rope_kv``'s work for
one-token-per-request batches (``rope=`` there): each attention program rotates its own
q heads and its KV head's new key in registers, so the layer runs one launch fewer.

The math and rounding points are ``kernels.reference.rope_and_write_kv_reference``'s
(results agree to about an ulp: the compiler may fuse the rotation's multiply-adds):
``((x * rstd) -> dtype) * w -> dtype``, then ``x1 cos - x2 sin | x2 cos + x1 sin`` in
float32, rounded to the dtype. Rotate-half pairs element ``d`` with ``(d + D/2) mod D``,
so a row is loaded twice (the second load hits L1/L2) instead of being split in halves:
the result keeps the ``[rows, BLOCK_D]`` layout that ``tl.dot`` consumes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class DecodeRope(NamedTuple):
    """What ``kernels.rope_kv`` would have taken, handed to the attention launch instead:
    the raw ``k``/``v`` ``[T, Hk, D]`` of this step's tokens (strided views of the fused
    QKV output are fine), their positions and cache slots (-1: padding, not written), the
    ``[max_pos, D]`` cos|sin table and Qwen3's optional q/k norm weights. ``k_scale`` /
    ``v_scale``: an FP8 cache's per-tensor scales, with which the new K/V are stored (the
    attention launch's own ``k_scale`` / ``v_scale``, which must be the same: one cache)."""

    positions: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cos_sin_cache: torch.Tensor
    slot_mapping: torch.Tensor
    q_norm_weight: torch.Tensor | None = None
    k_norm_weight: torch.Tensor | None = None
    eps: float = 1e-6
    k_scale: float = 1.0
    v_scale: float = 1.0


@triton.jit
def rope_cos_sin(cs_ptr, stride_cs, pos, offs_d, HALF: tl.constexpr):
    """``cos`` and ``sin`` of position ``pos`` spread over a whole head: element ``d`` gets
    the frequency ``d mod D/2`` (``cos_sin_cache[pos] = cat(cos, sin)``)."""
    d_ok = offs_d < 2 * HALF
    f = offs_d % HALF
    cos = tl.load(cs_ptr + pos * stride_cs + f, mask=d_ok, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + f, mask=d_ok, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def rope_rows(
    x_ptr,
    row_off,
    offs_d,
    row_ok,
    w_ptr,
    eps,
    cos,
    sin,
    HAS_NORM: tl.constexpr,
    HALF: tl.constexpr,
    DT: tl.constexpr,
    CG: tl.constexpr,
):
    """Rows ``x_ptr + row_off[r] + d`` (one head each) normalised (``HAS_NORM``: weight
    ``w_ptr``) and rotated; ``[R, BLOCK_D]`` in ``DT``, masked rows and columns 0. ``CG``:
    load the rows from L2 (written by another program of the same launch)."""
    D: tl.constexpr = 2 * HALF
    d_ok = offs_d < D
    mask = row_ok[:, None] & d_ok[None, :]
    partner = (offs_d + HALF) % D
    if CG:
        x = tl.load(x_ptr + row_off[:, None] + offs_d[None, :], mask=mask, other=0.0, cache_modifier=".cg").to(
            tl.float32
        )
        xr = tl.load(x_ptr + row_off[:, None] + partner[None, :], mask=mask, other=0.0, cache_modifier=".cg").to(
            tl.float32
        )
    else:
        x = tl.load(x_ptr + row_off[:, None] + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        xr = tl.load(x_ptr + row_off[:, None] + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        rstd = tl.rsqrt(tl.sum(x * x, 1) / D + eps)
        w = tl.load(w_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        wr = tl.load(w_ptr + partner, mask=d_ok, other=0.0).to(tl.float32)
        x = ((x * rstd[:, None]).to(DT).to(tl.float32) * w[None, :]).to(DT).to(tl.float32)
        xr = ((xr * rstd[:, None]).to(DT).to(tl.float32) * wr[None, :]).to(DT).to(tl.float32)
    sign = tl.where(offs_d < HALF, -1.0, 1.0)
    return (x * cos[None, :] + (sign[None, :] * xr) * sin[None, :]).to(DT)


@triton.jit
def add_new_key(q, k_new, v_new, m_i, l_i, acc, row_ok, scale_log2, P_DT: tl.constexpr):
    """The online softmax's step for the one new key held in registers (``k_new``/``v_new``
    ``[1, D]``, rotated, in the cache dtype) against the query rows ``q`` ``[R, D]``: returns
    the updated ``(m_i, l_i, acc)``, P rounded to ``P_DT`` as the tiles' P is (base-2 scores;
    an FP8 cache's ``k_scale`` is in ``scale_log2``, its ``v_scale`` applied to ``acc`` later,
    as for the tiles)."""
    s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), 1) * scale_log2
    s_new = tl.where(row_ok, s_new, float("-inf"))
    m_new = tl.maximum(m_i, s_new)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p_new = tl.exp2(s_new - m_safe)
    alpha = tl.exp2(m_i - m_safe)
    p_lo = p_new.to(P_DT).to(tl.float32)
    acc = acc * alpha[:, None] + p_lo[:, None] * v_new.to(tl.float32)[None, :]
    return m_new, l_i * alpha + p_new, acc
