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
from kernels.attention_merge import merge_splits
from kernels.pdl import prefetch_lines_l2, wait_and_release
from kernels.attention_splits import (  # noqa: F401 - the launch sizing is re-exported here
    CTAS_PER_SM, MAX_SPLITS, MIN_TOKENS_PER_SPLIT, MIN_TOKENS_PER_SPLIT_SHORT, _device_sms,
    _semaphores, reduce_splits, choose_num_splits, launch_config, one_token_launch,
    one_token_stages,
)
from kernels.rope_inline import DecodeRope, add_new_key, rope_cos_sin, rope_rows

LOG2E = 1.4426950408889634


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
@triton.jit(do_not_specialize=["num_reqs", "kv_cap", "stride_bt", "stride_ls"])
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, final_ptr, sem_ptr,
    block_table_ptr, seq_lens_ptr, qsl_ptr,
    kn_ptr, vn_ptr, pos_ptr, slot_ptr, cs_ptr, qw_ptr, kw_ptr,
    num_reqs, kv_cap, scale_log2, eps, stride_cs,
    stride_knt, stride_knh, stride_vnt, stride_vnh,
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
    UPCAST: tl.constexpr, FUSED_REDUCE: tl.constexpr,
    LINE_ELEMS: tl.constexpr = 64, ROW_LINES: tl.constexpr = 2,
    ROPE: tl.constexpr = False, Q_NORM: tl.constexpr = False, K_NORM: tl.constexpr = False,
    USE_PDL: tl.constexpr = False, PRELOAD: tl.constexpr = False,
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
        q = rope_rows(q_ptr, q_rows, offs_d, row_ok, qw_ptr, eps, cos, sin, Q_NORM,
                      HEAD_DIM // 2, DT, False)
        kn_row = tl.zeros([1], dtype=tl.int64) + q_start.to(tl.int64) * stride_knt + kvh * stride_knh
        k_new = rope_rows(kn_ptr, kn_row, offs_d, kn_row == kn_row, kw_ptr, eps, cos, sin,
                          K_NORM, HEAD_DIM // 2, DT, False).to(k_ptr.dtype.element_ty)
        v_new = tl.load(vn_ptr + q_start.to(tl.int64) * stride_vnt + kvh * stride_vnh + offs_d,
                        mask=d_ok, other=0.0).to(v_ptr.dtype.element_ty)
    else:
        q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
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
        else:
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

    if ROPE:
        # The split holding the row's last tile owns the new key: it adds it (unless a
        # bound below seq_len hides it, as the reference's bound does) and writes it.
        last_tile = (kv_end - 1) // BLOCK_N
        owner = (tile_lo <= last_tile) & (last_tile < tile_hi)
        if owner & (ctx_len < kv_end):
            m_i, l_i, acc = add_new_key(q, k_new, v_new, m_i, l_i, acc, row_ok, scale_log2,
                                        v_ptr.dtype.element_ty)
        # Written after the loop: a cache store before it would order every tile's K/V
        # loads behind the new key (the compiler cannot rule out aliasing).
        if owner & (new_slot >= 0):
            pg = new_slot // KV_BLOCK_SIZE
            nc = pg * stride_kb + (new_slot % KV_BLOCK_SIZE) * stride_kt + kvh * stride_kh
            tl.store(k_ptr + nc + offs_d[None, :], k_new, mask=d_ok[None, :])
            nv = pg * stride_vb + (new_slot % KV_BLOCK_SIZE) * stride_vt + kvh * stride_vh
            tl.store(v_ptr + nv + offs_d, v_new, mask=d_ok)

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
                merge_splits(out_ptr, lse_ptr, final_ptr, sem, used, o_rows, l_rows, f_rows,
                             offs_m, offs_d, row_ok, d_ok, stride_os, stride_ls, BLOCK_M,
                             BLOCK_D, NUM_SPLITS)


def row_lines(head_dim: int, element_size: int) -> dict[str, int]:
    """The L2 prefetch's view of one K/V row: ``ROW_LINES`` (a power of two) 128-byte lines,
    ``LINE_ELEMS`` elements apart, cover its ``head_dim`` elements (short rows: one line)."""
    return dict(LINE_ELEMS=max(1, 128 // element_size),
                ROW_LINES=triton.next_power_of_2(triton.cdiv(head_dim * element_size, 128)))


def _rope_args(rope: DecodeRope) -> tuple:
    """The fused-rope pointer arguments (a missing norm weight: any tensor, unread)."""
    return (rope.k, rope.v, rope.positions, rope.slot_mapping, rope.cos_sin_cache,
            rope.q_norm_weight if rope.q_norm_weight is not None else rope.k,
            rope.k_norm_weight if rope.k_norm_weight is not None else rope.k)


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
    rope: DecodeRope | None = None,
    eager: bool = False,
) -> torch.Tensor:
    """Causal paged attention; layouts as in ``kernels.reference``.

    ``rope`` (batches of one query token a request, ``max_query_len == 1``): ``q`` is the
    raw projection; the kernel also does ``kernels.rope_kv``'s work (q/k norm, rotary,
    the new K/V written to the cache), as ``rope_and_write_kv_reference`` followed by
    this function would (within 16-bit rounding). One difference: a request whose new
    token has slot -1 (a draft lookahead past its KV capacity) attends its fresh key,
    where the two-launch path attends whatever the cache holds at that position.

    ``max_query_len`` and ``max_seq_len_upper_bound`` are CPU ints that must be
    >= the real values; they only size grids and pick configs. ``num_splits``
    overrides the split-KV heuristic (tests, benchmarks). Decode-shaped splits
    merge their partials in the last arriving program (``fused_reduce``, default
    on) instead of a second launch. ``eager``: a launch outside any CUDA graph takes its
    shape from the small fixed set of ``launch_config(eager=True)``. ``config`` overrides
    ``block_n`` /
    ``num_warps`` / ``num_stages`` (benchmarks). Rows of ``q`` past
    ``query_start_loc[-1]`` (padding) are left unwritten.
    """
    num_tokens, hq, head_dim = q.shape
    _, kv_block_size, hkv, _ = k_cache.shape
    num_reqs = query_start_loc.shape[0] - 1
    assert hq % hkv == 0, "num_q_heads must be a multiple of num_kv_heads"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if rope is not None:
        assert max_query_len == 1, "fused rope: one query token a request"
        assert head_dim % 2 == 0 and rope.cos_sin_cache.shape[-1] == head_dim
        assert rope.k.shape[1:] == (hkv, head_dim) and rope.v.shape[1:] == (hkv, head_dim)
        assert rope.k.stride(-1) == 1 and rope.v.stride(-1) == 1
        assert rope.cos_sin_cache.stride(-1) == 1 and rope.slot_mapping.shape[0] >= num_tokens
    group = hq // hkv
    group_p = triton.next_power_of_2(group)
    block_d = max(16, triton.next_power_of_2(head_dim))
    out = torch.empty((num_tokens, hq, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_reqs == 0:
        return out

    lc = launch_config(num_reqs, num_tokens, hkv, group_p, block_d, max_query_len,
                       max_seq_len_upper_bound, _device_sms(q.device), eager=eager)
    one_qblock, grid0, block_q, block_m = lc.one_qblock, lc.grid0, lc.block_q, lc.block_m
    block_n, num_warps, num_stages = lc.block_n, lc.num_warps, lc.num_stages
    one_token = one_token_launch(one_qblock, block_q, block_m)
    if config:
        block_n = config.get("block_n", block_n)
        num_warps = config.get("num_warps", num_warps)
    if num_splits is None:
        num_splits = lc.num_splits
    num_splits = max(1, min(int(num_splits), MAX_SPLITS))
    if one_token and not eager:  # the depth follows the tiles a split gets after any override
        num_stages = one_token_stages(block_n, num_splits, max_seq_len_upper_bound)
    if config:
        num_stages = config.get("num_stages", num_stages)
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

    launch = pdl.launch_kwargs(q)
    # with PDL, a one-tile split's K and V tile load before the wait (5 % off a Qwen3-0.6B
    # batch-1 step, 1 % off Llama-3.1-8B's; the keys alone were slower: docs/decisions.md);
    # a longer split's first tile is prefetched into L2 instead
    preload = one_token and rope is not None and num_stages == 1 and launch["USE_PDL"]
    if preload and not (config and "num_warps" in config):
        num_warps = 8  # K and V tiles held across the wait: 4 warps spill (sm_90)
    kv_cap = min(triton.cdiv(max_seq_len_upper_bound, kv_block_size), block_table.shape[1])
    kv_cap *= kv_block_size
    _paged_attention_kernel[(grid0, hkv, num_splits)](
        q, k_cache, v_cache, dst, lse, out, sem if sem is not None else seq_lens,
        block_table, seq_lens, query_start_loc,
        *(_rope_args(rope) if rope is not None else (q,) * 7),
        num_reqs, kv_cap, float(scale) * LOG2E,
        float(rope.eps) if rope is not None else 0.0,
        rope.cos_sin_cache.stride(0) if rope is not None else 0,
        *((rope.k.stride(0), rope.k.stride(1), rope.v.stride(0), rope.v.stride(1))
          if rope is not None else (0, 0, 0, 0)),
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
        FUSED_REDUCE=sem is not None,
        **row_lines(head_dim, k_cache.element_size()),
        ROPE=rope is not None, Q_NORM=rope is not None and rope.q_norm_weight is not None,
        K_NORM=rope is not None and rope.k_norm_weight is not None,
        PRELOAD=preload,
        num_warps=num_warps, num_stages=num_stages, **launch,
    )
    if num_splits > 1 and sem is None:
        reduce_splits(part, lse, out, query_start_loc, num_reqs, block_d)
    return out
