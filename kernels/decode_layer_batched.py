"""GEMV phases of the one-launch decoder layer for a small batch (``kernels.decode_layer``
with ``M`` > 1 tokens, one a request): each weight tile is read once for all ``M`` rows,
multiplied on the tensor cores (the rows padded to ``BLOCK_M`` = 16).

Same contract and rounding as the batch-1 phases (``kernels.decode_layer_phases``): the
input ``((x [+ r]) [* g])`` is rounded to the dtype before the product, each row's ``rstd``
is applied after it, gate and up are rounded before SiLU*mul. Activations are row-major
``[M, K]`` (outputs ``[M, N]``); whatever another program stored is read with ``.cg``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.decode_layer_phases import input_chunk, prefetch_block, store_rows, weight_tile


@triton.jit
def sum_squares_rows(x_ptr, r_ptr, s_out_ptr, pid, M, K, HAS_RES: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Per row ``m < M``: ``sum(s^2)`` of ``s = x[m] (+ r[m])`` rounded to the dtype
    (``[BLOCK_M]`` float32); program 0 stores ``s`` (the new residual) to ``s_out_ptr``."""
    DT = x_ptr.dtype.element_ty
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    stored = tl.where(pid == 0, M, 0)  # program 0 stores the rows
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        ok = m_ok[:, None] & (ks < K)[None, :]
        off = offs_m[:, None] * K + ks[None, :]
        s = tl.load(x_ptr + off, mask=ok, other=0.0, cache_modifier=".cg")
        if HAS_RES:
            s = (s.to(tl.float32) + tl.load(r_ptr + off, mask=ok, other=0.0,
                                            cache_modifier=".cg").to(tl.float32)).to(DT)
        tl.store(s_out_ptr + off, s, mask=ok & (offs_m < stored)[:, None])
        sf = s.to(tl.float32)
        ss += tl.sum(sf * sf, 1)
    return ss


@triton.jit
def skinny_phase(pid, P, M, x_ptr, r_ptr, g_ptr, rstd, w_ptr, y_ptr, rin_ptr, N_OUT, K, up_off,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 ROW_MUL: tl.constexpr, HAS_RES: tl.constexpr, NORM: tl.constexpr,
                 ACT: tl.constexpr, EPI_RES: tl.constexpr, UPCAST: tl.constexpr,
                 IEEE: tl.constexpr, AHEAD: tl.constexpr, ESZ: tl.constexpr,
                 TWO_RANGES: tl.constexpr):
    """``kernels.decode_layer_phases.gemv_phase`` for ``M`` rows: this program's row blocks
    of ``y[m] = act((a[m] @ W^T) * rstd[m])`` (``rstd``: ``[BLOCK_M]``). ``EPI_RES``:
    stores ``(y + rin) -> dtype`` and returns each row's sum of squares over this program's
    columns (``[BLOCK_M]``). The next step's weight tile and input chunk are loaded while
    this one multiplies; ``AHEAD`` row blocks are bulk-prefetched into L2 ahead."""
    DT = w_ptr.dtype.element_ty
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    KT = tl.cdiv(K, BLOCK_K)
    n_blocks = tl.cdiv(N_OUT, BLOCK_N)
    total = tl.cdiv(n_blocks - pid, P) * KT
    w_nxt, wu_nxt, _ = weight_tile(w_ptr, pid, P, 0, total, N_OUT, K, up_off, BLOCK_N, BLOCK_K,
                                   ROW_MUL, ACT)
    a_ok = m_ok[:, None] & (offs_k < K)[None, :]
    x_nxt = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=a_ok, other=0.0,
                    cache_modifier=".cg")
    r_nxt = x_nxt
    if HAS_RES:
        r_nxt = tl.load(r_ptr + offs_m[:, None] * K + offs_k[None, :], mask=a_ok, other=0.0,
                        cache_modifier=".cg")
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for i in range(0, total):
        kc = i % KT
        k0 = kc * BLOCK_K
        w = w_nxt
        wu = wu_nxt
        xc = x_nxt
        rc = r_nxt
        w_nxt, wu_nxt, nk = weight_tile(w_ptr, pid, P, i + 1, total, N_OUT, K, up_off, BLOCK_N,
                                        BLOCK_K, ROW_MUL, ACT)
        na_ok = m_ok[:, None] & (nk < K)[None, :]
        x_nxt = tl.load(x_ptr + offs_m[:, None] * K + nk[None, :], mask=na_ok, other=0.0,
                        cache_modifier=".cg")
        if HAS_RES:
            r_nxt = tl.load(r_ptr + offs_m[:, None] * K + nk[None, :], mask=na_ok, other=0.0,
                            cache_modifier=".cg")
        if AHEAD > 0:
            if kc == 0:
                prefetch_block(w_ptr, pid + (i // KT + AHEAD) * P, N_OUT, K, up_off, BLOCK_N,
                               ROW_MUL, TWO_RANGES, ESZ)
        a = input_chunk(xc, rc, g_ptr, k0, offs_k, K, HAS_RES, NORM, DT)
        if UPCAST:  # the interpreter's bf16 tl.dot is wrong: same values in float32
            acc += tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            if ACT:
                acc_u += tl.dot(a.to(tl.float32), tl.trans(wu.to(tl.float32)),
                                input_precision="ieee")
        elif IEEE:
            acc += tl.dot(a, tl.trans(w), input_precision="ieee")
            if ACT:
                acc_u += tl.dot(a, tl.trans(wu), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(w))
            if ACT:
                acc_u += tl.dot(a, tl.trans(wu))

        if kc == KT - 1:
            out_rows = (pid + (i // KT) * P) * BLOCK_N + offs_r
            o_ok = m_ok[:, None] & (out_rows < N_OUT)[None, :]
            o_off = offs_m[:, None] * N_OUT + out_rows[None, :]
            ss += store_rows(acc * rstd[:, None], acc_u * rstd[:, None], y_ptr, rin_ptr, o_off,
                             o_ok, DT, ACT, EPI_RES, 1)
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    return ss
