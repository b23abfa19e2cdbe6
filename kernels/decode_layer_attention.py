"""The attention phase of the persistent decoder-layer kernel (``kernels.decode_layer``): one
query token a request over its paged KV, split-KV items merged in the same launch.

A tile's scores and ``P @ V`` run either as float32 FMA products of the GQA group's rows
(``ATT_DOT=False``: ``[group, keys, head_dim]`` in registers, so tiles stay small: 16 keys at
GQA 4) or on the tensor cores (``ATT_DOT=True``: the group's rows padded to one 16-row MMA
tile, ``tl.dot`` in float32 accumulators, so a tile holds 64 keys in fewer registers). Both
take q rotated and rounded to the dtype (exact in either), round P to the dtype before
``P @ V``, and differ in how the float32 sums run (order; the tensor cores' accumulation is
not strictly IEEE round-to-nearest).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.decode_layer_phases import _prefetch_kv_range, batch_splits, split_plan
from kernels.rope_inline import add_new_key, rope_cos_sin, rope_rows


@triton.jit
def _kv_tile(k_ptr, v_ptr, bt_ptr, t, tile_hi, cached_end, kvh, offs_n, offs_d,
             stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
             KV_BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """K and V of tile ``t`` (cached keys only; rows past them, or ``t >= tile_hi``, 0)."""
    kv_pos = t * BLOCK_N + offs_n
    kv_ok = kv_pos < tl.minimum(cached_end, tile_hi * BLOCK_N)
    page = tl.load(bt_ptr + kv_pos // KV_BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
    in_page = kv_pos % KV_BLOCK_SIZE
    k_off = page * stride_kb + in_page * stride_kt + kvh * stride_kh
    k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :], mask=kv_ok[:, None], other=0.0)
    v_off = page * stride_vb + in_page * stride_vt + kvh * stride_vh
    v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=kv_ok[:, None], other=0.0)
    return k, v


@triton.jit
def _attend_item(qkv_ptr, k_ptr, v_ptr, bt_ptr, qw_ptr, kw_ptr, part_ptr, lse_ptr, attn_ptr,
                 cnt_ptr, kvh, split, ctx_len, kv_end, num_tiles, per_split, used, cached_end,
                 new_slot, cos, sin, part_ss, lse_ss, qk_eps, scale_log2,
                 stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                 HQ: tl.constexpr, HK: tl.constexpr, HEAD_DIM: tl.constexpr,
                 KV_BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
                 SPLITS: tl.constexpr, SPLITS_P: tl.constexpr, BLOCK_N: tl.constexpr,
                 Q_NORM: tl.constexpr, K_NORM: tl.constexpr, roll, ROLL_OK: tl.constexpr,
                 SPAN: tl.constexpr, LINE_ELEMS: tl.constexpr, ROW_LINES: tl.constexpr,
                 ATT_M: tl.constexpr, ATT_DOT: tl.constexpr, UPCAST: tl.constexpr):
    """One ``(KV head, split)`` item of one request (every pointer already at the request's
    row; a split's partials ``part_ss`` / ``lse_ss`` elements apart): see
    ``attention_phase``. ``roll`` (its keys were not prefetched before the wait: too many
    for L2): the item prefetches its own K/V rows into L2, ``SPAN`` keys ahead of the tile
    it reads, so that many keys stream at once instead of one tile's. ``ATT_M``: the tile's
    query rows (the group padded: ``GROUP_P``, or one 16-row MMA tile with ``ATT_DOT``);
    ``UPCAST``: the dots in float32 (the interpreter)."""
    DT = qkv_ptr.dtype.element_ty
    HALF: tl.constexpr = HEAD_DIM // 2
    last_tile = (kv_end - 1) // BLOCK_N
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, ATT_M)  # the tile's query rows (the group, padded)
    r_ok = offs_r < GROUP
    head_r = kvh * GROUP + offs_r
    tile_lo = split * per_split
    tile_hi = tl.minimum(tile_lo + per_split, num_tiles)
    q = rope_rows(qkv_ptr, head_r * HEAD_DIM, offs_d, r_ok, qw_ptr, qk_eps, cos, sin,
                  Q_NORM, HALF, DT, True)  # in the dtype, padded rows 0
    if UPCAST or not ATT_DOT:  # FMA products, or the interpreter's float32 dots
        q = q.to(tl.float32)
    kn_row = tl.zeros([1], dtype=tl.int32) + (HQ + kvh) * HEAD_DIM
    k_new = rope_rows(qkv_ptr, kn_row, offs_d, kn_row == kn_row, kw_ptr, qk_eps, cos, sin,
                      K_NORM, HALF, DT, True)  # [1, D]
    v_new = tl.load(qkv_ptr + (HQ + HK + kvh) * HEAD_DIM + offs_d, cache_modifier=".cg")

    m_i = tl.full([ATT_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ATT_M], dtype=tl.float32)
    acc = tl.zeros([ATT_M, HEAD_DIM], dtype=tl.float32)
    CH: tl.constexpr = (SPAN + BLOCK_N - 1) // BLOCK_N  # tiles a rolling prefetch covers
    end = tl.minimum(tile_hi * BLOCK_N, cached_end)
    if ROLL_OK:
        if roll:  # the first SPAN keys now, each next SPAN as the tiles reach the last one
            _prefetch_kv_range(k_ptr, v_ptr, bt_ptr, kvh, tile_lo * BLOCK_N,
                               tl.minimum(tile_lo * BLOCK_N + SPAN, end), stride_kb,
                               stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                               HEAD_DIM, KV_BLOCK_SIZE, SPAN, LINE_ELEMS, ROW_LINES)
    k_nxt, v_nxt = _kv_tile(k_ptr, v_ptr, bt_ptr, tile_lo, tile_hi, cached_end, kvh, offs_n,
                            offs_d, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                            stride_vh, KV_BLOCK_SIZE, BLOCK_N)
    for t in range(tile_lo, tile_hi):
        kv_pos = t * BLOCK_N + offs_n
        kv_ok = kv_pos < cached_end
        k = k_nxt
        v = v_nxt  # the next tile's loads in flight while this one is used
        k_nxt, v_nxt = _kv_tile(k_ptr, v_ptr, bt_ptr, t + 1, tile_hi, cached_end, kvh,
                                offs_n, offs_d, stride_kb, stride_kt, stride_kh, stride_vb,
                                stride_vt, stride_vh, KV_BLOCK_SIZE, BLOCK_N)
        if ROLL_OK:  # after the next tile's loads: its block-table load must not stall them
            if roll & ((t - tile_lo) % CH == 0):
                ahead = (t + CH) * BLOCK_N
                _prefetch_kv_range(k_ptr, v_ptr, bt_ptr, kvh, ahead,
                                   tl.minimum(ahead + SPAN, end), stride_kb, stride_kt,
                                   stride_kh, stride_vb, stride_vt, stride_vh, HEAD_DIM,
                                   KV_BLOCK_SIZE, SPAN, LINE_ELEMS, ROW_LINES)
        if ATT_DOT:  # exact products of dtype values, float32 sums (tensor cores)
            if UPCAST:
                s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale_log2
        else:
            s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], 2) * scale_log2
        s = tl.where(r_ok[:, None] & kv_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if ATT_DOT:  # P rounded to the dtype
            if UPCAST:
                pv = tl.dot(p.to(DT).to(tl.float32), v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(DT), v)
        else:
            p_lo = p.to(DT).to(tl.float32)  # P rounded to the KV dtype, as the tl.dot path
            pv = tl.sum(p_lo[:, :, None] * v.to(tl.float32)[None, :, :], 1)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    owner = (tile_lo <= last_tile) & (last_tile < tile_hi)
    if owner & (ctx_len < kv_end):  # the new key, unless a bound below seq_len hides it
        m_i, l_i, acc = add_new_key(q, k_new, v_new, m_i, l_i, acc, r_ok, scale_log2, DT)
    if owner & (new_slot >= 0):
        pg = new_slot // KV_BLOCK_SIZE
        nc = pg * stride_kb + (new_slot % KV_BLOCK_SIZE) * stride_kt + kvh * stride_kh
        tl.store(k_ptr + nc + offs_d[None, :], k_new.to(k_ptr.dtype.element_ty))
        nv = pg * stride_vb + (new_slot % KV_BLOCK_SIZE) * stride_vt + kvh * stride_vh
        tl.store(v_ptr + nv + offs_d, v_new.to(v_ptr.dtype.element_ty))

    has_keys = l_i > 0.0
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    tl.store(part_ptr + split * part_ss + head_r[:, None] * HEAD_DIM + offs_d[None, :],
             o, mask=r_ok[:, None])
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    tl.store(lse_ptr + split * lse_ss + head_r, lse, mask=r_ok)
    tl.debug_barrier()  # every thread's partial stores precede the arrival
    arrived = tl.atomic_add(cnt_ptr + kvh, 1, sem="acq_rel", scope="gpu")
    if arrived == used - 1:  # the last split of this KV head: merge its group's heads
        offs_g = tl.arange(0, GROUP_P)  # the group's rows, unpadded by the MMA tile
        row_ok = offs_g < GROUP
        head = kvh * GROUP + offs_g
        offs_s = tl.arange(0, SPLITS_P)
        lse_all = tl.load(lse_ptr + offs_s[:, None] * lse_ss + head[None, :],
                          mask=(offs_s < used)[:, None] & row_ok[None, :],
                          other=float("-inf"), cache_modifier=".cg")
        m_all = tl.max(lse_all, 0)
        m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
        w_sum = tl.sum(tl.exp2(lse_all - m_all[None, :]), 0)
        merged = tl.zeros([GROUP_P, HEAD_DIM], dtype=tl.float32)
        for sp in tl.static_range(SPLITS):  # unrolled: every partial's load in flight
            sp_ok = row_ok & ((offs_g * 0 + sp) < used)
            w_s = tl.exp2(tl.load(lse_ptr + sp * lse_ss + head, mask=sp_ok, other=float("-inf"),
                                  cache_modifier=".cg") - m_all)
            part = tl.load(part_ptr + sp * part_ss + head[:, None] * HEAD_DIM
                           + offs_d[None, :], mask=sp_ok[:, None], other=0.0,
                           cache_modifier=".cg")
            merged += w_s[:, None] * part
        merged = merged / tl.where(w_sum > 0.0, w_sum, 1.0)[:, None]
        tl.store(attn_ptr + head[:, None] * HEAD_DIM + offs_d[None, :], merged.to(DT),
                 mask=row_ok[:, None])
        tl.atomic_xchg(cnt_ptr + kvh, 0)  # re-armed for the next layer, step or replay


@triton.jit
def attention_phase(pid, P, M, qkv_ptr, k_ptr, v_ptr, bt_ptr, seq_ptr, pos_ptr, slot_ptr, cs_ptr,
                    qw_ptr, kw_ptr, part_ptr, lse_ptr, attn_ptr, cnt_ptr,
                    kv_cap, kv_budget, qk_eps, scale_log2, stride_cs, stride_bt,
                    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                    HQ: tl.constexpr, HK: tl.constexpr, HEAD_DIM: tl.constexpr,
                    KV_BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
                    SPLITS: tl.constexpr, SPLITS_P: tl.constexpr, BLOCK_N: tl.constexpr,
                    Q_NORM: tl.constexpr, K_NORM: tl.constexpr, BATCHED: tl.constexpr,
                    ROLL_OK: tl.constexpr, SPAN: tl.constexpr, LINE_ELEMS: tl.constexpr,
                    ROW_LINES: tl.constexpr, ATT_M: tl.constexpr, ATT_DOT: tl.constexpr,
                    UPCAST: tl.constexpr):
    """One query token a request over its paged KV: this program's ``(request, KV head,
    split)`` items. The step's ``qkv`` rows are raw (un-normalised, un-rotated); the split
    holding a row's last tile adds the new key from registers and writes the new K/V to
    the cache (no program reads that slot: the tiles stop before it). Each item stores a
    float32 partial; the last split of a (request, KV head) to arrive merges its group's
    heads into ``attn`` and re-arms its counter. Splits cover each row's *real* length
    (device ``seq_lens``): a short row uses fewer items. ``BATCHED`` (``M`` requests):
    items ``(request, KV head, split < batch_splits)``, the unused ones skipped; otherwise
    (request 0 alone) only the used items are walked."""
    HALF: tl.constexpr = HEAD_DIM // 2
    NQKV: tl.constexpr = (HQ + 2 * HK) * HEAD_DIM
    offs_d = tl.arange(0, HEAD_DIM)
    if BATCHED:  # about one item a program: at most batch_splits splits a request
        sc = batch_splits(P, M, HK, SPLITS)
        for item in range(pid, M * HK * sc, P):
            req = item // (HK * sc)
            kvh = (item // sc) % HK
            split = item % sc
            ctx_len, kv_end, num_tiles, per_split, used, cached_end = split_plan(
                seq_ptr + req, kv_cap, sc, BLOCK_N)
            if split < used:
                new_pos = tl.load(pos_ptr + req).to(tl.int64)
                new_slot = tl.load(slot_ptr + req).to(tl.int64)
                cos, sin = rope_cos_sin(cs_ptr, stride_cs, new_pos, offs_d, HALF)
                _attend_item(qkv_ptr + req * NQKV, k_ptr, v_ptr, bt_ptr + req * stride_bt,
                             qw_ptr, kw_ptr, part_ptr + req * (HQ * HEAD_DIM),
                             lse_ptr + req * HQ, attn_ptr + req * (HQ * HEAD_DIM),
                             cnt_ptr + req * HK, kvh, split, ctx_len, kv_end, num_tiles,
                             per_split, used, cached_end, new_slot, cos, sin,
                             M * (HQ * HEAD_DIM), M * HQ, qk_eps, scale_log2,
                             stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                             HQ, HK, HEAD_DIM, KV_BLOCK_SIZE, GROUP, GROUP_P, SPLITS, SPLITS_P,
                             BLOCK_N, Q_NORM, K_NORM, cached_end * M > kv_budget, ROLL_OK,
                             SPAN, LINE_ELEMS, ROW_LINES, ATT_M, ATT_DOT, UPCAST)
    else:
        ctx_len, kv_end, num_tiles, per_split, used, cached_end = split_plan(
            seq_ptr, kv_cap, SPLITS, BLOCK_N)
        new_pos = tl.load(pos_ptr).to(tl.int64)
        new_slot = tl.load(slot_ptr).to(tl.int64)
        cos, sin = rope_cos_sin(cs_ptr, stride_cs, new_pos, offs_d, HALF)
        for item in range(pid, HK * used, P):
            _attend_item(qkv_ptr, k_ptr, v_ptr, bt_ptr, qw_ptr, kw_ptr, part_ptr, lse_ptr,
                         attn_ptr, cnt_ptr, item // used, item % used, ctx_len, kv_end,
                         num_tiles, per_split, used, cached_end, new_slot, cos, sin,
                         HQ * HEAD_DIM, HQ, qk_eps, scale_log2,
                         stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                         HQ, HK, HEAD_DIM, KV_BLOCK_SIZE, GROUP, GROUP_P, SPLITS, SPLITS_P,
                         BLOCK_N, Q_NORM, K_NORM, cached_end > kv_budget, ROLL_OK, SPAN,
                         LINE_ELEMS, ROW_LINES, ATT_M, ATT_DOT, UPCAST)
