"""The draft model's lookahead loop in two launches a step: its next token per row (instead of
some fifteen launches) and the next step's inputs (instead of some twenty).

A greedy row takes the argmax of its draft logits (lowest id among the maxima, as torch).
With ``draft_probs`` given, a row with temperature ``T > 0`` draws from
``p = softmax(logits / T)`` by the seeded exponential race of ``kernels.sampling`` on the
draft stream and stores ``p`` at ``draft_probs[rows[r], slot]``: the verification needs the
draft's distribution. The token also goes into the token table, where the next step reads
it. Rows with top-k / top-p / min-p take the torch path (``workers.spec_proposers``).
``kernels.reference.draft_sample_reference`` is the oracle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import STREAM_DRAFT
from kernels.sampling import _exp_noise, _hash_key, _row_stats, _running_best
from kernels.fast_launch import fast_launch

_DRAFT = tl.constexpr(STREAM_DRAFT)  # (a jit global must be a constexpr)


# The vocabulary and the logits and draft-probability strides are specialised (a multiple of
# 16 gives aligned rows and tile masks: vectorised loads); every other int is not.
@fast_launch
@triton.jit(
    do_not_specialize=["slot", "stride_t", "max_col"],
    do_not_specialize_on_alignment=["temp_ptr", "seeds_ptr", "pos_ptr", "rows_ptr", "known_ptr"],
)
def _draft_sample_kernel(
    logits_ptr,
    temp_ptr,
    seeds_ptr,
    pos_ptr,
    q_ptr,
    rows_ptr,
    table_ptr,
    known_ptr,
    out_ptr,
    vocab,
    stride_l,
    stride_qr,
    stride_qk,
    slot,
    stride_t,
    max_col,
    SAMPLED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    row = logits_ptr + r * stride_l
    offs = tl.arange(0, BLOCK)
    t = tl.load(temp_ptr + r).to(tl.float32) if SAMPLED else 0.0
    tok, m, s = _row_stats(row, vocab, t, False, BLOCK)
    if t > 0:
        q_row = q_ptr + tl.load(rows_ptr + r).to(tl.int64) * stride_qr + slot * stride_qk
        key = _hash_key(tl.load(seeds_ptr + r).to(tl.int64) ^ _DRAFT, tl.load(pos_ptr + r).to(tl.int64))
        key7 = key >> 7
        top = tl.full((), -1.0, tl.float32)
        for start in range(0, vocab, BLOCK):
            ids = start + offs
            ok = ids < vocab
            x = tl.load(row + ids, mask=ok, other=float("-inf")).to(tl.float32)
            p = tl.where(ok, tl.math.div_rn(tl.exp(tl.math.div_rn(x, t) - m), s), 0.0)
            tl.store(q_row + ids, p, mask=ok)
            score = tl.where(ok, tl.math.div_rn(p, _exp_noise(key, key7, ids)), -1.0)
            top, tok = _running_best(score, ids, top, tok)  # (the first tile replaces the argmax)
    tl.store(out_ptr + r, tok)
    col = tl.load(known_ptr + r).to(tl.int64) + slot
    if col <= max_col:  # past the table's last column: not written
        tl.store(table_ptr + tl.load(rows_ptr + r).to(tl.int64) * stride_t + col, tok)


def draft_sample_triton(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    draft_probs: torch.Tensor | None,
    rows: torch.Tensor,
    slot: int,
    table: torch.Tensor,
    known: torch.Tensor,
    block: int = 2048,
) -> torch.Tensor:
    """int64 [n]: each row's draft token (see the module docstring), also written into
    ``table[rows, known + slot]`` (int64; none past its last column), where the next step
    reads its inputs. ``draft_probs`` None: every row greedy. Else ``draft_probs
    [rows_total, k, V]`` (float32) receives the sampled rows' distributions at ``[rows, slot]``."""
    n, vocab = logits.shape
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    sampled = draft_probs is not None
    if (sampled and draft_probs.stride(-1) != 1) or table.stride(-1) != 1:
        raise ValueError("draft_probs and the token table must have unit stride along a row")
    q = draft_probs if sampled else logits
    # the kernel indexes these as dense rows (no copy when they already are)
    temperature, seeds, positions = temperature.contiguous(), seeds.contiguous(), positions.contiguous()
    rows, known = rows.contiguous(), known.contiguous()
    _draft_sample_kernel[(n,)](
        logits,
        temperature,
        seeds,
        positions,
        q,
        rows,
        table,
        known,
        out,
        vocab,
        logits.stride(0),
        q.stride(0) if sampled else 0,
        q.stride(1) if sampled else 0,
        slot,
        table.stride(0),
        table.shape[1] - 1,
        SAMPLED=sampled,
        BLOCK=block,
        num_warps=8 if block >= 2048 else 4,
    )
    return out


@fast_launch
@triton.jit(
    do_not_specialize=["n", "stride_bt", "n_blk", "max_position"],
    do_not_specialize_on_alignment=["tok_ptr", "pos_ptr", "bt_ptr", "cap_ptr"],
)
def _draft_inputs_kernel(
    tok_ptr,
    pos_ptr,
    bt_ptr,
    cap_ptr,
    pos_out_ptr,
    ids_out_ptr,
    seq_out_ptr,
    slot_out_ptr,
    n,
    stride_bt,
    n_blk,
    max_position,
    BS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    pos = tl.load(pos_ptr + offs, mask=ok, other=0).to(tl.int64)
    page = tl.minimum(pos // BS, n_blk - 1)
    blk = tl.load(bt_ptr + offs.to(tl.int64) * stride_bt + page, mask=ok, other=0).to(tl.int64)
    cap = tl.load(cap_ptr + offs, mask=ok, other=0).to(tl.int64)
    tl.store(pos_out_ptr + offs, pos, mask=ok)
    tl.store(ids_out_ptr + offs, tl.load(tok_ptr + offs, mask=ok, other=0), mask=ok)
    tl.store(seq_out_ptr + offs, (pos + 1).to(tl.int32), mask=ok)
    tl.store(slot_out_ptr + offs, tl.where(pos < cap, blk * BS + pos % BS, -1), mask=ok)
    tl.store(pos_ptr + offs, tl.minimum(pos + 1, max_position), mask=ok)


def draft_step_inputs_triton(tokens, pos, block_table, capacity, block_size: int, max_position: int, out) -> None:
    """One decode step of the draft model's lookahead loop, in one launch: ``out = (positions,
    input_ids, seq_lens, slot_mapping)`` (e.g. a CUDA graph's static inputs) of ``tokens`` at
    ``pos`` (KV slot -1 at or past ``capacity``), then ``pos`` advances in place (clamped to
    ``max_position``). ``kernels.reference.draft_step_inputs_reference`` is the oracle."""
    n = pos.shape[0]
    if n == 0:
        return
    positions, input_ids, seq_lens, slots = out
    _draft_inputs_kernel[(triton.cdiv(n, 128),)](
        tokens,
        pos,
        block_table,
        capacity,
        positions,
        input_ids,
        seq_lens,
        slots,
        n,
        block_table.stride(0),
        block_table.shape[1],
        max_position,
        BS=block_size,
        BLOCK=128,
        num_warps=4,
    )
