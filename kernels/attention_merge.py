"""The in-launch merge of split-KV partials (``kernels.paged_attention``'s fused reduce).

The last split program of a (query block, KV head) to arrive reads every used split's
partial output and log-sum-exp back from L2 and writes the merged rows: the splits'
softmax-weighted mean, in one pass with a running max over the splits (as flash attention
runs over key tiles). No load depends on another, so every lse and partial load is in flight
at once; the counter's re-arm is relaxed (see ``merge_splits``).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def merge_splits(
    out_ptr,
    lse_ptr,
    final_ptr,
    sem,
    used,
    o_rows,
    l_rows,
    f_rows,
    offs_m,
    offs_d,
    row_ok,
    d_ok,
    stride_os,
    stride_ls,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """Merge splits ``0..used-1`` into ``final_ptr`` and re-arm the arrival counter ``sem``.

    The re-arm may be relaxed: nothing reads the counter again in this launch (every split
    has arrived), and the next launch that bumps it starts after this one completes --
    kernel boundaries, graph replays and PDL waits (which wait for the whole previous grid)
    all order it."""
    merged = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_run = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    w_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    # Unrolled: the partials' loads are independent and all in flight at once (a rolled
    # loop pays one L2 round trip per split); unused splits are masked.
    for sp in tl.static_range(NUM_SPLITS):
        sp_ok = row_ok & ((offs_m * 0 + sp) < used)
        lse_s = tl.load(lse_ptr + sp * stride_ls + l_rows, mask=sp_ok, other=float("-inf"), cache_modifier=".cg")
        part = tl.load(
            out_ptr + sp * stride_os + o_rows[:, None] + offs_d[None, :],
            mask=sp_ok[:, None] & d_ok[None, :],
            other=0.0,
            cache_modifier=".cg",
        )
        m_new = tl.maximum(m_run, lse_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no split with keys yet
        alpha = tl.exp2(m_run - m_safe)
        w_s = tl.exp2(lse_s - m_safe)
        merged = merged * alpha[:, None] + w_s[:, None] * part
        w_sum = w_sum * alpha + w_s
        m_run = m_new
    merged = merged / tl.where(w_sum > 0.0, w_sum, 1.0)[:, None]
    tl.store(
        final_ptr + f_rows[:, None] + offs_d[None, :],
        merged.to(final_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )
    tl.atomic_xchg(sem, 0, sem="relaxed")  # re-armed for the next launch / graph replay
