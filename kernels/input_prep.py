"""Triton step-input preparation: one launch for what a step derives on the device.

A step's host part knows only schedule-time values (rows, query lengths and
their prefix sums, block capacities, block tables): O(requests) ints, none per
token. The exact starts live on the device (``num_computed``). From them every
token needs its request (a binary search over the query starts), position, input
id and KV slot, every request its ``seq_len`` and query start.
In torch that is about twenty small element-wise and gather launches, each a
host launch of several microseconds: at batch 1 the decode step's host work, not
the GPU, set the pace (docs/decisions.md). Here one program per
``BLOCK`` tokens does all of it. The plain-torch twin is
``kernels.reference.prepare_inputs_reference`` (the CPU path and this kernel's
oracle); both require every request to have at least one query token.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels import pdl, reference
from kernels.pdl import wait_and_release
from kernels.fast_launch import fast_launch
from kernels.place import Placement, place_program, place_staged, placement_args


class GraphPad(NamedTuple):
    """What a step replaying a captured graph has the input kernel write into the graph's
    static buffers besides its inputs (``prepare_inputs``' ``pad``): its query starts into
    ``qsl`` (int32, at least ``reqs + 1``), padding up to the bucket (``tokens`` slots,
    ``reqs`` requests), and copies of its block table (into ``block_table``, int32, its row
    stride the graph's) and sampled-token indices (``logits_src`` into ``logits_dst``).
    ``seq_rows``: rows up to this many past the step's get ``seq_len`` as their KV length (a
    decode graph's padded rows attend over their own ``seq_len`` query tokens)."""

    qsl: torch.Tensor
    tokens: int
    reqs: int
    block_table: torch.Tensor | None = None
    logits_src: torch.Tensor | None = None
    logits_dst: torch.Tensor | None = None
    seq_rows: int = 0
    seq_len: int = 0


@fast_launch
@triton.jit(
    do_not_specialize=[
        "n_tokens",
        "n_reqs",
        "n_iter",
        "n_blk",
        "stride_tok",
        "stride_bt",
        "max_pos",
        "pad_tokens",
        "pad_reqs",
        "stride_bt_dst",
        "n_logits",
        "pad_seq_rows",
        "pad_seq_len",
        "n_in",
        "st_tok",
        "st_prompt",
        "st_req",
        "vocab",
        "stride_mask",
        "stride_counts",
        "stride_opt",
    ],
    # (the staged words follow the step's other segments: their alignment varies)
    do_not_specialize_on_alignment=["staged_ptr", "new_j_ptr"],
)
def _prepare_inputs_kernel(
    hdr_ptr,
    starts_ptr,
    rows_ptr,
    qsl_in_ptr,
    q_lens_ptr,
    capacity_ptr,
    token_ids_ptr,
    block_table_ptr,
    positions_ptr,
    input_ids_ptr,
    seq_lens_ptr,
    slots_ptr,
    qsl_ptr,
    n_tokens,
    n_reqs,
    n_iter,
    n_blk,
    stride_tok,
    stride_bt,
    max_pos,
    pad_tokens,
    pad_reqs,
    bt_dst_ptr,
    stride_bt_dst,
    logits_src_ptr,
    logits_dst_ptr,
    n_logits,
    pad_seq_rows,
    pad_seq_len,
    n_in,
    staged_ptr,
    new_j_ptr,
    prompt_len_ptr,
    mask_ptr,
    counts_ptr,
    opt_ptr,
    st_tok,
    st_prompt,
    st_req,
    vocab,
    stride_mask,
    stride_counts,
    stride_opt,
    KV_BLOCK_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    STARTS_BY_ROW: tl.constexpr = False,
    COPY_TABLE: tl.constexpr = False,
    COPY_LOGITS: tl.constexpr = False,
    COMMIT_LENGTHS: tl.constexpr = False,
    PLACE: tl.constexpr = False,
    WORDS: tl.constexpr = 1,
    HEADER: tl.constexpr = False,
):
    tl.static_assert(not PLACE or (STARTS_BY_ROW and not COMMIT_LENGTHS))
    if HEADER:  # the step's scalars and segment offsets from its staged words (kernels.input_header)
        n_tokens = tl.load(hdr_ptr + 0).to(tl.int32)
        n_reqs = tl.load(hdr_ptr + 1).to(tl.int32)
        n_iter = tl.load(hdr_ptr + 2).to(tl.int32)
        n_blk = tl.load(hdr_ptr + 3).to(tl.int32)
        stride_bt = tl.load(hdr_ptr + 4).to(tl.int32)
        pad_tokens = tl.load(hdr_ptr + 5).to(tl.int32)
        pad_reqs = tl.load(hdr_ptr + 6).to(tl.int32)
        n_logits = tl.load(hdr_ptr + 7).to(tl.int32)
        pad_seq_rows = tl.load(hdr_ptr + 8).to(tl.int32)
        pad_seq_len = tl.load(hdr_ptr + 9).to(tl.int32)
        st_tok = tl.load(hdr_ptr + 10).to(tl.int32)
        st_prompt = tl.load(hdr_ptr + 11).to(tl.int32)
        st_req = tl.load(hdr_ptr + 12).to(tl.int32)
        rows_ptr = hdr_ptr + tl.load(hdr_ptr + 13)
        qsl_in_ptr = hdr_ptr + tl.load(hdr_ptr + 14)
        q_lens_ptr = hdr_ptr + tl.load(hdr_ptr + 15)
        capacity_ptr = hdr_ptr + tl.load(hdr_ptr + 16)
        block_table_ptr = (hdr_ptr + tl.load(hdr_ptr + 17)).to(tl.pointer_type(tl.int32))
        logits_src_ptr = hdr_ptr + tl.load(hdr_ptr + 18)
        staged_ptr = hdr_ptr + tl.load(hdr_ptr + 19)
        new_j_ptr = hdr_ptr + tl.load(hdr_ptr + 20)
    wait_and_release(USE_PDL)  # (before any write: the previous kernel may still read the rows)
    if PLACE and tl.program_id(0) >= n_in:  # the new requests' placement (DeviceState.stage's words)
        words = staged_ptr + 3 * st_tok + 3 * st_req
        place_program(
            tl.program_id(0) - n_in,
            staged_ptr, staged_ptr + st_tok, staged_ptr + 2 * st_tok, staged_ptr + 3 * st_tok,
            staged_ptr + 3 * st_tok + st_req, staged_ptr + 3 * st_tok + 2 * st_req, words,
            token_ids_ptr, starts_ptr, prompt_len_ptr, mask_ptr, counts_ptr, opt_ptr,
            st_tok, st_prompt, st_req, vocab, stride_tok, stride_mask, stride_counts, stride_opt,
            WORDS, BLOCK,
        )  # fmt: skip
    else:
        _prepare_program(
            starts_ptr, rows_ptr, qsl_in_ptr, q_lens_ptr, capacity_ptr, token_ids_ptr, block_table_ptr,
            positions_ptr, input_ids_ptr, seq_lens_ptr, slots_ptr, qsl_ptr, n_tokens, n_reqs, n_iter, n_blk,
            stride_tok, stride_bt, max_pos, pad_tokens, pad_reqs, bt_dst_ptr, stride_bt_dst, logits_src_ptr,
            logits_dst_ptr, n_logits, pad_seq_rows, pad_seq_len, n_in, staged_ptr, new_j_ptr, st_tok, st_prompt,
            st_req, KV_BLOCK_SIZE, BLOCK, STARTS_BY_ROW, COPY_TABLE, COPY_LOGITS, COMMIT_LENGTHS, PLACE, WORDS,
        )  # fmt: skip


# fmt: off
@triton.jit
def _prepare_program(
    starts_ptr, rows_ptr, qsl_in_ptr, q_lens_ptr, capacity_ptr, token_ids_ptr, block_table_ptr, positions_ptr,
    input_ids_ptr, seq_lens_ptr, slots_ptr, qsl_ptr, n_tokens, n_reqs, n_iter, n_blk, stride_tok, stride_bt,
    max_pos, pad_tokens, pad_reqs, bt_dst_ptr, stride_bt_dst, logits_src_ptr, logits_dst_ptr, n_logits,
    pad_seq_rows, pad_seq_len, n_in, staged_ptr, new_j_ptr, st_tok, st_prompt, st_req,
    KV_BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr, STARTS_BY_ROW: tl.constexpr, COPY_TABLE: tl.constexpr,
    COPY_LOGITS: tl.constexpr, COMMIT_LENGTHS: tl.constexpr, PLACE: tl.constexpr, WORDS: tl.constexpr
):
    # fmt: on
    """One of the ``n_in`` input programs (``_prepare_inputs_kernel``). ``PLACE``: the rows
    placed in the same launch (``new_j[r] >= 0``: request ``j`` of the staged words) take
    their start and tokens from the staged words, never from the state the placement
    programs are writing (programs of one launch run in no order)."""
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = t < n_tokens
    # token t's request r: the last with qsl_in[r] <= t, found by bisection keeping
    # qsl_in[lo] <= t < qsl_in[hi] (qsl_in[n_reqs] = n_tokens). Every request has a token, so
    # t - (n_tokens - n_reqs) <= r <= t: the bounds span at most n_tokens - n_reqs + 1
    # requests (one, no search, in a uniform decode) and n_iter halvings leave hi = lo + 1
    lo = tl.maximum(t - (n_tokens - n_reqs), 0).to(tl.int32)  # (one type through the loop)
    hi = tl.minimum(t + 1, n_reqs).to(tl.int32)
    for _ in range(n_iter):
        mid = (lo + hi) // 2  # lo < mid < hi while hi - lo > 1, then mid = lo: in range
        below = tl.load(qsl_in_ptr + mid, mask=ok, other=0) <= t
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid)
    r = lo
    off = t - tl.load(qsl_in_ptr + r, mask=ok, other=0)
    row = tl.load(rows_ptr + r, mask=ok, other=0)
    is_old = ok
    if PLACE:
        nj = tl.load(new_j_ptr + r, mask=ok & (t * 0 + st_req > 0), other=-1)  # (a header's step may place none)
        is_new = ok & (nj >= 0)
        is_old = ok & (nj < 0)
        nj = tl.maximum(nj, 0)
        cached = tl.load(staged_ptr + 3 * st_tok + st_req + nj, mask=is_new, other=0)
    # STARTS_BY_ROW: starts_ptr is the per-row num_computed, indexed by the device row
    pos = tl.load(starts_ptr + (row if STARTS_BY_ROW else r), mask=is_old, other=0).to(tl.int64) + off
    ids = tl.load(token_ids_ptr + row * stride_tok + tl.minimum(pos, max_pos), mask=is_old, other=0)
    if PLACE:  # a placed row: its start and its token from the staged words
        pos = tl.where(is_new, cached + off, pos)
        plen = tl.load(staged_ptr + 3 * st_tok + 2 * st_req + nj, mask=is_new, other=0)
        seg = staged_ptr + 3 * st_tok + (3 + WORDS) * st_req  # the requests' prompt, then output offsets
        poff = tl.load(seg + nj, mask=is_new, other=0)
        ooff = tl.load(seg + st_req + nj, mask=is_new, other=0)
        src = tl.where(pos < plen, poff + pos, st_prompt + ooff + pos - plen)
        src = tl.minimum(src, st_tok - 1)  # (a graph's padding positions past the request's tokens)
        ids = tl.where(is_new, tl.load(staged_ptr + src, mask=is_new, other=0), ids)
    page = tl.minimum(pos // KV_BLOCK_SIZE, n_blk - 1)
    blk = tl.load(block_table_ptr + r * stride_bt + page, mask=ok, other=0).to(tl.int64)
    cap = tl.load(capacity_ptr + r, mask=ok, other=0)
    slot = tl.where(pos < cap, blk * KV_BLOCK_SIZE + pos % KV_BLOCK_SIZE, -1)
    tl.store(positions_ptr + t, pos, mask=ok)
    tl.store(input_ids_ptr + t, ids, mask=ok)
    tl.store(slots_ptr + t, slot, mask=ok)
    q_len = tl.load(q_lens_ptr + r, mask=ok, other=1)
    # the request's last token knows its KV length, its first token its query start
    tl.store(seq_lens_ptr + r, (pos + 1).to(tl.int32), mask=ok & (off == q_len - 1))
    if COMMIT_LENGTHS:  # one token a row: the lane that read the row's start alone writes it
        tl.store(starts_ptr + row, (pos + 1).to(tl.int32), mask=ok)
    tl.store(qsl_ptr + r, t.to(tl.int32), mask=ok & (off == 0))
    tl.store(qsl_ptr + n_reqs + t * 0, (t + 1).to(tl.int32), mask=ok & (t == n_tokens - 1))
    # a CUDA graph's padding: tokens up to pad_tokens write no KV, requests up to pad_reqs are
    # empty (their query range starts and ends at n_tokens)
    tl.store(slots_ptr + t, tl.full([BLOCK], -1, tl.int64), mask=(t >= n_tokens) & (t < pad_tokens))
    if tl.program_id(0) == 0:
        for start in range(n_reqs + 1, pad_reqs + 1, BLOCK):
            j = start + tl.arange(0, BLOCK)
            tl.store(qsl_ptr + j, tl.full([BLOCK], 0, tl.int32) + n_tokens, mask=j <= pad_reqs)
        for start in range(n_reqs, pad_seq_rows, BLOCK):  # a decode graph's padded rows' lengths
            j = start + tl.arange(0, BLOCK)
            tl.store(seq_lens_ptr + j, tl.full([BLOCK], 0, tl.int32) + pad_seq_len, mask=j < pad_seq_rows)
    # and the graph's block table and sampled-token indices, copied from the step's (every
    # program a share: request rows, then index blocks, strided by the program count)
    pid, nprog = tl.program_id(0), n_in  # (a placement's programs come after these)
    if COPY_TABLE:
        for r2 in range(pid, n_reqs, nprog):
            for c0 in range(0, n_blk, BLOCK):
                c = c0 + tl.arange(0, BLOCK)
                v = tl.load(block_table_ptr + r2 * stride_bt + c, mask=c < n_blk, other=0)
                tl.store(bt_dst_ptr + r2 * stride_bt_dst + c, v, mask=c < n_blk)
    if COPY_LOGITS:
        for i0 in range(pid * BLOCK, n_logits, nprog * BLOCK):
            i = i0 + tl.arange(0, BLOCK)
            tl.store(logits_dst_ptr + i, tl.load(logits_src_ptr + i, mask=i < n_logits, other=0), mask=i < n_logits)


def search_halvings(n_tokens: int, n_reqs: int) -> int:
    """The input kernel's bisection steps (``n_iter``): enough to find each token's request."""
    return (min(n_reqs, n_tokens - n_reqs + 1) - 1).bit_length() if n_reqs else 0


def _check_commit_lengths(commit_lengths: bool, by_row: bool, n_tokens: int, rows) -> None:
    """``commit_lengths`` writes each row's ``num_computed``: it must be what the starts are
    read from, and each row's only token must read it (no other lane of the launch does)."""
    if commit_lengths and (not by_row or n_tokens != rows.shape[0]):
        raise ValueError("prepare_inputs commit_lengths: needs num_computed and one token a request")


def prepare_inputs_triton(
    starts,
    rows,
    qsl,
    n_tokens: int,
    q_lens,
    capacity,
    token_ids,
    block_table,
    block_size: int,
    block: int = 256,
    out=None,
    num_computed=None,
    pad=None,
    commit_lengths: bool = False,
    place: Placement | None = None,
):
    """Returns ``(positions int64 [T], input_ids int64 [T], seq_lens int32 [R],
    slot_mapping int64 [T], query_start_loc int32 [R + 1])``; see the reference. ``out``
    gives the first four (contiguous, those shapes and dtypes) to write into. ``starts``
    None: request ``r`` starts at ``num_computed[rows[r]]``. ``qsl`` (the requests' query
    starts, [R + 1]) must be strictly increasing: every request has a token. ``pad`` (a
    ``GraphPad``, with ``out`` a graph's static inputs): the query starts are written into
    ``pad.qsl`` and the same launch pads the step to the graph's bucket (slots ``T ..
    pad.tokens - 1`` of ``out``'s slot buffer, which must hold them, get -1, query starts
    ``R + 1 .. pad.reqs`` get T; with ``pad.seq_rows``, ``seq_lens`` entries ``R ..
    pad.seq_rows - 1`` of ``out``'s buffer, which must hold them, get ``pad.seq_len``) and
    makes ``pad``'s copies. ``commit_lengths`` (with ``num_computed``, one token a request):
    each row's ``num_computed`` becomes its new length in the same launch. ``place`` (with
    ``num_computed``, not with ``commit_lengths``): the same launch places new requests, as
    ``kernels.place`` would have before it (extra programs after the input programs)."""
    by_row = starts is None
    if by_row:
        if num_computed is None:
            raise ValueError("prepare_inputs: give starts or num_computed")
        starts = num_computed
    _check_commit_lengths(commit_lengths, by_row, n_tokens, rows)
    n_reqs = rows.shape[0]
    pl = placement_args(place, by_row, commit_lengths, n_reqs, qsl)
    dev = qsl.device
    if qsl.shape != (n_reqs + 1,):
        raise ValueError(f"prepare_inputs: qsl of {n_reqs} requests has shape {tuple(qsl.shape)}")
    if out is not None:
        positions, input_ids, seq_lens, slots = out
        for t, n, dt in (
            (positions, n_tokens, torch.int64),
            (input_ids, n_tokens, torch.int64),
            (seq_lens, n_reqs, torch.int32),
            (slots, n_tokens, torch.int64),
        ):
            if t.shape != (n,) or t.dtype != dt or t.stride(0) != 1:
                raise ValueError(
                    f"prepare_inputs out: want a contiguous [{n}] {dt}, got "
                    f"{tuple(t.shape)} {t.dtype} stride {t.stride()}"
                )
    else:
        positions = torch.empty(n_tokens, dtype=torch.int64, device=dev)
        input_ids = torch.empty(n_tokens, dtype=torch.int64, device=dev)
        slots = torch.empty(n_tokens, dtype=torch.int64, device=dev)
        seq_lens = torch.empty(n_reqs, dtype=torch.int32, device=dev)
    pad_tokens = pad_reqs = n_logits = pad_seq_rows = pad_seq_len = 0
    bt_dst = li_src = li_dst = None
    if pad is not None:
        pad_tokens, pad_reqs, bt_dst = pad.tokens, pad.reqs, pad.block_table
        pad_seq_rows, pad_seq_len = max(pad.seq_rows, n_reqs), pad.seq_len
        li_src, li_dst = pad.logits_src, pad.logits_dst
        if out is None or pad.qsl.dtype != torch.int32 or pad.qsl.shape[0] < pad_reqs + 1 or pad_reqs < n_reqs:
            raise ValueError("prepare_inputs pad: needs out, an int32 qsl of reqs + 1 and reqs >= R")
        if bt_dst is not None and (
            bt_dst.dtype != torch.int32 or bt_dst.shape[0] < n_reqs or bt_dst.shape[1] < block_table.shape[1]
        ):
            raise ValueError("prepare_inputs pad: the graph's block table is too small for the step's")
        if li_src is not None:
            n_logits = li_src.shape[0]
            if li_dst.shape[0] < n_logits or li_dst.dtype != li_src.dtype:
                raise ValueError("prepare_inputs pad: the graph's sampled-token indices are too few")
        qsl_out = pad.qsl[: n_reqs + 1]
    else:
        qsl_out = torch.empty(n_reqs + 1, dtype=torch.int32, device=dev)
    if n_tokens == 0:
        if pad is not None:  # a graph replay would write KV through the previous step's slots
            raise ValueError("prepare_inputs pad: a step padded to a graph bucket needs tokens")
        if place is not None:  # (no input program to launch: placed on their own)
            place_staged(place, token_ids, num_computed)
        qsl_out.zero_()
        return positions, input_ids, seq_lens, slots, qsl_out
    assert token_ids.stride(-1) == 1 and block_table.stride(-1) == 1
    n_in = triton.cdiv(max(n_tokens, pad_tokens), block)
    _prepare_inputs_kernel[(n_in + (1 + triton.cdiv(place.n_tok, block) if place is not None else 0),)](
        qsl,  # (no header)
        starts,
        rows,
        qsl,
        q_lens,
        capacity,
        token_ids,
        block_table,
        positions,
        input_ids,
        seq_lens,
        slots,
        qsl_out,
        n_tokens,
        n_reqs,
        search_halvings(n_tokens, n_reqs),
        block_table.shape[1],
        token_ids.stride(0),
        block_table.stride(0),
        token_ids.shape[1] - 1,
        pad_tokens,
        pad_reqs,
        bt_dst if bt_dst is not None else block_table,
        bt_dst.stride(0) if bt_dst is not None else 0,
        li_src if li_src is not None else slots,
        li_dst if li_dst is not None else slots,
        n_logits,
        pad_seq_rows,
        pad_seq_len,
        n_in,
        *pl,
        KV_BLOCK_SIZE=block_size,
        BLOCK=block,
        STARTS_BY_ROW=by_row,
        COPY_TABLE=bt_dst is not None,
        COPY_LOGITS=n_logits > 0,
        COMMIT_LENGTHS=commit_lengths,
        PLACE=place is not None,
        WORDS=place.option_table.shape[0] if place is not None else 1,
        num_warps=4,
        **pdl.launch_kwargs(qsl),
    )
    return positions, input_ids, seq_lens, slots, qsl_out


def prepare_inputs(
    starts,
    rows,
    qsl,
    n_tokens: int,
    q_lens,
    capacity,
    token_ids,
    block_table,
    block_size: int,
    every_request_has_tokens: bool = True,
    out=None,
    num_computed=None,
    pad=None,
    commit_lengths: bool = False,
    place: Placement | None = None,
):
    """A step's device-derived inputs (``kernels.reference.prepare_inputs_reference``):
    one Triton launch on CUDA instead of about twenty torch launches. ``qsl``: the requests'
    query starts (int64 [R + 1]), ``n_tokens`` its last entry as a host int (no device read).
    The kernel finds each token's request by a binary search over ``qsl`` and derives each
    request's ``seq_len`` and query start from its tokens, so a request without query
    tokens (``every_request_has_tokens=False``, a host-known fact) takes the reference.
    ``out``: (positions, input_ids, seq_lens, slot_mapping) to write into (a CUDA graph's
    static inputs, so a replay needs no copies); the results are those tensors.
    ``starts`` None: each request starts at ``num_computed[rows[r]]`` (read by the kernel,
    no gather launch). ``pad``: see ``prepare_inputs_triton`` (the query starts land in the
    graph's buffer and the step is padded to its bucket: no separate copy or fills).
    ``commit_lengths``: see there (the step's ``num_computed`` update, in the same launch).
    ``place``: new requests placed first (see there; in the same launch on CUDA)."""
    if qsl.is_cuda and every_request_has_tokens:
        return prepare_inputs_triton(
            starts,
            rows,
            qsl,
            n_tokens,
            q_lens,
            capacity,
            token_ids,
            block_table,
            block_size,
            out=out,
            num_computed=num_computed,
            pad=pad,
            commit_lengths=commit_lengths,
            place=place,
        )
    if place is not None:
        place_staged(place, token_ids, num_computed)
    _check_commit_lengths(commit_lengths, starts is None, n_tokens, rows)
    if starts is None:
        starts = num_computed[rows]
    res = reference.prepare_inputs_reference(
        starts, rows, qsl, n_tokens, q_lens, capacity, token_ids, block_table, block_size
    )
    if commit_lengths:
        num_computed[rows] = res[2]
    if out is None:
        return res
    for dst, src in zip(out, res):
        dst.copy_(src)
    if pad is None:
        return (*out, res[4])
    n_reqs = rows.shape[0]
    pad.qsl[: n_reqs + 1].copy_(res[4])
    pad.qsl[n_reqs + 1 : pad.reqs + 1].fill_(n_tokens)
    out[3].as_strided((pad.tokens,), (1,))[n_tokens:].fill_(-1)  # (the slot buffer holds the padding)
    if pad.seq_rows > n_reqs:  # (as does the seq_lens buffer)
        out[2].as_strided((pad.seq_rows,), (1,))[n_reqs:].fill_(pad.seq_len)
    if pad.block_table is not None:
        pad.block_table[:n_reqs, : block_table.shape[1]].copy_(block_table)
    if pad.logits_src is not None:
        pad.logits_dst[: pad.logits_src.shape[0]].copy_(pad.logits_src)
    return (*out, pad.qsl[: n_reqs + 1])
