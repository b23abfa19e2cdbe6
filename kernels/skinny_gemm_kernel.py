"""Triton skinny GEMM kernel (decode-sized M) with fused RMSNorm prologue and SiLU*mul epilogue.

The host side (a call's config, the launch) is ``kernels.skinny_gemm``.

``y = act(norm(x [+ residual]) @ W^T + b)`` for ``x [M, K]`` with small ``M``
(decode batches), ``W [N, K]`` row-major as ``nn.Linear`` stores it. At decode
the projections are bound by reading ``W`` once; every program owns
``BLOCK_N`` output columns for all ``M`` rows, so ``W`` is read exactly once
and the ``M`` rows of ``x`` come from L2.

Fusions, each removing a launch per layer (and its round trip through HBM):

* **RMSNorm prologue** (``norm_weight``, optional ``residual``): the input
  ``s = x + residual`` (rounded to the dtype; program 0 stores it as the new
  residual) is normalised on the fly. Each program accumulates ``sum(s^2)``
  over its K loop, multiplies ``s * norm_weight`` into the product and scales
  the result by ``rstd`` at the end: ``W @ (rstd * s * g) = rstd * (W @ (s * g))``.
  The math is the reference's; only the rounding point of the normalised input
  moves (it is rounded before the ``rstd`` scale rather than after), so results
  agree within 16-bit tolerance, not bit for bit.
* **SiLU-and-mul epilogue** (``act="silu_and_mul"`` on a fused gate|up weight
  ``[2I, K]``): the program computes gate rows ``n`` and up rows ``I + n``
  together and writes ``silu(gate) * up`` (rounded like the reference: gate and
  up to the dtype, silu to the dtype, the product to the dtype).
  ``act="silu_and_mul_pairs"`` takes the row-interleaved layout instead (gate row
  ``n`` at ``2n``, up row ``n`` at ``2n + 1``): a program then streams one
  contiguous row set, as a plain GEMV does, and splits the pairs in registers.

* **FP8 weight-only** (``HAS_WSCALE``): an e4m3 weight tile is widened in registers and
  multiplied by the 16-bit (not quantized) activations; each weight row's float32 scale
  (``ws_ptr``) multiplies the accumulator in the epilogue. Half the weight bytes.
* **Norm handoff** (``kernels.norm_handoff``): ``EPI_NORM`` does the next RMSNorm's
  elementwise part in the epilogue (residual add, ``s * g``, sum-of-squares partials);
  ``PRE_NORMED`` streams such an ``s * g`` and applies ``rstd`` from the partials at the end.

``USE_DOT`` picks the tensor-core path (``x`` padded to ``BLOCK_M >= 16`` rows,
``tl.dot`` on a ``[BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N]`` tile, loads
software-pipelined by ``num_stages``); without it (``M == 1`` only) a
``[BLOCK_N, BLOCK_K]`` float32 FMA accumulator is reduced once at the end
(``PREFETCH`` double-buffers the W tile in registers; under PDL, ``PRELOAD`` peels the
first one or two K chunks so their W tiles load before the wait). The sum of squares of
the norm is also kept per lane and reduced once: a reduction inside the
streaming loop costs barriers every iteration (2-10x slower; docs/decisions.md).

``M`` is not specialised, so every padded CUDA-graph batch size of one ``BLOCK_M``
shares one compilation.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.norm_handoff import handoff_norm, handoff_rstd
from kernels.pdl import wait_and_release


@triton.jit
def _skinny_step(
    k0,
    w,
    wu,
    acc,
    acc_u,
    ss,
    x_rows,
    r_rows,
    nr_rows,
    nw_ptr,
    m_ok,
    res_ok,
    offs_k,
    K,
    HAS_NORM: tl.constexpr,
    HAS_RES: tl.constexpr,
    ACT: tl.constexpr,
    USE_DOT: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One K chunk: the x rows (+ residual, stored by program 0; normalised) against the
    weight tile(s) ``w`` (``wu``: the stacked up rows) already loaded."""
    if EVEN_K:
        x_mask = m_ok[:, None]
    else:
        k_ok = (k0 + offs_k) < K
        x_mask = m_ok[:, None] & k_ok[None, :]
    a = tl.load(x_rows + k0, mask=x_mask, other=0.0)
    if HAS_RES:
        r = tl.load(r_rows + k0, mask=x_mask, other=0.0)
        a = (a.to(tl.float32) + r.to(tl.float32)).to(a.dtype)
        if EVEN_K:
            tl.store(nr_rows + k0, a, mask=res_ok[:, None])
        else:
            tl.store(nr_rows + k0, a, mask=res_ok[:, None] & k_ok[None, :])
    if HAS_NORM:
        af = a.to(tl.float32)
        ss += af * af
        if EVEN_K:
            g = tl.load(nw_ptr + k0 + offs_k).to(tl.float32)
        else:
            g = tl.load(nw_ptr + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        a = (af * g[None, :]).to(a.dtype)
    if USE_DOT:
        if UPCAST:  # the interpreter's dot mishandles bf16: exact fp32 copies instead
            acc += tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            if ACT == 1:
                acc_u += tl.dot(a.to(tl.float32), tl.trans(wu.to(tl.float32)), input_precision="ieee")
        elif IEEE:  # (.to: FP8 weights widened in registers; a no-op for 16-bit ones)
            acc += tl.dot(a, tl.trans(w.to(a.dtype)), input_precision="ieee")
            if ACT == 1:
                acc_u += tl.dot(a, tl.trans(wu.to(a.dtype)), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(w.to(a.dtype)))
            if ACT == 1:
                acc_u += tl.dot(a, tl.trans(wu.to(a.dtype)))
    else:
        af1 = a.to(tl.float32)  # [1, BLOCK_K], broadcast over the BLOCK_N rows
        acc += w.to(tl.float32) * af1
        if ACT == 1:
            acc_u += wu.to(tl.float32) * af1
    return acc, acc_u, ss


@triton.jit
def _first_tiles(w_rows, mask, up_rows_off, ACT: tl.constexpr):
    """The first K chunk's weight tile and (stacked gate|up) its up tile (else the same)."""
    w = tl.load(w_rows, mask=mask, other=0.0)
    wu = w
    if ACT == 1:
        wu = tl.load(w_rows + up_rows_off, mask=mask, other=0.0)
    return w, wu


@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(
    x_ptr,
    r_ptr,
    nw_ptr,
    w_ptr,
    b_ptr,
    ws_ptr,
    y_ptr,
    nr_ptr,
    ss_ptr,
    M,
    N_OUT,
    K,
    up_off,
    eps,
    n_parts,
    stride_xm,
    stride_rm,
    stride_wn,
    stride_ym,
    stride_nrm,
    HAS_NORM: tl.constexpr,
    HAS_RES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    USE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    PREFETCH: tl.constexpr,
    PRELOAD: tl.constexpr = 0,
    USE_PDL: tl.constexpr = False,
    EPI_NORM: tl.constexpr = False,
    PRE_NORMED: tl.constexpr = False,
    BLOCK_P: tl.constexpr = 1,
    HAS_WSCALE: tl.constexpr = False,
):
    pid = tl.program_id(0)
    DT = x_ptr.dtype.element_ty
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    res_ok = m_ok & ((offs_m * 0 + pid) == 0)  # program 0 stores the new residual
    if ACT == 2:  # BLOCK_N interleaved weight rows -> BLOCK_N // 2 outputs
        n_ok = offs_n < 2 * N_OUT
    else:
        n_ok = offs_n < N_OUT
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    x_rows = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    r_rows = r_ptr + offs_m[:, None] * stride_rm + offs_k[None, :]
    nr_rows = nr_ptr + offs_m[:, None] * stride_nrm + offs_k[None, :]
    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    # sum(s^2) kept per lane and reduced once after the loop: a cross-thread
    # reduction every iteration would put barriers in the streaming loop.
    ss = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    # The first weight tile (no kernel writes weights) is in flight before the PDL wait
    # for the kernel that produced x and the residual: with register double-buffering
    # (PREFETCH), or as PRELOAD (1 or 2) peeled K chunks (the host's choice under PDL).
    # (The host never sets both: a peeled chunk would be counted twice.)
    first_mask = n_ok[:, None] & (offs_k[None, :] < K)
    if PREFETCH or PRELOAD >= 1:
        w_nxt, wu_nxt = _first_tiles(w_rows, first_mask, up_off * stride_wn, ACT)
    if PRELOAD >= 2:
        w_2, wu_2 = _first_tiles(
            w_rows + BLOCK_K, n_ok[:, None] & (BLOCK_K + offs_k[None, :] < K), up_off * stride_wn, ACT
        )
    wait_and_release(USE_PDL)

    k_first = 0
    if PRELOAD >= 1:
        acc, acc_u, ss = _skinny_step(
            0,
            w_nxt,
            wu_nxt,
            acc,
            acc_u,
            ss,
            x_rows,
            r_rows,
            nr_rows,
            nw_ptr,
            m_ok,
            res_ok,
            offs_k,
            K,
            HAS_NORM,
            HAS_RES,
            ACT,
            USE_DOT,
            EVEN_K,
            IEEE,
            UPCAST,
        )
        k_first = BLOCK_K
    if PRELOAD >= 2:
        if K > BLOCK_K:  # (x rows past K must not be read)
            acc, acc_u, ss = _skinny_step(
                BLOCK_K,
                w_2,
                wu_2,
                acc,
                acc_u,
                ss,
                x_rows,
                r_rows,
                nr_rows,
                nw_ptr,
                m_ok,
                res_ok,
                offs_k,
                K,
                HAS_NORM,
                HAS_RES,
                ACT,
                USE_DOT,
                EVEN_K,
                IEEE,
                UPCAST,
            )
        k_first = 2 * BLOCK_K
    for k0 in range(k_first, K, BLOCK_K):
        if EVEN_K:
            w_mask = n_ok[:, None]
        else:
            w_mask = n_ok[:, None] & ((k0 + offs_k) < K)[None, :]
        if PREFETCH:
            w = w_nxt
            nxt_mask = n_ok[:, None] & ((k0 + BLOCK_K + offs_k) < K)[None, :]
            w_nxt = tl.load(w_rows + (k0 + BLOCK_K), mask=nxt_mask, other=0.0)
            wu = w
            if ACT == 1:
                wu = wu_nxt
                wu_nxt = tl.load(w_rows + up_off * stride_wn + (k0 + BLOCK_K), mask=nxt_mask, other=0.0)
        else:
            w = tl.load(w_rows + k0, mask=w_mask, other=0.0)
            wu = w
            if ACT == 1:
                wu = tl.load(w_rows + up_off * stride_wn + k0, mask=w_mask, other=0.0)
        acc, acc_u, ss = _skinny_step(
            k0,
            w,
            wu,
            acc,
            acc_u,
            ss,
            x_rows,
            r_rows,
            nr_rows,
            nw_ptr,
            m_ok,
            res_ok,
            offs_k,
            K,
            HAS_NORM,
            HAS_RES,
            ACT,
            USE_DOT,
            EVEN_K,
            IEEE,
            UPCAST,
        )

    if USE_DOT:
        y = acc
        y_u = acc_u
    else:
        y = tl.sum(acc, 1)[None, :]
        y_u = tl.sum(acc_u, 1)[None, :]
    if HAS_WSCALE:  # FP8 weights: one scale per weight row (before any pair split)
        y = y * tl.load(ws_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
        if ACT == 1:
            y_u = y_u * tl.load(ws_ptr + up_off + offs_n, mask=n_ok, other=0.0)[None, :]
    if HAS_NORM:
        rstd = tl.rsqrt(tl.sum(ss, 1) / K + eps)
        y = y * rstd[:, None]
        y_u = y_u * rstd[:, None]
    if PRE_NORMED:
        rstd = handoff_rstd(ss_ptr, offs_m, m_ok, n_parts, K, eps, BLOCK_M, BLOCK_P)
        y = y * rstd[:, None]
        y_u = y_u * rstd[:, None]
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if ACT == 1:
            y_u += tl.load(b_ptr + up_off + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if ACT == 2:  # columns (2j, 2j + 1) are output j's (gate, up)
        y, y_u = tl.split(tl.reshape(y, [BLOCK_M, BLOCK_N // 2, 2]))
        offs_n = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        n_ok = offs_n < N_OUT
    if EPI_NORM:  # (ACT == 0, no bias: the host checks)
        y = handoff_norm(
            y, offs_m, offs_n, m_ok, n_ok, r_ptr, nw_ptr, nr_ptr, ss_ptr, stride_rm, stride_nrm, n_parts, pid, DT
        )
    if ACT:
        gate = y.to(DT).to(tl.float32)
        up = y_u.to(DT).to(tl.float32)
        y = (gate / (1.0 + tl.exp(-gate))).to(DT).to(tl.float32) * up
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, y.to(DT).to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
