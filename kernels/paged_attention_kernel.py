"""The Triton kernel of ``kernels.paged_attention``, whose docstring describes it: the program
layout (a query block x one KV head, the whole query-head group), the query-block indexing of
prefill batches and the split-KV partials with their in-launch merge. The launch and its
sizing (CPU ints only) are ``kernels.paged_attention`` and ``kernels.attention_splits``.

An FP8 (e4m3) cache is read from the cache pointer's element type (its own compiled variant)
and dequantized here, in registers: each K/V tile is converted to the query dtype (exact: every
e4m3 value is a bf16 / fp16 / fp32 value), ``k_scale`` is folded into the scores' scale and
``v_scale`` into the output (the partials, with splits) after the P.V accumulation; P is
rounded to the query dtype instead of the cache's. Both scales are runtime float32 arguments
(one variant for every layer and value), ignored with a 16-bit or float32 cache."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.attention_merge import merge_splits
from kernels.kv_write import to_cache
from kernels.pdl import prefetch_lines_l2, wait_and_release
from kernels.rope_inline import add_new_key, rope_cos_sin, rope_rows


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
# num_reqs, kv_cap and stride_ls (num_tokens x heads) change with the batch: specialising on
# them (== 1, % 16) would compile a new variant mid-serving for, e.g., an odd eager batch.
# The FP8 cache's scales are runtime values too (one variant for every layer).
@triton.jit(do_not_specialize=["num_reqs", "kv_cap", "stride_bt", "stride_ls", "k_scale", "v_scale"])
def _paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    lse_ptr,
    final_ptr,
    sem_ptr,
    block_table_ptr,
    seq_lens_ptr,
    qsl_ptr,
    kn_ptr,
    vn_ptr,
    pos_ptr,
    slot_ptr,
    cs_ptr,
    qw_ptr,
    kw_ptr,
    num_reqs,
    kv_cap,
    scale_log2,
    k_scale,
    v_scale,
    eps,
    stride_cs,
    stride_knt,
    stride_knh,
    stride_vnt,
    stride_vnh,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_os,
    stride_ot,
    stride_oh,
    stride_ls,
    stride_lt,
    stride_ft,
    stride_fh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    ONE_QBLOCK_PER_REQ: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    FUSED_REDUCE: tl.constexpr,
    LINE_ELEMS: tl.constexpr = 64,
    ROW_LINES: tl.constexpr = 2,
    ROPE: tl.constexpr = False,
    Q_NORM: tl.constexpr = False,
    K_NORM: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
    PRELOAD: tl.constexpr = False,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    # FP8 cache: tiles are dequantized to the query dtype (P rounded to it too), k_scale goes
    # into the scores' scale, v_scale into the output. Otherwise P is rounded to the KV dtype.
    KV_FP8: tl.constexpr = k_ptr.dtype.element_ty == tl.float8e4nv
    tl.static_assert(not (KV_FP8 and PRELOAD), "FP8 cache: no preload (it spills on sm_90)")
    P_DT: tl.constexpr = q_ptr.dtype.element_ty if KV_FP8 else v_ptr.dtype.element_ty
    if KV_FP8:
        qk_scale = scale_log2 * k_scale
    else:
        qk_scale = scale_log2

    if ONE_QBLOCK_PER_REQ:
        req = pid
        qblock = 0
    else:
        req = _find_request(qsl_ptr, pid, num_reqs, BLOCK_Q)
        qblock = pid - (tl.load(qsl_ptr + req) // BLOCK_Q + req)

    # All three loads in flight together: the early exit below must not serialise them.
    q_start = tl.load(qsl_ptr + req)
    q_end = tl.load(qsl_ptr + req + 1)
    seq_len = tl.load(seq_lens_ptr + req)
    q_len = q_end - q_start
    if qblock * BLOCK_Q >= q_len:
        return  # spare program of the upper-bound grid, or an empty request
    ctx_len = seq_len - q_len  # KV tokens before this step's queries

    offs_m = tl.arange(0, BLOCK_M)
    tok = qblock * BLOCK_Q + offs_m // GROUP_P  # query token index within the request
    head = offs_m % GROUP_P
    row_ok = (tok < q_len) & (head < GROUP)
    q_pos = ctx_len + tok
    qhead = kvh * GROUP + head
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

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

    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    offs_n = tl.arange(0, BLOCK_N)
    # With ROPE the new key (position ctx_len) is not in the cache yet: the tiles stop
    # before it and the owning split adds it from registers after the loop. (Substituting
    # it into a tile instead puts a register op between the loads and tl.dot, which
    # breaks the loads' software pipelining; docs/decisions.md.)
    cached_end = tl.minimum(ctx_len, kv_end) if ROPE else kv_end

    # PDL: the lengths and the block table were written before this step's first layer
    # (by kernels that have completed, see kernels.pdl); q and this step's KV slots were
    # written by the kernel just before.
    if ROPE:  # positions and slots, like the lengths, come from before the first layer
        new_pos = tl.load(pos_ptr + q_start).to(tl.int64)
        new_slot = tl.load(slot_ptr + q_start).to(tl.int64)
        cos, sin = rope_cos_sin(cs_ptr, stride_cs, new_pos, offs_d, HEAD_DIM // 2)
        if USE_PDL:
            # This split's first K/V tile into L2 while the QKV projection still runs:
            # every cached key (< ctx_len) was written by an earlier step, and this
            # launch writes only the new one, after its loop. (Loading the tile into
            # registers here instead was slower, even with PDL off: registers live across
            # the rotation; docs/decisions.md.)
            kv_pos0 = tile_lo * BLOCK_N + offs_n
            ok0 = kv_pos0 < cached_end
            page0 = tl.load(bt_row + kv_pos0 // KV_BLOCK_SIZE, mask=ok0, other=0).to(tl.int64)
            in_page0 = kv_pos0 % KV_BLOCK_SIZE
            offs_l = tl.arange(0, ROW_LINES) * LINE_ELEMS  # a row's cache lines
            l_ok = ok0[:, None] & (offs_l < HEAD_DIM)[None, :]
            k_row0 = page0 * stride_kb + in_page0 * stride_kt + kvh * stride_kh
            v_row0 = page0 * stride_vb + in_page0 * stride_vt + kvh * stride_vh
            if PRELOAD:  # one-tile splits: the tile itself, into registers
                m0 = ok0[:, None] if HEAD_DIM == BLOCK_D else ok0[:, None] & d_ok[None, :]
                k_pre = tl.load(k_ptr + k_row0[:, None] + offs_d[None, :], mask=m0, other=0.0)
            else:
                prefetch_lines_l2(k_ptr + k_row0[:, None] + offs_l[None, :], l_ok)
            if PRELOAD:
                v_pre = tl.load(v_ptr + v_row0[:, None] + offs_d[None, :], mask=m0, other=0.0)
            else:
                prefetch_lines_l2(v_ptr + v_row0[:, None] + offs_l[None, :], l_ok)
    wait_and_release(USE_PDL)
    q_rows = (q_start + tok).to(tl.int64) * stride_qt + qhead * stride_qh
    if ROPE:
        # One query token: rotate (and normalise) the raw q heads and this KV head's new
        # key here, instead of kernels.rope_kv's launch; the split holding the row's last
        # tile adds the new K/V from registers after the loop and writes them to the cache
        # (no program of this launch reads that slot).
        DT = q_ptr.dtype.element_ty
        q = rope_rows(q_ptr, q_rows, offs_d, row_ok, qw_ptr, eps, cos, sin, Q_NORM, HEAD_DIM // 2, DT, False)
        kn_row = tl.zeros([1], dtype=tl.int64) + q_start.to(tl.int64) * stride_knt + kvh * stride_knh
        # (in the cache dtype: an FP8 cache's new K/V are attended as stored, quantized)
        k_new = rope_rows(
            kn_ptr, kn_row, offs_d, kn_row == kn_row, kw_ptr, eps, cos, sin, K_NORM, HEAD_DIM // 2, DT, False
        )
        k_new = to_cache(k_new, k_scale, k_ptr.dtype.element_ty)
        v_new = tl.load(vn_ptr + q_start.to(tl.int64) * stride_vnt + kvh * stride_vnh + offs_d, mask=d_ok, other=0.0)
        v_new = to_cache(v_new, v_scale, v_ptr.dtype.element_ty)
    else:
        q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for t in range(tile_lo, tile_hi):
        kv_pos = t * BLOCK_N + offs_n
        kv_ok = kv_pos < cached_end
        page = tl.load(bt_row + kv_pos // KV_BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
        in_page = kv_pos % KV_BLOCK_SIZE
        if HEAD_DIM == BLOCK_D:
            kv_mask = kv_ok[:, None]  # row-only mask keeps the d axis vectorisable
        else:
            kv_mask = kv_ok[:, None] & d_ok[None, :]
        k_off = page * stride_kb + in_page * stride_kt + kvh * stride_kh
        v_off = page * stride_vb + in_page * stride_vt + kvh * stride_vh
        if PRELOAD:  # the split's first tile came in before the wait
            if t == tile_lo:
                k = k_pre
            else:
                k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        else:
            k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if PRELOAD:
            if t == tile_lo:
                v = v_pre
            else:
                v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        elif not KV_FP8:
            v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)

        if KV_FP8:  # the dequantization: e4m3 -> query dtype, exact (scales folded in)
            k = k.to(P_DT)
        if UPCAST:
            k = k.to(tl.float32)
        # fp32 inputs: exact fp32 products (the default would be tf32). Inlined,
        # not a helper: nested jit calls are slow under the interpreter.
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        else:
            s = tl.dot(q, tl.trans(k)) * qk_scale
        visible = row_ok[:, None] & (kv_pos[None, :] <= q_pos[:, None]) & kv_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row may see no key in this tile (masked rows; prefill rows in a later
        # split): subtract 0 instead of -inf so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        p_lo = p.to(P_DT)  # P is rounded to the KV dtype (FP8 cache: the query's), as on GPU
        if KV_FP8:  # V loaded next to its use (sm_90: 254 registers instead of 171 if up front)
            v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(P_DT)
        if UPCAST:
            pv = tl.dot(p_lo.to(tl.float32), v.to(tl.float32))
        elif IEEE:
            pv = tl.dot(p_lo, v, input_precision="ieee")
        else:
            pv = tl.dot(p_lo, v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if ROPE:
        # The split holding the row's last tile owns the new key: it adds it (unless a
        # bound below seq_len hides it, as the reference's bound does) and writes it.
        last_tile = (kv_end - 1) // BLOCK_N
        owner = (tile_lo <= last_tile) & (last_tile < tile_hi)
        if owner & (ctx_len < kv_end):
            m_i, l_i, acc = add_new_key(q, k_new, v_new, m_i, l_i, acc, row_ok, qk_scale, P_DT)
        # Written after the loop: a cache store before it would order every tile's K/V
        # loads behind the new key (the compiler cannot rule out aliasing).
        if owner & (new_slot >= 0):
            pg = new_slot // KV_BLOCK_SIZE
            nc = pg * stride_kb + (new_slot % KV_BLOCK_SIZE) * stride_kt + kvh * stride_kh
            tl.store(k_ptr + nc + offs_d[None, :], k_new, mask=d_ok[None, :])
            nv = pg * stride_vb + (new_slot % KV_BLOCK_SIZE) * stride_vt + kvh * stride_vh
            tl.store(v_ptr + nv + offs_d, v_new, mask=d_ok)

    if KV_FP8:  # V's scale, after the P.V accumulation (the split merge is linear in it)
        acc = acc * v_scale
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
                f_rows = (q_start + tok).to(tl.int64) * stride_ft + qhead * stride_fh
                merge_splits(
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
                    BLOCK_M,
                    BLOCK_D,
                    NUM_SPLITS,
                )
