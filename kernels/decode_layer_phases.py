"""The phases of the persistent decoder-layer kernel (``kernels.decode_layer``): the batch-1
GEMVs, the L2 prefetches (weights; the attention's K/V rows), the attention's split plan and
the helpers the batched GEMVs (``kernels.decode_layer_batched``) share. The attention phase
itself is ``kernels.decode_layer_attention``.

Each phase is a device function that one program runs over *its share* of the phase's work
(row blocks ``pid, pid + P, ...`` of a GEMV; ``(request, KV head, split)`` items of the
attention),
so the same code serves the one-launch kernel (phases separated by grid barriers) and the
interpreter's one-launch-a-phase path. Activations that another program of the same launch
stored are loaded with ``cache_modifier=".cg"`` (see ``kernels.grid_sync``).

Numerics follow the multi-launch path's kernels: the GEMVs round the normalised input to the
dtype before the ``rstd`` scale (``kernels.gemv``), the attention rotates (and for Qwen3
normalises) q and the new key in registers as ``kernels.paged_attention``'s decode path does,
rounds P to the dtype before P @ V, and merges split partials in float32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.pdl import prefetch_l2, prefetch_lines_l2


@triton.jit
def prefetch_rows(w_ptr, pid, P, N_OUT, K, up_off, BLOCK_N: tl.constexpr, ROW_MUL: tl.constexpr,
                  TWO_RANGES: tl.constexpr, ESZ: tl.constexpr, ENABLED: tl.constexpr):
    """Bulk-prefetch this program's weight rows of a later GEMV phase into L2 (``ENABLED``:
    sm_90+, compiled, 16-byte aligned rows). Weights are never written by a kernel of the
    step, so this may run at any time; it keeps HBM streaming across the barriers."""
    if ENABLED:
        for b in range(pid, tl.cdiv(N_OUT, BLOCK_N), P):
            prefetch_block(w_ptr, b, N_OUT, K, up_off, BLOCK_N, ROW_MUL, TWO_RANGES, ESZ)


@triton.jit
def prefetch_block(w_ptr, blk, N_OUT, K, up_off, BLOCK_N: tl.constexpr, ROW_MUL: tl.constexpr,
                   TWO_RANGES: tl.constexpr, ESZ: tl.constexpr):
    """Row block ``blk`` of a GEMV's weight into L2 (nothing past the last block;
    ``TWO_RANGES``: stacked gate|up, whose up rows are a second range)."""
    r0 = blk * BLOCK_N
    if r0 < N_OUT:
        nrows = tl.minimum(N_OUT - r0, BLOCK_N)
        prefetch_l2(w_ptr + (r0 * ROW_MUL).to(tl.int64) * K, nrows * (ROW_MUL * K * ESZ))
        if TWO_RANGES:
            prefetch_l2(w_ptr + (r0 + up_off).to(tl.int64) * K, nrows * (K * ESZ))


@triton.jit
def prefetch_lead(w_ptr, pid, P, N_OUT, K, up_off, BLOCK_N: tl.constexpr, ROW_MUL: tl.constexpr,
                  TWO_RANGES: tl.constexpr, ESZ: tl.constexpr, AHEAD: tl.constexpr):
    """This program's first ``AHEAD`` row blocks of the next GEMV phase into L2, issued
    before the barrier that starts it (``gemv_phase`` keeps ``AHEAD`` blocks ahead)."""
    for j in tl.static_range(AHEAD):
        prefetch_block(w_ptr, pid + j * P, N_OUT, K, up_off, BLOCK_N, ROW_MUL, TWO_RANGES, ESZ)


@triton.jit
def sum_squares(x_ptr, r_ptr, s_out_ptr, pid, K, HAS_RES: tl.constexpr, BLOCK_K: tl.constexpr):
    """``sum(s^2)`` of ``s = x (+ r)`` rounded to the dtype; program 0 stores ``s`` (the new
    residual) to ``s_out_ptr``."""
    DT = x_ptr.dtype.element_ty
    offs_k = tl.arange(0, BLOCK_K)
    store_end = tl.where(pid == 0, K, 0)
    ss = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        s = tl.load(x_ptr + k0 + offs_k, mask=k_ok, other=0.0, cache_modifier=".cg")
        if HAS_RES:
            s = (s.to(tl.float32) + tl.load(r_ptr + k0 + offs_k, mask=k_ok, other=0.0,
                                            cache_modifier=".cg").to(tl.float32)).to(DT)
        tl.store(s_out_ptr + k0 + offs_k, s, mask=(k0 + offs_k) < store_end)
        sf = s.to(tl.float32)
        ss += sf * sf
    return tl.sum(ss, 0)


@triton.jit
def input_chunk(x, r, g_ptr, k0, offs_k, K, HAS_RES: tl.constexpr, NORM: tl.constexpr, DT):
    """A GEMV's input chunk at column ``k0`` (``[BLOCK_K]``, or ``[rows, BLOCK_K]``):
    ``((x [+ r]) -> dtype [* g]) -> dtype``."""
    a = x
    if HAS_RES:
        a = (x.to(tl.float32) + r.to(tl.float32)).to(DT)
    if NORM:
        g = tl.load(g_ptr + k0 + offs_k, mask=(k0 + offs_k) < K, other=0.0).to(tl.float32)
        a = (a.to(tl.float32) * g).to(DT)
    return a


@triton.jit
def store_rows(y, y_u, y_ptr, rin_ptr, off, ok, DT: tl.constexpr, ACT: tl.constexpr,
               EPI_RES: tl.constexpr, AXIS: tl.constexpr):
    """A GEMV phase's epilogue for float32 results ``y`` (and ``y_u``, the up half, with
    ``ACT``) at offsets ``off``: ``silu(gate) * up`` with gate and up rounded to ``DT``;
    stores ``y -> DT``, or with ``EPI_RES`` ``(y + rin) -> DT`` and returns the sum of its
    squares along ``AXIS`` (0 otherwise)."""
    if ACT:
        gate = y.to(DT).to(tl.float32)
        up = y_u.to(DT).to(tl.float32)
        y = (gate / (1.0 + tl.exp(-gate))).to(DT).to(tl.float32) * up
    y = y.to(DT)
    if EPI_RES:
        s = (y.to(tl.float32) + tl.load(rin_ptr + off, mask=ok, other=0.0,
                                        cache_modifier=".cg").to(tl.float32)).to(DT)
        tl.store(y_ptr + off, s, mask=ok)
        sf = tl.where(ok, s.to(tl.float32), 0.0)
    else:
        tl.store(y_ptr + off, y, mask=ok)
        sf = tl.where(ok, 0.0, 0.0)
    return tl.sum(sf * sf, AXIS)


@triton.jit
def weight_tile(w_ptr, pid, P, step, total, N_OUT, K, up_off, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, ROW_MUL: tl.constexpr, ACT: tl.constexpr):
    """The weight tile(s) of this program's ``step``-th (row block, K chunk), zeros past
    ``total`` steps: ``(w, w_up, columns)`` (``w_up`` is ``w`` without ``ACT``)."""
    KT = tl.cdiv(K, BLOCK_K)
    rows = (pid + (step // KT) * P) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = (step % KT) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (rows < tl.where(step < total, N_OUT, 0))[:, None] & (cols < K)[None, :]
    ptrs = w_ptr + (rows * ROW_MUL).to(tl.int64)[:, None] * K + cols[None, :]
    w = tl.load(ptrs, mask=ok, other=0.0)
    w_up = w
    if ACT:
        w_up = tl.load(ptrs + up_off * K, mask=ok, other=0.0)
    return w, w_up, cols


@triton.jit
def gemv_phase(pid, P, x_ptr, r_ptr, g_ptr, rstd, w_ptr, y_ptr, rin_ptr, N_OUT, K, up_off,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROW_MUL: tl.constexpr,
               HAS_RES: tl.constexpr, NORM: tl.constexpr, ACT: tl.constexpr,
               EPI_RES: tl.constexpr, AHEAD: tl.constexpr = 0, ESZ: tl.constexpr = 2,
               TWO_RANGES: tl.constexpr = False):
    """This program's row blocks of ``y = act((a @ W^T) * rstd)``, ``a = ((x [+ r]) [* g])``
    rounded to the dtype. ``ACT``: ``silu(gate) * up`` with gate row ``j * ROW_MUL`` and up
    row ``j * ROW_MUL + up_off``. ``EPI_RES``: stores ``(y + rin) -> dtype`` instead and
    returns the sum of its squares over this program's rows (the next norm's partial).

    Nothing waits on a load issued in the same step: the next step's weight tile (and
    input chunk) are loaded while this one is multiplied, and an input that fits one chunk
    (``K <= BLOCK_K``) is loaded once. (The input comes from L2, ``.cg``: loaded afresh
    each step it would put an L2 round trip on every step's critical path.) ``AHEAD``
    (weights not prefetched a phase ahead): as each row block starts, the block ``AHEAD``
    further is bulk-prefetched into L2 (``prefetch_lead`` issued the first ones), so that
    many blocks stream from HBM behind the one register tile in flight (``TWO_RANGES``:
    stacked gate|up, whose up rows are a second range)."""
    DT = w_ptr.dtype.element_ty
    offs_r = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    KT = tl.cdiv(K, BLOCK_K)
    n_blocks = tl.cdiv(N_OUT, BLOCK_N)
    total = tl.cdiv(n_blocks - pid, P) * KT  # this program's (row block, K chunk) steps
    w_nxt, wu_nxt, _ = weight_tile(w_ptr, pid, P, 0, total, N_OUT, K, up_off, BLOCK_N, BLOCK_K,
                                   ROW_MUL, ACT)
    x_nxt = tl.load(x_ptr + offs_k, mask=offs_k < K, other=0.0, cache_modifier=".cg")
    r_nxt = x_nxt
    if HAS_RES:
        r_nxt = tl.load(r_ptr + offs_k, mask=offs_k < K, other=0.0, cache_modifier=".cg")
    a_one = input_chunk(x_nxt, r_nxt, g_ptr, 0, offs_k, K, HAS_RES, NORM, DT).to(tl.float32)
    ss = tl.sum(tl.zeros([BLOCK_N], dtype=tl.float32), 0)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for i in range(0, total):
        kc = i % KT
        k0 = kc * BLOCK_K
        w = w_nxt
        wu = wu_nxt
        # the next step's tile (none past this program's last step)
        w_nxt, wu_nxt, nk = weight_tile(w_ptr, pid, P, i + 1, total, N_OUT, K, up_off, BLOCK_N,
                                        BLOCK_K, ROW_MUL, ACT)
        if AHEAD > 0:
            if kc == 0:
                prefetch_block(w_ptr, pid + (i // KT + AHEAD) * P, N_OUT, K, up_off, BLOCK_N,
                               ROW_MUL, TWO_RANGES, ESZ)
        if KT == 1:
            af = a_one[None, :]
        else:  # several chunks a row block: the next step's input chunk is in flight too
            xc = x_nxt
            rc = r_nxt
            x_nxt = tl.load(x_ptr + nk, mask=nk < K, other=0.0, cache_modifier=".cg")
            if HAS_RES:
                r_nxt = tl.load(r_ptr + nk, mask=nk < K, other=0.0, cache_modifier=".cg")
            af = input_chunk(xc, rc, g_ptr, k0, offs_k, K, HAS_RES, NORM, DT).to(tl.float32)[None, :]
        acc += w.to(tl.float32) * af
        if ACT:
            acc_u += wu.to(tl.float32) * af

        if kc == KT - 1:  # this row block is done: epilogue and store
            out_rows = (pid + (i // KT) * P) * BLOCK_N + offs_r
            ss += store_rows(tl.sum(acc, 1) * rstd, tl.sum(acc_u, 1) * rstd, y_ptr, rin_ptr,
                             out_rows, out_rows < N_OUT, DT, ACT, EPI_RES, 0)
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    return ss


@triton.jit
def batch_splits(P, M, HK, SPLITS: tl.constexpr):
    """Splits a request may use in a batch of ``M``: as many as keep the ``M * HK * splits``
    items to about one a program (at least 1, at most the compiled ``SPLITS``). Decided on
    the device from the runtime ``M``, so every batch size shares one compiled variant."""
    return tl.maximum(1, tl.minimum(P // (M * HK), SPLITS))


@triton.jit
def split_plan(seq_ptr, kv_cap, splits, BLOCK_N: tl.constexpr):
    """How the attention splits a request's keys (``*seq_ptr`` of them) into at most
    ``splits``: ``(ctx_len, kv_end, num_tiles, per_split, used, cached_end)``. ``used``
    splits of ``per_split`` tiles each (at most one split a tile) cover the real length;
    keys ``[0, cached_end)`` are in the cache, the new one (position ``ctx_len``) comes
    from this step's projection."""
    seq_len = tl.load(seq_ptr)
    ctx_len = tl.maximum(seq_len - 1, 0)  # keys before the new one
    kv_end = tl.minimum(ctx_len + 1, kv_cap)
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    per_split = tl.cdiv(num_tiles, tl.minimum(num_tiles, splits))
    used = tl.cdiv(num_tiles, per_split)
    return ctx_len, kv_end, num_tiles, per_split, used, tl.minimum(ctx_len, kv_end)


@triton.jit
def _prefetch_kv_range(k_ptr, v_ptr, bt_ptr, kvh, lo, hi, stride_kb, stride_kt, stride_kh,
                       stride_vb, stride_vt, stride_vh, HEAD_DIM: tl.constexpr,
                       KV_BLOCK_SIZE: tl.constexpr, SPAN: tl.constexpr,
                       LINE_ELEMS: tl.constexpr, ROW_LINES: tl.constexpr):
    """K/V rows ``[lo, hi)`` of KV head ``kvh`` (block-table row ``bt_ptr``) into L2."""
    offs = tl.arange(0, SPAN)
    offs_l = tl.arange(0, ROW_LINES) * LINE_ELEMS
    for p0 in range(lo, hi, SPAN):
        pos = p0 + offs
        ok = pos < hi
        page = tl.load(bt_ptr + pos // KV_BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        in_page = pos % KV_BLOCK_SIZE
        l_ok = ok[:, None] & (offs_l < HEAD_DIM)[None, :]
        k_row = page * stride_kb + in_page * stride_kt + kvh * stride_kh
        prefetch_lines_l2(k_ptr + k_row[:, None] + offs_l[None, :], l_ok)
        v_row = page * stride_vb + in_page * stride_vt + kvh * stride_vh
        prefetch_lines_l2(v_ptr + v_row[:, None] + offs_l[None, :], l_ok)


@triton.jit
def prefetch_kv(pid, P, M, k_ptr, v_ptr, bt_ptr, seq_ptr, kv_cap, kv_budget, stride_bt,
                stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                HK: tl.constexpr, HEAD_DIM: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr,
                SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, SPAN: tl.constexpr,
                LINE_ELEMS: tl.constexpr, ROW_LINES: tl.constexpr, BATCHED: tl.constexpr,
                ENABLED: tl.constexpr):
    """Every cached K/V row of this program's attention items (the same items as
    ``decode_layer_attention.attention_phase``'s) into L2 (``SPAN`` keys a round: one
    block-table load, then one line prefetch per row line). Those keys were written by earlier steps and the lengths
    and block table before the step's first layer, so this may run before the PDL wait;
    the attention's tile loads then hit L2 instead of each paying an HBM round trip.
    Skipped (on the device) for a request past ``kv_budget`` cached keys (batched: ``M``
    times its keys): more would evict the weights prefetched for the next phases."""
    if ENABLED:
        if BATCHED:
            sc = batch_splits(P, M, HK, SPLITS)
            for item in range(pid, M * HK * sc, P):
                req = item // (HK * sc)
                ctx_len, kv_end, num_tiles, per_split, used, cached_end = split_plan(
                    seq_ptr + req, kv_cap, sc, BLOCK_N)
                split = item % sc
                if (split < used) & (cached_end * M <= kv_budget):
                    lo = split * per_split * BLOCK_N
                    _prefetch_kv_range(k_ptr, v_ptr, bt_ptr + req * stride_bt,
                                       (item // sc) % HK, lo,
                                       tl.minimum(lo + per_split * BLOCK_N, cached_end),
                                       stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                                       stride_vh, HEAD_DIM, KV_BLOCK_SIZE, SPAN, LINE_ELEMS,
                                       ROW_LINES)
        else:
            ctx_len, kv_end, num_tiles, per_split, used, cached_end = split_plan(
                seq_ptr, kv_cap, SPLITS, BLOCK_N)
            used = tl.where(cached_end <= kv_budget, used, 0)
            for item in range(pid, HK * used, P):
                lo = (item % used) * per_split * BLOCK_N
                _prefetch_kv_range(k_ptr, v_ptr, bt_ptr, item // used, lo,
                                   tl.minimum(lo + per_split * BLOCK_N, cached_end),
                                   stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                                   stride_vh, HEAD_DIM, KV_BLOCK_SIZE, SPAN, LINE_ELEMS,
                                   ROW_LINES)
