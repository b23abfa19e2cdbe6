"""Triton FP8 (e4m3) GEMM with per-row activation and per-column weight scales.

``y = (xq @ wq^T) * x_scale[:, None] * w_scale[None, :] (+ bias)``, the math of
``kernels.fp8_reference.fp8_linear_reference``: ``xq [M, K]`` and ``wq [N, K]`` e4m3 (row-major,
as ``nn.Linear`` stores the weight), float32 scales, float32 accumulation by ``tl.dot`` on the
e4m3 tiles, the scales and bias applied once in the epilogue, rounded once to ``out_dtype``.

The weight tile is loaded as ``[BLOCK_K, BLOCK_N]`` from the ``[N, K]`` weight (K contiguous:
the K-major B operand Hopper's fp8 wgmma takes), the activation tile ``[BLOCK_M, BLOCK_K]``.
Below 64 rows (one warpgroup's wgmma) Triton falls back to ``mma.sync`` on fp16 copies of the
tiles. Serving sends batches of up to 16 rows to the weight-only skinny GEMM instead
(``kernels.fp8_linear``); the "skinny" class here serves direct calls.

Batch classes (``select_fp8_config``): "skinny" (M <= 16), "tile" (M <= 256), "prefill". Where
the output tiles are too few to fill the GPU, K is split: each split stores its float32
partial tile and a second launch sums them in split order, then applies the epilogue
(deterministic: no atomics).

On sm_90 Triton accumulates an fp8 wgmma chain in reduced precision unless told otherwise;
``fast_accum=False`` (the default) promotes to the float32 accumulator every ``BLOCK_K``
elements (``max_num_imprecise_acc``), as DeepSeek-V3 does every 128.

No host syncs; the grid depends on CPU shapes only; ``M`` and the split count are not
specialised, so every batch size of a class shares one compilation per weight shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_reference import FP8_DTYPE
from kernels.tuning_file import check_tiles

NUM_SMS = 132  # an H100 SXM's; the split-K target of select_fp8_config
MAX_SPLIT_K = 16
INT_KEYS = ("block_m", "block_n", "block_k", "group_m", "split_k", "num_warps", "num_stages")


@triton.jit
def _epilogue(acc, offs_m, offs_n, M, N, xs_ptr, ws_ptr, b_ptr, out_ptr, stride_om, HAS_BIAS: tl.constexpr):
    """``acc * x_scale[m] * w_scale[n] (+ bias[n])`` in float32, rounded once, stored masked."""
    m_ok = offs_m < M
    n_ok = offs_n < N
    xs = tl.load(xs_ptr + offs_m, mask=m_ok, other=0.0)
    ws = tl.load(ws_ptr + offs_n, mask=n_ok, other=0.0)
    y = acc * xs[:, None] * ws[None, :]
    if HAS_BIAS:
        y = y + tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    o_off = offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptr + o_off, y.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["M", "num_splits"])
def _fp8_gemm_kernel(
    x_ptr,
    w_ptr,
    xs_ptr,
    ws_ptr,
    b_ptr,
    out_ptr,
    part_ptr,
    M,
    N,
    K,
    num_splits,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_om,
    stride_ps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FAST_ACCUM: tl.constexpr,
):
    # grouped ordering: GROUP_M M tiles run over the N tiles together (a W tile read once
    # from HBM serves them all); with one M tile (decode) plain N order
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_size
    pid_n = (pid % in_group) // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # rows / columns past M / N read row 0.. again (never stored): no masks on those loads
    rows = (offs_m % M).to(tl.int64)
    cols = (offs_n % N).to(tl.int64)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    ks = k_lo + offs_k
    a_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :]  # [BLOCK_M, BLOCK_K]
    b_ptrs = w_ptr + cols[None, :] * stride_wn + ks[:, None]  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = offs_k < k_hi - k0
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        if FAST_ACCUM:
            acc = tl.dot(a, b, acc)
        else:
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if num_splits > 1:
        mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        p_off = split.to(tl.int64) * stride_ps + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(part_ptr + p_off, acc, mask=mask)
    else:
        _epilogue(acc, offs_m, offs_n, M, N, xs_ptr, ws_ptr, b_ptr, out_ptr, stride_om, HAS_BIAS)


@triton.jit(do_not_specialize=["M", "num_splits"])
def _split_reduce_kernel(
    part_ptr,
    xs_ptr,
    ws_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    num_splits,
    stride_ps,
    stride_om,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """``sum_s part[s]`` in split order (deterministic), then the GEMM's epilogue."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (offs_r < M)[:, None] & (offs_c < N)[None, :]
    p_ptrs = part_ptr + offs_r.to(tl.int64)[:, None] * N + offs_c[None, :]
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for _ in range(0, num_splits):
        acc += tl.load(p_ptrs, mask=mask, other=0.0)
        p_ptrs += stride_ps
    _epilogue(acc, offs_r, offs_c, M, N, xs_ptr, ws_ptr, b_ptr, out_ptr, stride_om, HAS_BIAS)


def _split_k(tiles: int, k_blocks: int, target: int) -> int:
    """Splits of K giving ``tiles`` programs at least ``target`` (preferring a divisor of the
    K blocks: equal slices), or 1 where the tiles alone reach half of it."""
    if 2 * tiles >= target or k_blocks < 2:
        return 1
    need = -(-target // tiles)
    cap = min(k_blocks, MAX_SPLIT_K)
    return next((s for s in range(need, cap + 1) if k_blocks % s == 0), min(need, cap))


def select_fp8_config(m: int, n: int, k: int, num_sms: int = NUM_SMS) -> dict:
    """Block sizes for ``[m, k] x [n, k]^T`` by batch class (CPU ints only): "skinny"
    (``m <= 16``, split-K to ~2 programs an SM), "tile" (``m <= 256``, split-K to ~1 program an
    SM) or "prefill" (128x128 tiles, grouped ordering, no split)."""
    if m <= 16:
        cfg = dict(kind="skinny", block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=5)
        target = 2 * num_sms
    elif m <= 256:
        cfg = dict(kind="tile", block_m=64, block_n=128, block_k=128, group_m=8, num_warps=4, num_stages=4)
        target = num_sms
    else:
        cfg = dict(kind="prefill", block_m=128, block_n=128, block_k=128, group_m=8, num_warps=8, num_stages=4)
        target = 0
    tiles = triton.cdiv(m, cfg["block_m"]) * triton.cdiv(n, cfg["block_n"])
    split = _split_k(tiles, triton.cdiv(k, cfg["block_k"]), target) if target else 1
    return dict(cfg, split_k=split, fast_accum=False)


def check_config(cfg: dict) -> None:
    """Reject a config the kernel cannot run (a hand-written or swept one)."""
    check_tiles(cfg, INT_KEYS, "fp8 GEMM")


def fp8_gemm_triton(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    config: dict | None = None,
) -> torch.Tensor:
    """``y [M, N]`` of ``fp8_linear_reference``'s math: ``xq [M, K]``, ``wq [N, K]`` e4m3 (unit
    stride along K), ``x_scale [M]`` and ``w_scale [N]`` float32, ``bias [N]`` (any float
    dtype) or None. ``config``: None for ``select_fp8_config``'s, else its keys."""
    m, k = xq.shape
    n = wq.shape[0]
    if xq.dtype != FP8_DTYPE or wq.dtype != FP8_DTYPE:
        raise ValueError(f"fp8 GEMM: operands must be {FP8_DTYPE}, got {xq.dtype} and {wq.dtype}")
    if wq.shape[1] != k or xq.stride(-1) != 1 or wq.stride(-1) != 1:
        raise ValueError(f"fp8 GEMM: shapes {tuple(xq.shape)} x {tuple(wq.shape)} (or strides) do not fit")
    if (
        x_scale.shape != (m,)
        or w_scale.shape != (n,)
        or x_scale.dtype != torch.float32
        or w_scale.dtype != x_scale.dtype
    ):
        raise ValueError("fp8 GEMM: x_scale [M] and w_scale [N] must be float32")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"fp8 GEMM: bias must be [N], got {tuple(bias.shape)}")
    x_scale, w_scale = x_scale.contiguous(), w_scale.contiguous()
    bias = None if bias is None else bias.contiguous()
    cfg = select_fp8_config(m, n, k) if config is None else config
    check_config(cfg)
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0 or n == 0:
        return out
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    k_blocks = triton.cdiv(k, bk)
    split = max(1, min(cfg["split_k"], k_blocks))
    k_per_split = triton.cdiv(k_blocks, split) * bk
    # float32 partials [split, M, N]; the split stride a multiple of 16 elements, so that its
    # divisibility (which Triton specialises on) does not follow M
    plane = triton.cdiv(m * n, 16) * 16
    part = torch.empty(split * plane if split > 1 else 1, dtype=torch.float32, device=xq.device)
    _fp8_gemm_kernel[(triton.cdiv(m, bm) * triton.cdiv(n, bn), split)](
        xq,
        wq,
        x_scale,
        w_scale,
        bias,
        out,
        part,
        m,
        n,
        k,
        split,
        k_per_split,
        xq.stride(0),
        wq.stride(0),
        out.stride(0),
        plane,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        GROUP_M=cfg["group_m"],
        EVEN_K=k % bk == 0,
        HAS_BIAS=bias is not None,
        FAST_ACCUM=bool(cfg.get("fast_accum", False)),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    if split > 1:
        block_r, block_c = 16, 128
        _split_reduce_kernel[(triton.cdiv(m, block_r), triton.cdiv(n, block_c))](
            part,
            x_scale,
            w_scale,
            bias,
            out,
            m,
            n,
            split,
            plane,
            out.stride(0),
            BLOCK_R=block_r,
            BLOCK_C=block_c,
            HAS_BIAS=bias is not None,
            num_warps=4,
        )
    return out
