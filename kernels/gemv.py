"""Persistent batch-1 GEMV with the skinny GEMM's fusions (RMSNorm prologue, SiLU*mul epilogue).

``y = act(norm(x [+ residual]) @ W^T + b)`` for ``x [1, K]``: the same contract and
the same rounding as ``kernels.skinny_gemm`` (reference:
``kernels.reference.skinny_linear_reference``), a different schedule.

Why another kernel for M = 1: a decode step at batch 1 is ~130 GEMVs of 8-235 MB,
and the one-program-per-row-block kernel loses microseconds on each to the ramp of every
CTA wave and to the ragged last wave. Here the grid is ``P`` programs, at most what is resident at
once (``ctas_per_sm`` per SM, sized so the row blocks divide evenly over them), and
each program walks its row blocks ``pid, pid + P, ...`` as one flat loop over
``(row block, K chunk)`` with the next weight tile always in flight (register
double buffering), so a program streams from its first load to its last without
a drain between row blocks, and no SM idles on a last wave.

The norm's ``rstd`` is computed once per program in a prologue over ``x`` (L2
resident: 2-28 KB); program 0 stores ``x + residual`` as the new residual. The
first weight tile is loaded before the PDL wait (weights are never written by a
kernel of the step). No host syncs; the grid depends on ``N`` and the SM count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.pdl import wait_and_release


@triton.jit
def _gemv_kernel(
    x_ptr,
    r_ptr,
    nw_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    nr_ptr,
    N_OUT,
    K,
    up_off,
    eps,
    stride_wn,
    HAS_NORM: tl.constexpr,
    HAS_RES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    store_res = tl.where(pid == 0, K, 0)  # program 0 stores the new residual
    DT = x_ptr.dtype.element_ty
    offs_r = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    KT = tl.cdiv(K, BLOCK_K)
    n_blocks = tl.cdiv(N_OUT, BLOCK_N)
    total = tl.cdiv(n_blocks - pid, P) * KT  # this program's (row block, K chunk) steps

    # First weight tile: in flight before the PDL wait.
    rows = pid * BLOCK_N + offs_r
    w_ok = (rows < N_OUT)[:, None] & (offs_k < K)[None, :]
    w_row = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    w_nxt = tl.load(w_row, mask=w_ok, other=0.0)
    if ACT:
        wu_nxt = tl.load(w_row + up_off * stride_wn, mask=w_ok, other=0.0)
    wait_and_release(USE_PDL)

    rstd = 1.0
    if HAS_NORM:  # prologue: sum(s^2) of s = x (+ residual), program 0 stores s
        ss = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + offs_k) < K
            s = tl.load(x_ptr + k0 + offs_k, mask=k_ok, other=0.0)
            if HAS_RES:
                s = (s.to(tl.float32) + tl.load(r_ptr + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)).to(DT)
                tl.store(nr_ptr + k0 + offs_k, s, mask=(k0 + offs_k) < store_res)
            sf = s.to(tl.float32)
            ss += sf * sf
        rstd = tl.rsqrt(tl.sum(ss, 0) / K + eps)

    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for i in range(0, total):
        kc = i % KT
        k0 = kc * BLOCK_K
        w = w_nxt
        if ACT:
            wu = wu_nxt
        # the next step's tile (masked off past the end): in flight during this step's FMAs
        j = i + 1
        nrows = (pid + (j // KT) * P) * BLOCK_N + offs_r
        nk = (j % KT) * BLOCK_K + offs_k
        row_end = tl.where(j < total, N_OUT, 0)  # past this program's last step: load nothing
        n_ok = (nrows < row_end)[:, None] & (nk < K)[None, :]
        n_row = w_ptr + nrows.to(tl.int64)[:, None] * stride_wn + nk[None, :]
        w_nxt = tl.load(n_row, mask=n_ok, other=0.0)
        if ACT:
            wu_nxt = tl.load(n_row + up_off * stride_wn, mask=n_ok, other=0.0)

        k_ok = (k0 + offs_k) < K
        a = tl.load(x_ptr + k0 + offs_k, mask=k_ok, other=0.0)
        if HAS_RES:
            a = (a.to(tl.float32) + tl.load(r_ptr + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)).to(DT)
        if HAS_NORM:  # rounded before the rstd scale, as kernels.skinny_gemm does
            g = tl.load(nw_ptr + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            a = (a.to(tl.float32) * g).to(DT)
        af = a.to(tl.float32)[None, :]
        acc += w.to(tl.float32) * af
        if ACT:
            acc_u += wu.to(tl.float32) * af

        if kc == KT - 1:  # this row block is done: epilogue and store
            out_rows = (pid + (i // KT) * P) * BLOCK_N + offs_r
            o_ok = out_rows < N_OUT
            y = tl.sum(acc, 1) * rstd
            if HAS_BIAS:
                y += tl.load(b_ptr + out_rows, mask=o_ok, other=0.0).to(tl.float32)
            if ACT:
                y_u = tl.sum(acc_u, 1) * rstd
                if HAS_BIAS:
                    y_u += tl.load(b_ptr + up_off + out_rows, mask=o_ok, other=0.0).to(tl.float32)
                gate = y.to(DT).to(tl.float32)
                up = y_u.to(DT).to(tl.float32)
                y = (gate / (1.0 + tl.exp(-gate))).to(DT).to(tl.float32) * up
            tl.store(y_ptr + out_rows, y.to(DT).to(y_ptr.dtype.element_ty), mask=o_ok)
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)


# Defaults from a sweep (``benchmarks.kernels.bench --only gemv``); per-shape entries of
# kernels/skinny_tuning.json with "kernel": "gemv" override them.
DEFAULT_CONFIG = dict(block_n=4, block_k=1024, num_warps=4, ctas_per_sm=4)


def grid_size(n_blocks: int, max_programs: int) -> int:
    """Programs for ``n_blocks`` row blocks: at most ``max_programs`` (what is resident at
    once), as few as keep the same number of rounds, so every program gets the same
    number of row blocks (or one less)."""
    rounds = -(-n_blocks // max(1, max_programs))
    return max(1, -(-n_blocks // rounds))


def gemv_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    act: str | None = None,
    out_dtype: torch.dtype | None = None,
    config: dict | None = None,
    max_programs: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``kernels.skinny_gemm.skinny_linear_triton``'s contract for ``x [1, K]``:
    returns ``(y, new_residual)``. ``max_programs`` overrides the grid bound (the
    interpreter has no SM count; tests use it to force several rounds)."""
    if x.dim() != 2 or x.shape[0] != 1 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv needs x [1, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if act not in (None, "silu_and_mul"):
        raise ValueError(f"unknown activation {act!r}")
    if residual is not None and norm_weight is None:
        raise ValueError("a residual is only fused into a norm")
    k = x.shape[1]
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    n = weight.shape[0]
    if act is not None and n % 2:
        raise ValueError("silu_and_mul needs an even number of weight rows (gate | up)")
    n_out = n // 2 if act is not None else n
    y = torch.empty((1, n_out), dtype=out_dtype or x.dtype, device=x.device)
    new_res = None
    if residual is not None:
        residual = residual if residual.stride(-1) == 1 else residual.contiguous()
        new_res = torch.empty((1, k), dtype=x.dtype, device=x.device)
    cfg = dict(DEFAULT_CONFIG, **(config or {}))
    block_n = cfg["block_n"]
    block_k = min(cfg["block_k"], max(16, triton.next_power_of_2(k)))
    n_blocks = triton.cdiv(n_out, block_n)
    if max_programs is None:
        max_programs = pdl.sm_count(x.device) * cfg["ctas_per_sm"] if x.is_cuda else n_blocks
    grid = (grid_size(n_blocks, max_programs),)
    launch = pdl.launch_kwargs(x)
    _gemv_kernel[grid](
        x,
        residual if residual is not None else x,
        norm_weight if norm_weight is not None else x,
        weight,
        bias if bias is not None else weight,
        y,
        new_res if new_res is not None else x,
        n_out,
        k,
        n_out,
        float(eps),
        weight.stride(0),
        HAS_NORM=norm_weight is not None,
        HAS_RES=residual is not None,
        HAS_BIAS=bias is not None,
        ACT=act is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=cfg["num_warps"],
        num_stages=1,
        **launch,
    )
    return y, new_res
