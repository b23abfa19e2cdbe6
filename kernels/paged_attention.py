"""Triton paged attention for mixed prefill + decode batches, with split-KV.

One kernel serves every batch shape. A program owns one *query block* (up to
``BLOCK_Q`` query tokens of one request) times one KV head, and processes all
``GROUP = num_q_heads // num_kv_heads`` query heads of that KV head together,
so each K/V tile is loaded once per group. Its ``BLOCK_M = BLOCK_Q * GROUP_P``
rows are laid out token-major: row ``m`` is token ``m // GROUP_P``, head
``m % GROUP_P`` (``GROUP_P`` = group rounded up to a power of two; the extra
heads are masked).

Everything exact comes from the device: ``query_start_loc`` gives each
request's query range, ``seq_lens`` its KV length, ``block_table`` its pages.
The CPU ints only size grids and pick constexpr configs:

* ``max_query_len <= DECODE_MAX_Q`` (decode, spec-decode verify): one query
  block per request, so grid axis 0 is exactly ``num_reqs``.
* otherwise (prefill / chunked prefill): request ``r``'s query blocks start at
  global index ``query_start_loc[r] // BLOCK_Q + r``. That index is strictly
  increasing and leaves room for ``cdiv(q_len, BLOCK_Q)`` blocks, so
  ``num_tokens // BLOCK_Q + num_reqs`` programs always suffice; it is an upper
  bound, and programs past their request's last query block exit at once.
  A program finds its request by binary search over ``query_start_loc``.

Split-KV (flash decoding): grid axis 2 splits each program's KV range into
``num_splits`` equal chunks *of its real length* (read from device
``seq_lens``), so short and long rows are both balanced. A split whose chunk
is empty writes a neutral partial (o = 0, lse = -inf). For decode batches the
partials are merged in the same launch: each split bumps a per-(request, KV
head) arrival counter (acq_rel atomic, after a CTA barrier), and the split that
arrives last reads every partial back from L2, writes the merged output and
re-arms the counter to 0 for the next launch or graph replay. There a row uses
only as many splits as it has KV tiles (``NUM_SPLITS`` is sized from the bound,
often ``max_model_len``): the surplus splits exit at once, and the merge reads
only the used partials, all loads in flight together. That saves the
reduce kernel's launch (~2.5 us a layer inside a graph at batch 1); the
separate reduce kernel remains for forced splits of prefill-shaped batches and
when no counter buffer can be had (first use inside a graph capture).
``num_splits`` is chosen on the CPU from ``max_seq_len_upper_bound`` and the
batch size only.

No host synchronisation happens here and all buffers come from ``torch.empty``
with shapes fixed by the CPU ints, so a decode step is CUDA-graph capturable.
Capture with the largest ``max_seq_len_upper_bound`` the graph will replay
with (e.g. ``max_model_len``): the split count is baked into the graph, and
only the device ``seq_lens`` may change between replays.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.pdl import wait_and_release

LOG2E = 1.4426950408889634
DECODE_MAX_Q = 16  # up to this many query tokens per request: one q-block per request
MAX_SPLITS = 64
# Split sizing and decode tiles, from a graph-replay sweep on an H200
# (``python -m kernels.bench --only attention-sweep``, notes/2026-12-04-h200-results.md):
# a split's fixed cost (its partial's store, the arrival atomic, the merge) is about one
# tile's latency, so short bounds split down to one 128-token tile per split, long ones to
# 256 tokens; and 2 CTAs per SM already saturate HBM (4 made b32 ctx 512 24% slower).
MIN_TOKENS_PER_SPLIT = 256
MIN_TOKENS_PER_SPLIT_SHORT = 128  # for bounds up to SHORT_BOUND
SHORT_BOUND = 2048
CTAS_PER_SM = 2  # split target: enough CTAs in flight to saturate HBM
WIDE_TILE_MAX_CTAS = 64  # decode grids of at most this many (request, KV head) use 128-key tiles


@triton.jit
def _find_request(qsl_ptr, qblock, num_reqs, BLOCK_Q: tl.constexpr):
    """Last request r with query_start_loc[r] // BLOCK_Q + r <= qblock."""
    lo = tl.full([], 0, tl.int32)  # tensors, not ints: num_reqs may be specialised to 1
    hi = lo + num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if start <= qblock:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# Runtime ints that vary per step are not specialised (no recompiles, e.g. on a
# batch of 1 or a 16-divisible bound, in the middle of CUDA-graph capture). The
# block table's width follows each step's length bound: its row stride too.
@triton.jit(do_not_specialize=["num_reqs", "kv_cap", "stride_bt"])
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, final_ptr, sem_ptr,
    block_table_ptr, seq_lens_ptr, qsl_ptr,
    num_reqs, kv_cap, scale_log2,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bt,
    stride_os, stride_ot, stride_oh,
    stride_ls, stride_lt, stride_ft, stride_fh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, ONE_QBLOCK_PER_REQ: tl.constexpr, IEEE: tl.constexpr,
    UPCAST: tl.constexpr, FUSED_REDUCE: tl.constexpr, SPLITS_P: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    if ONE_QBLOCK_PER_REQ:
        req = pid
        qblock = 0
    else:
        req = _find_request(qsl_ptr, pid, num_reqs, BLOCK_Q)
        qblock = pid - (tl.load(qsl_ptr + req) // BLOCK_Q + req)

    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    if qblock * BLOCK_Q >= q_len:
        return  # spare program of the upper-bound grid, or an empty request
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len  # KV tokens before this step's queries

    offs_m = tl.arange(0, BLOCK_M)
    tok = qblock * BLOCK_Q + offs_m // GROUP_P  # query token index within the request
    head = offs_m % GROUP_P
    row_ok = (tok < q_len) & (head < GROUP)
    q_pos = ctx_len + tok
    qhead = kvh * GROUP + head
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    # PDL: the lengths and the block table were written before this step's first layer
    # (by kernels that have completed, see kernels.pdl); q and this step's KV slots were
    # written by the kernel just before.
    wait_and_release(USE_PDL)
    q_rows = (q_start + tok).to(tl.int64) * stride_qt + qhead * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # Causal: this block's last query token sees keys [0, kv_end). kv_cap (the
    # bound's blocks, at most the block-table width) only matters when a caller
    # breaks seq_lens <= bound: keys past it do not exist, as in the reference,
    # and no block-table entry past the table is ever read.
    kv_end = tl.minimum(ctx_len + tl.minimum(q_len, (qblock + 1) * BLOCK_Q), kv_cap)
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    if FUSED_REDUCE:
        # Splits actually used by this row: at most one per tile, all non-empty (the
        # graph's NUM_SPLITS is sized for the length *bound*; a short row uses fewer,
        # and the rest exit at once instead of writing neutral partials to merge).
        per_split = tl.cdiv(num_tiles, tl.minimum(num_tiles, NUM_SPLITS))
        used = tl.cdiv(num_tiles, per_split)
        if split >= used:
            return
        tile_lo = split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, num_tiles)
    elif NUM_SPLITS > 1:
        used = NUM_SPLITS
        per_split = tl.cdiv(num_tiles, NUM_SPLITS)
        tile_lo = split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, num_tiles)
    else:
        tile_lo = 0
        tile_hi = num_tiles

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    offs_n = tl.arange(0, BLOCK_N)

    for t in range(tile_lo, tile_hi):
        kv_pos = t * BLOCK_N + offs_n
        kv_ok = kv_pos < kv_end
        page = tl.load(bt_row + kv_pos // KV_BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
        in_page = kv_pos % KV_BLOCK_SIZE
        if HEAD_DIM == BLOCK_D:
            kv_mask = kv_ok[:, None]  # row-only mask keeps the d axis vectorisable
        else:
            kv_mask = kv_ok[:, None] & d_ok[None, :]
        k_off = page * stride_kb + in_page * stride_kt + kvh * stride_kh
        k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v_off = page * stride_vb + in_page * stride_vt + kvh * stride_vh
        v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)

        if UPCAST:
            k = k.to(tl.float32)
        # fp32 inputs: exact fp32 products (the default would be tf32). Inlined,
        # not a helper: nested jit calls are slow under the interpreter.
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
        else:
            s = tl.dot(q, tl.trans(k)) * scale_log2
        visible = row_ok[:, None] & (kv_pos[None, :] <= q_pos[:, None]) & kv_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row may see no key in this tile (masked rows; prefill rows in a later
        # split): subtract 0 instead of -inf so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        p_lo = p.to(v_ptr.dtype.element_ty)  # P is rounded to the KV dtype, as on GPU
        if UPCAST:
            pv = tl.dot(p_lo.to(tl.float32), v.to(tl.float32))
        elif IEEE:
            pv = tl.dot(p_lo, v, input_precision="ieee")
        else:
            pv = tl.dot(p_lo, v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    has_keys = l_i > 0.0
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    o_rows = (q_start + tok).to(tl.int64) * stride_ot + qhead * stride_oh
    o_ptrs = out_ptr + split * stride_os + o_rows[:, None] + offs_d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if NUM_SPLITS > 1:
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        l_rows = (q_start + tok).to(tl.int64) * stride_lt + qhead
        tl.store(lse_ptr + split * stride_ls + l_rows, lse, mask=row_ok)
        if FUSED_REDUCE:
            # The last split of this (query block, KV head) to finish merges all
            # partials: no reduce launch. Release our partials, count arrivals.
            tl.debug_barrier()
            sem = sem_ptr + pid * tl.num_programs(1) + kvh
            arrived = tl.atomic_add(sem, 1, sem="acq_rel", scope="gpu")
            if arrived == used - 1:
                offs_s = tl.arange(0, SPLITS_P)
                lse_all = tl.load(lse_ptr + offs_s[:, None] * stride_ls + l_rows[None, :],
                                  mask=(offs_s[:, None] < used) & row_ok[None, :],
                                  other=float("-inf"), cache_modifier=".cg")
                m_all = tl.max(lse_all, 0)
                m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
                w_sum = tl.sum(tl.exp2(lse_all - m_all[None, :]), 0)
                o_mask = row_ok[:, None] & d_ok[None, :]
                merged = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
                # Unrolled: the partials' loads are independent and all in flight at once
                # (a rolled loop pays one L2 round trip per split); unused splits are masked.
                for sp in tl.static_range(NUM_SPLITS):
                    sp_ok = row_ok & ((offs_m * 0 + sp) < used)
                    w_s = tl.exp2(tl.load(lse_ptr + sp * stride_ls + l_rows, mask=sp_ok,
                                          other=float("-inf"), cache_modifier=".cg") - m_all)
                    part = tl.load(out_ptr + sp * stride_os + o_rows[:, None] + offs_d[None, :],
                                   mask=sp_ok[:, None] & d_ok[None, :], other=0.0,
                                   cache_modifier=".cg")
                    merged += w_s[:, None] * part
                merged = merged / tl.where(w_sum > 0.0, w_sum, 1.0)[:, None]
                f_rows = (q_start + tok).to(tl.int64) * stride_ft + qhead * stride_fh
                tl.store(final_ptr + f_rows[:, None] + offs_d[None, :],
                         merged.to(final_ptr.dtype.element_ty), mask=o_mask)
                tl.atomic_xchg(sem, 0)  # re-armed for the next launch (and graph replay)


@triton.jit(do_not_specialize=["num_reqs"])
def _reduce_splits_kernel(
    part_ptr, lse_ptr, out_ptr, qsl_ptr, num_reqs, num_q_heads,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SPLITS_P: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    """Merge the split partials of one token, BLOCK_H q heads; lse is in log2 units."""
    t = tl.program_id(0).to(tl.int64)
    wait_and_release(USE_PDL)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    if t >= tl.load(qsl_ptr + num_reqs):
        return  # padding token: no request wrote partials for it
    h_ok = offs_h < num_q_heads
    offs_s = tl.arange(0, SPLITS_P)
    lse = tl.load(lse_ptr + offs_s[:, None] * stride_ls + t * stride_lt + offs_h[None, :],
                  mask=(offs_s[:, None] < NUM_SPLITS) & h_ok[None, :], other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits neutral: weights stay 0
    w_sum = tl.sum(tl.exp2(lse - m[None, :]), 0)
    offs_d = tl.arange(0, BLOCK_D)
    mask = h_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    row = part_ptr + t * stride_pt + offs_h[:, None] * stride_ph + offs_d[None, :]
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for s in range(NUM_SPLITS):
        w = tl.exp2(tl.load(lse_ptr + s * stride_ls + t * stride_lt + offs_h, mask=h_ok,
                            other=float("-inf")) - m)
        acc += w[:, None] * tl.load(row + s * stride_ps, mask=mask, other=0.0)
    o = acc / tl.where(w_sum > 0.0, w_sum, 1.0)[:, None]
    tl.store(out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=mask)




# Arrival counters of the fused split reduce, one int32 per (query block, KV head),
# zero between launches (the last arriving program re-arms its counter). One growing
# buffer per device; outgrown buffers stay alive because captured CUDA graphs keep
# their addresses.
_SEMAPHORES: dict[tuple[str, int], torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []
MIN_SEMAPHORES = 1 << 14


def _semaphores(device: torch.device, n: int) -> torch.Tensor | None:
    """A zeroed counter buffer of >= n entries, or None while capturing a CUDA graph with
    a buffer too small (allocating then would tie it to the graph's pool): the caller
    falls back to the reduce kernel."""
    key = (device.type, device.index if device.index is not None else -1)
    buf = _SEMAPHORES.get(key)
    if buf is not None and buf.numel() >= n:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    if buf is not None:
        _RETIRED.append(buf)
    buf = torch.zeros(max(n, MIN_SEMAPHORES if buf is None else 2 * buf.numel()),
                      dtype=torch.int32, device=device)
    _SEMAPHORES[key] = buf
    return buf


def _device_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return pdl.sm_count(device)
    return 132  # interpreter / CPU tensors: model an H200


def choose_num_splits(num_reqs: int, num_kv_heads: int, max_query_len: int,
                      max_seq_len_upper_bound: int, num_sms: int = 132) -> int:
    """Split count from CPU values only (batch shape and the length *bound*).

    Only decode-shaped batches split: prefill already has many query blocks.
    Target ``CTAS_PER_SM * num_sms`` programs, but give each split at least
    ``MIN_TOKENS_PER_SPLIT`` tokens of the bound. Rows shorter than the bound
    just get shorter chunks (the kernel divides their real length).
    """
    if max_query_len > DECODE_MAX_Q:
        return 1
    base = max(1, num_reqs * num_kv_heads)
    want = triton.cdiv(CTAS_PER_SM * num_sms, base)
    bound = max(max_seq_len_upper_bound, 1)
    cap = triton.cdiv(bound, MIN_TOKENS_PER_SPLIT_SHORT if bound <= SHORT_BOUND else MIN_TOKENS_PER_SPLIT)
    return max(1, min(want, cap, MAX_SPLITS))


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_seq_len_upper_bound: int,
    scale: float,
    *,
    num_splits: int | None = None,
    fused_reduce: bool | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """Causal paged attention; layouts as in ``kernels.reference``.

    ``max_query_len`` and ``max_seq_len_upper_bound`` are CPU ints that must be
    >= the real values; they only size grids and pick configs. ``num_splits``
    overrides the split-KV heuristic (tests, benchmarks). Decode-shaped splits
    merge their partials in the last arriving program (``fused_reduce``, default
    on) instead of a second launch. ``config`` overrides ``block_n`` /
    ``num_warps`` / ``num_stages`` (benchmarks). Rows of ``q`` past
    ``query_start_loc[-1]`` (padding) are left unwritten.
    """
    num_tokens, hq, head_dim = q.shape
    _, kv_block_size, hkv, _ = k_cache.shape
    num_reqs = query_start_loc.shape[0] - 1
    assert hq % hkv == 0, "num_q_heads must be a multiple of num_kv_heads"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    group = hq // hkv
    group_p = triton.next_power_of_2(group)
    block_d = max(16, triton.next_power_of_2(head_dim))
    out = torch.empty((num_tokens, hq, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_reqs == 0:
        return out

    if max_query_len <= DECODE_MAX_Q:
        block_q = triton.next_power_of_2(max(1, max_query_len))
        block_m = max(16, block_q * group_p)
        one_qblock, grid0 = True, num_reqs
        block_n = 64 if block_d <= 128 else 32
        num_warps, num_stages = 4, 3
        if block_m == 16 and block_d <= 128:  # one query token (the swept shape; not verify)
            # small grids: fewer, wider tiles (each serial tile costs a DRAM round trip)
            block_n = 128 if num_reqs * hkv <= WIDE_TILE_MAX_CTAS else 64
            num_stages = 2
    else:
        block_m = max(128 if block_d <= 128 else 64, group_p)
        block_q = block_m // group_p
        one_qblock, grid0 = False, num_tokens // block_q + num_reqs
        block_n = 64 if block_d <= 128 else 32
        num_warps, num_stages = (8 if block_m >= 128 else 4), 2
    if config:
        block_n = config.get("block_n", block_n)
        num_warps = config.get("num_warps", num_warps)
        num_stages = config.get("num_stages", num_stages)

    if num_splits is None:
        num_splits = choose_num_splits(num_reqs, hkv, max_query_len,
                                       max_seq_len_upper_bound, _device_sms(q.device))
    num_splits = max(1, min(int(num_splits), MAX_SPLITS))
    sem = None
    if num_splits > 1 and one_qblock and fused_reduce is not False:
        sem = _semaphores(q.device, grid0 * hkv)
    if num_splits > 1:
        part = torch.empty((num_splits, num_tokens, hq, head_dim), dtype=torch.float32,
                           device=q.device)
        lse = torch.empty((num_splits, num_tokens, hq), dtype=torch.float32, device=q.device)
        dst, stride_os, stride_ls, stride_lt = part, part.stride(0), lse.stride(0), lse.stride(1)
    else:
        lse, dst, stride_os, stride_ls, stride_lt = out, out, 0, 0, 0  # lse unused

    kv_cap = min(triton.cdiv(max_seq_len_upper_bound, kv_block_size), block_table.shape[1])
    kv_cap *= kv_block_size
    _paged_attention_kernel[(grid0, hkv, num_splits)](
        q, k_cache, v_cache, dst, lse, out, sem if sem is not None else seq_lens,
        block_table, seq_lens, query_start_loc,
        num_reqs, kv_cap, float(scale) * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        stride_os, dst.stride(-3), dst.stride(-2),
        stride_ls, stride_lt, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, KV_BLOCK_SIZE=kv_block_size,
        GROUP=group, GROUP_P=group_p, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        NUM_SPLITS=num_splits, ONE_QBLOCK_PER_REQ=one_qblock,
        IEEE=q.dtype == torch.float32,
        # The interpreter's tl.dot multiplies bf16 as raw uint16 bits (triton 3.9):
        # off-GPU only, feed it fp32 copies of the same bf16 values.
        UPCAST=(not q.is_cuda) and torch.bfloat16 in (q.dtype, k_cache.dtype),
        FUSED_REDUCE=sem is not None, SPLITS_P=triton.next_power_of_2(num_splits),
        num_warps=num_warps, num_stages=num_stages, **pdl.launch_kwargs(q),
    )
    if num_splits > 1 and sem is None:
        block_h = min(triton.next_power_of_2(hq), max(1, 2048 // block_d))
        _reduce_splits_kernel[(num_tokens, triton.cdiv(hq, block_h))](
            part, lse, out, query_start_loc, num_reqs, hq,
            part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_H=block_h,
            NUM_SPLITS=num_splits, SPLITS_P=triton.next_power_of_2(num_splits),
            num_warps=4, **pdl.launch_kwargs(q),
        )
    return out
