"""The split-K tile GEMM with its split sum -- and the next residual add + RMSNorm -- in the
same launch (``SYNCLESS_TILE_FUSED_SUM=1``, an A/B knob; default off until measured on a GPU).

``kernels.tile_gemm.tile_linear_add_norm_triton`` takes two launches: the GEMM's float32
partials, then one program a row that sums them, adds the residual and normalises. At decode
batch sizes that second launch costs a kernel boundary (a few microseconds on an H100) per
projection, twice a layer. Here the programs that finish last do it, as the decode
attention merges its splits (``kernels.attention_merge``):

1. every program stores its partial tile, then bumps its output tile's arrival counter;
2. the last of a tile's ``split_k`` programs sums the partials in split order (the same
   float32 order as the two-launch path), rounds, adds the residual, stores the new
   residual and that tile's per-row sum of squares, then bumps its row block's counter;
3. the last tile of a row block to get there sums those per-tile squares (a fixed tree
   order: deterministic, no float atomics) and writes the normalised rows.

Without the add + norm (``tile_linear_fused``: plain, SiLU*mul pairs, logits) only steps 1
and 2 run, and the result equals the two-launch path's bit for bit. With it, the new
residual equals the two-launch path's bit for bit; the normalised output may differ
by one rounding (its sum of squares reduces in another order). Step 3 holds the row
block in registers a chunk of rows at a time (each ``rows x next_pow2(N)`` elements, at most
``MAX_FUSED_ELEMS``), so rows of up to that many columns take this path. Counters come from
their own zeroed buffer (``kernels.attention_splits._semaphores``, pool ``"tile_gemm"``), each
re-armed by the program that read it last; where none can be had (first use inside a graph
capture) the caller falls back to two launches. No host syncs; no spin waits (no program waits for
another: the last to arrive does the work).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention_splits import _semaphores
from kernels.tile_gemm import (_TL_DTYPES, _check_operands, _silu_mul_pairs, _split_partials,
                               product_flags, tile_product)

SWITCH_ENV = "SYNCLESS_TILE_FUSED_SUM"
MAX_FUSED_ELEMS = 16 * 1024  # step 3's row chunk: rows x next_pow2(N) in registers


def rows_a_chunk(block_m: int, n: int) -> int:
    """Rows step 3 normalises at a time (0: not even one row fits ``MAX_FUSED_ELEMS``,
    see ``applies``)."""
    return min(block_m, MAX_FUSED_ELEMS // triton.next_power_of_2(n))


def enabled() -> bool:
    """``SYNCLESS_TILE_FUSED_SUM`` (default 0): the add + norm split sum inside the GEMM."""
    from kernels.ops import _env_flag

    return _env_flag(SWITCH_ENV, False)


def applies(n: int) -> bool:
    """Whether a row of ``n`` columns fits step 3's registers (then a chunk of rows, a power
    of two, divides every power-of-two ``block_m``)."""
    return triton.next_power_of_2(n) <= MAX_FUSED_ELEMS


@triton.jit
def _product_arrive_sum(x_ptr, w_ptr, part_ptr, sem_ptr, M, N, K, k_per_split,
                        stride_xm, stride_wn, stride_ps, stride_pm,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SPLIT_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """Steps 1 and 2: this program's partial tile, stored, then its arrival at the output
    tile's counter (release: the partial is visible to the last to arrive, whose acquire
    reads it). The last to arrive sums the tile's partials in split order (the two-launch
    path's order), unrolled so that every partial's load is in flight at once, from L2.
    Returns whether this program was the last, that sum (zeros otherwise), the counter and
    the tile's indices and masks."""
    acc, offs_m, offs_n, m_ok, n_ok = tile_product(
        x_ptr, w_ptr, M, N, K, k_per_split, stride_xm, stride_wn,
        BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, IEEE)
    mask = m_ok[:, None] & n_ok[None, :]
    p_off = offs_m.to(tl.int64)[:, None] * stride_pm + offs_n[None, :]
    tl.store(part_ptr + tl.program_id(2).to(tl.int64) * stride_ps + p_off, acc, mask=mask)
    tl.debug_barrier()
    tile_sem = sem_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    last = tl.atomic_add(tile_sem, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1
    tot = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if last:
        for s in tl.static_range(SPLIT_K):
            tot += tl.load(part_ptr + s * stride_ps.to(tl.int64) + p_off, mask=mask, other=0.0,
                           cache_modifier=".cg")
    return last, tot, tile_sem, offs_m, offs_n, m_ok, mask


@triton.jit(do_not_specialize=["M"])
def _tile_gemm_merge_kernel(
    x_ptr, w_ptr, part_ptr, out_ptr, sem_ptr, M, N, K, k_per_split,
    stride_xm, stride_wn, stride_ps, stride_pm, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, ROUND_TO: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    ACT: tl.constexpr,
):
    """``kernels.tile_gemm``'s split GEMM + ``_split_sum_kernel`` in one launch: the last
    split of each output tile sums the partials, rounds once (then ``silu(gate) * up`` of the
    pairs with ``ACT``) and stores the tile."""
    last, tot, tile_sem, offs_m, offs_n, m_ok, mask = _product_arrive_sum(
        x_ptr, w_ptr, part_ptr, sem_ptr, M, N, K, k_per_split, stride_xm, stride_wn,
        stride_ps, stride_pm, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, UPCAST, IEEE)
    if not last:
        return
    if ACT:
        y, offs_j = _silu_mul_pairs(tot, tl.program_id(1), BLOCK_M, BLOCK_N, ROUND_TO)
        tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_j[None, :],
                 y.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & (offs_j < N // 2)[None, :])
    else:
        tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
                 tot.to(ROUND_TO).to(out_ptr.dtype.element_ty), mask=mask)
    tl.atomic_xchg(tile_sem, 0, sem="relaxed")  # re-armed: every split of the tile has arrived


@triton.jit(do_not_specialize=["M"])
def _tile_gemm_add_norm_kernel(
    x_ptr, w_ptr, part_ptr, res_ptr, g_ptr, out_ptr, new_res_ptr, ssq_ptr, sem_ptr,
    M, N, K, k_per_split, eps,
    stride_xm, stride_wn, stride_ps, stride_pm, stride_rm, stride_om, stride_nrm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_C: tl.constexpr, DT: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, ROWS_C: tl.constexpr, TILES_P: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    n_tiles = tl.num_programs(1)
    last, tot, tile_sem, offs_m, offs_n, m_ok, mask = _product_arrive_sum(
        x_ptr, w_ptr, part_ptr, sem_ptr, M, N, K, k_per_split, stride_xm, stride_wn,
        stride_ps, stride_pm, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, UPCAST, IEEE)
    if not last:
        return
    # 2. the tile's last split, after the split sum: the residual add, the squares
    r = tl.load(res_ptr + offs_m.to(tl.int64)[:, None] * stride_rm + offs_n[None, :],
                mask=mask, other=0.0).to(tl.float32)
    xr = (tot.to(DT).to(tl.float32) + r).to(DT)
    tl.store(new_res_ptr + offs_m.to(tl.int64)[:, None] * stride_nrm + offs_n[None, :],
             xr.to(new_res_ptr.dtype.element_ty), mask=mask)
    xf = xr.to(tl.float32)
    tl.store(ssq_ptr + pid_n * BLOCK_M * tl.num_programs(0) + offs_m, tl.sum(xf * xf, 1),
             mask=m_ok)
    tl.atomic_xchg(tile_sem, 0, sem="relaxed")  # re-armed: every split of the tile has arrived
    tl.debug_barrier()
    row_sem = sem_ptr + tl.num_programs(0) * n_tiles + pid_m
    if tl.atomic_add(row_sem, 1, sem="acq_rel", scope="gpu") != n_tiles - 1:
        return
    # 3. the row block's last tile: the sum of squares over the tiles, the normalised rows,
    # ROWS_C rows at a time (a [ROWS_C, BLOCK_C] block in registers); each load of a chunk
    # in one go: every tile's squares, every column
    t_idx = tl.arange(0, TILES_P)
    cols = tl.arange(0, BLOCK_C)
    c_ok = cols < N
    g = tl.load(g_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)
    for r0 in tl.static_range(0, BLOCK_M, ROWS_C):
        rows = pid_m * BLOCK_M + r0 + tl.arange(0, ROWS_C)
        r_ok = rows < M
        sq = tl.load(ssq_ptr + t_idx[:, None] * BLOCK_M * tl.num_programs(0) + rows[None, :],
                     mask=(t_idx < n_tiles)[:, None] & r_ok[None, :], other=0.0,
                     cache_modifier=".cg")
        rstd = tl.rsqrt(tl.sum(sq, 0) / N + eps)
        rmask = r_ok[:, None] & c_ok[None, :]
        xs = tl.load(new_res_ptr + rows.to(tl.int64)[:, None] * stride_nrm + cols[None, :],
                     mask=rmask, other=0.0, cache_modifier=".cg").to(tl.float32)
        normed = (xs * rstd[:, None]).to(DT).to(tl.float32)
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :],
                 (normed * g[None, :]).to(out_ptr.dtype.element_ty), mask=rmask)
    tl.atomic_xchg(row_sem, 0, sem="relaxed")


def tile_linear_add_norm_fused(x: torch.Tensor, weight: torch.Tensor, config: dict,
                               residual: torch.Tensor, norm_weight: torch.Tensor,
                               eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``tile_linear_add_norm_triton``'s ``(normed, new_residual)`` in one launch, or None
    where this path does not apply (too wide a row block, or no counters inside a capture):
    the caller then takes the two launches."""
    m, n = x.shape[0], weight.shape[0]
    _check_operands(x, weight, config)
    assert residual.shape == (m, n) and residual.stride(-1) == 1 and norm_weight.shape == (n,)
    if not applies(n):
        return None
    bm, bn, split = config["block_m"], config["block_n"], config["split_k"]
    m_tiles, n_tiles = triton.cdiv(m, bm), triton.cdiv(n, bn)
    sem = _semaphores(x.device, m_tiles * n_tiles + m_tiles, pool="tile_gemm")
    if sem is None:
        return None
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    new_res = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out, new_res
    part = _split_partials(split, m, n, x.device)
    ssq = torch.empty(n_tiles * m_tiles * bm, dtype=torch.float32, device=x.device)
    k = x.shape[1]
    _tile_gemm_add_norm_kernel[(m_tiles, n_tiles, split)](
        x, weight, part, residual, norm_weight, out, new_res, ssq, sem,
        m, n, k, k // split, float(eps),
        x.stride(0), weight.stride(0), part.stride(0), part.stride(1), residual.stride(0),
        out.stride(0), new_res.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=config["block_k"], SPLIT_K=split,
        BLOCK_C=triton.next_power_of_2(n), DT=_TL_DTYPES[x.dtype],
        ROWS_C=rows_a_chunk(bm, n), TILES_P=triton.next_power_of_2(n_tiles), **product_flags(x),
        num_warps=config["num_warps"], num_stages=config["num_stages"])
    return out, new_res


def tile_linear_fused(x: torch.Tensor, weight: torch.Tensor, config: dict, out: torch.Tensor,
                      act: bool) -> bool:
    """``tile_linear_triton``'s split-K product (``split_k > 1``) and split sum in one
    launch, into ``out``; False (nothing launched) where no counters can be had inside a
    capture: the caller then takes two launches."""
    (m, k), n = x.shape, weight.shape[0]
    bm, bn, split = config["block_m"], config["block_n"], config["split_k"]
    m_tiles, n_tiles = triton.cdiv(m, bm), triton.cdiv(n, bn)
    sem = _semaphores(x.device, m_tiles * n_tiles, pool="tile_gemm")
    if sem is None:
        return False
    part = _split_partials(split, m, n, x.device)
    _tile_gemm_merge_kernel[(m_tiles, n_tiles, split)](
        x, weight, part, out, sem, m, n, k, k // split,
        x.stride(0), weight.stride(0), part.stride(0), part.stride(1), out.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=config["block_k"], SPLIT_K=split,
        ROUND_TO=_TL_DTYPES[x.dtype], ACT=act, **product_flags(x),
        num_warps=config["num_warps"], num_stages=config["num_stages"])
    return True
