"""Speculative verification and its commit in two Triton launches (instead of some fifty).

``verify_slots_triton`` decides every draft slot at once, one program a (row, slot):

* a greedy row (temperature 0) accepts iff the target's argmax is the draft and otherwise
  recovers that argmax;
* a sampled row (temperature only: top-k / top-p / min-p rows take the torch path) accepts
  with probability ``min(1, p(d) / q(d))``, ``p = softmax(logits / T)`` and ``q`` the draft
  model's distribution or a point mass on the draft; on rejection it recovers a seeded draw
  from ``norm(max(0, p - q))`` (``p`` if that is empty).

A program per row can also sample the row's bonus token (``bonus_idx``), as
``workers.sampler.sample`` would without penalties or logprobs (the same draw; on a GPU the
softmax rounds differently, so a near-tie may go the other way): the verify step then needs
no separate sampler launches.

The draws use the counter hash of ``kernels.sampling`` on the rejection sampler's streams,
so the results are those of ``kernels.reference.verify_slots_reference`` (up to float
rounding of the softmax). ``accept_commit_triton`` then keeps each row's leading accepted
drafts plus its recovered (or bonus) token, writes them into the token table where the next
step reads its inputs, advances ``num_computed``, counts them for penalties and returns each
row's known length for the proposer: device values the host never reads.

Row counts and the draft count ``K`` are runtime arguments: one compilation serves every step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import STREAM_ACCEPT, STREAM_RECOVER
from kernels.sampling import _exp_noise, _hash_key, _mix32, _row_stats, _running_best
from kernels.fast_launch import fast_launch

_ACCEPT = tl.constexpr(STREAM_ACCEPT)  # (a jit global must be a constexpr)
_RECOVER = tl.constexpr(STREAM_RECOVER)

_SMALL = ["seeds_ptr", "pos_ptr", "temp_ptr", "nd_ptr", "spec_idx_ptr", "draft_idx_ptr", "ids_ptr", "q_rows_ptr"]
_SMALL += ["bonus_idx_ptr"]


# The vocabulary and the logits and draft-probability strides are specialised (a multiple of
# 16 gives aligned rows and tile masks: vectorised loads); every other int is not.
@fast_launch
@triton.jit(do_not_specialize=["K"], do_not_specialize_on_alignment=_SMALL)
def _verify_slots_kernel(
    logits_ptr,
    spec_idx_ptr,
    ids_ptr,
    draft_idx_ptr,
    nd_ptr,
    temp_ptr,
    seeds_ptr,
    pos_ptr,
    q_ptr,
    q_rows_ptr,
    bonus_idx_ptr,
    accept_ptr,
    recovered_ptr,
    bonus_ptr,
    vocab,
    K,
    stride_l,
    stride_qr,
    stride_qk,
    HAS_Q: tl.constexpr,
    PROBS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64)  # a draft slot, or K: the row's bonus token
    nd = tl.load(nd_ptr + r).to(tl.int64)
    bonus = j == K
    acc = tl.full((), 0, tl.int32)
    rec = tl.full((), 0, tl.int64)
    if (j < nd) | bonus:
        if bonus:
            row = logits_ptr + tl.load(bonus_idx_ptr + r).to(tl.int64) * stride_l
            d = tl.full((), -1, tl.int64)
        else:
            row = logits_ptr + tl.load(spec_idx_ptr + r * K + j).to(tl.int64) * stride_l
            d = tl.load(ids_ptr + tl.load(draft_idx_ptr + r * K + j).to(tl.int64)).to(tl.int64)
        t = tl.load(temp_ptr + r).to(tl.float32)
        offs = tl.arange(0, BLOCK)
        best_i, m, s = _row_stats(row, vocab, t, PROBS, BLOCK)  # pass 1: argmax and normaliser
        if t > 0:
            pos = tl.load(pos_ptr + r).to(tl.int64) - tl.where(bonus, 0, nd - j)  # this token's position
            seed = tl.load(seeds_ptr + r).to(tl.int64)
            q_row = q_ptr
            if bonus:  # the ordinary sampler's draw (workers.sampler): its key, a race over p
                key = _hash_key(seed, pos)
            else:
                x_d = tl.load(row + d).to(tl.float32)
                if PROBS:
                    p_d = tl.math.div_rn(x_d, s)
                else:
                    p_d = tl.math.div_rn(tl.exp(tl.math.div_rn(x_d, t) - m), s)
                q_d = 1.0
                if HAS_Q:
                    q_row = q_ptr + tl.load(q_rows_ptr + r).to(tl.int64) * stride_qr + j * stride_qk
                    q_d = tl.load(q_row + d)
                key = _hash_key(seed ^ _ACCEPT, pos)
                xu = _mix32(_mix32(key) ^ (key >> 7))  # token id 0 of the acceptance stream
                u = (((xu >> 8).to(tl.float64) + 0.5) * (1.0 / 16777216.0)).to(tl.float32)
                acc = (u * q_d < p_d).to(tl.int32)
                key = _hash_key(seed ^ _RECOVER, pos)
            if acc == 0:  # pass 2: the recovered token, a race over the residual (or p)
                key7 = key >> 7
                best_r = tl.full((), -1.0, tl.float32)
                best_ri = tl.full((), 0, tl.int64)
                best_p = tl.full((), -1.0, tl.float32)
                best_pi = tl.full((), 0, tl.int64)
                mass = tl.full((), 0.0, tl.float32)
                for start in range(0, vocab, BLOCK):
                    ids = start + offs
                    ok = ids < vocab
                    x = tl.load(row + ids, mask=ok, other=float("-inf")).to(tl.float32)
                    if PROBS:
                        p = tl.where(ok, tl.math.div_rn(x, s), 0.0)
                    else:
                        p = tl.where(ok, tl.math.div_rn(tl.exp(tl.math.div_rn(x, t) - m), s), 0.0)
                    if HAS_Q:  # (the bonus program has no draft distribution: nothing loaded)
                        res = tl.maximum(p - tl.load(q_row + ids, mask=ids < tl.where(bonus, 0, vocab), other=0.0), 0.0)
                    else:
                        res = tl.where(ids == d, 0.0, p)
                    mass += tl.sum(res, axis=0)
                    e = _exp_noise(key, key7, ids)
                    best_r, best_ri = _running_best(tl.where(ok, tl.math.div_rn(res, e), -1.0), ids, best_r, best_ri)
                    best_p, best_pi = _running_best(tl.where(ok, tl.math.div_rn(p, e), -1.0), ids, best_p, best_pi)
                rec = tl.where((mass > 0) & ~bonus, best_ri, best_pi)
        else:
            acc = (best_i == d).to(tl.int32)
            rec = best_i
    if bonus:
        tl.store(bonus_ptr + r, rec)
    else:
        tl.store(accept_ptr + r * K + j, acc.to(tl.int8))
        tl.store(recovered_ptr + r * K + j, rec)


@fast_launch
@triton.jit(
    do_not_specialize=["K", "stride_t", "max_col", "stride_c"],
    do_not_specialize_on_alignment=["ids_ptr", "draft_idx_ptr", "nd_ptr", "bonus_ptr", "pos_ptr", "rows_ptr"],
)
def _accept_commit_kernel(
    accept_ptr,
    recovered_ptr,
    ids_ptr,
    draft_idx_ptr,
    nd_ptr,
    bonus_ptr,
    pos_ptr,
    rows_ptr,
    tok_table_ptr,
    computed_ptr,
    counts_ptr,
    tokens_ptr,
    n_acc_ptr,
    known_ptr,
    K,
    stride_t,
    max_col,
    stride_c,
    COUNT: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    nd = tl.load(nd_ptr + r).to(tl.int64)
    a = tl.full((), 0, tl.int64)
    alive = nd > 0
    for j in range(0, K):
        ok = alive & (j < nd)
        if ok:
            ok = tl.load(accept_ptr + r * K + j) != 0
        alive = ok
        a += alive.to(tl.int64)
    bonus = tl.load(bonus_ptr + r).to(tl.int64)
    last = bonus
    if a < nd:
        last = tl.load(recovered_ptr + r * K + a)
    pos0 = tl.load(pos_ptr + r).to(tl.int64) - nd  # position of the row's first new token
    row = tl.load(rows_ptr + r).to(tl.int64)
    for j in range(0, K + 1):
        tok = bonus
        if j < K:
            tok = tl.load(ids_ptr + tl.load(draft_idx_ptr + r * K + j).to(tl.int64)).to(tl.int64)
        if j == a:
            tok = last
        tl.store(tokens_ptr + r * (K + 1) + j, tok)
        if pos0 + j <= max_col:  # past the table's last column: not written
            tl.store(tok_table_ptr + row * stride_t + pos0 + j, tok)
        if COUNT:
            if j <= a:
                tl.atomic_add(counts_ptr + row * stride_c + tok, 1)
    tl.store(n_acc_ptr + r, a)
    tl.store(computed_ptr + row, (pos0 + a).to(tl.int32))  # p + 1 + accepted
    tl.store(known_ptr + r, pos0 + a + 1)


def verify_slots_triton(
    logits: torch.Tensor,
    spec_idx: torch.Tensor,
    input_ids: torch.Tensor,
    draft_idx: torch.Tensor,
    num_drafts: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    draft_rows: torch.Tensor | None = None,
    probs: bool = False,
    bonus_idx: torch.Tensor | None = None,
    block: int = 2048,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(accept int8 [R, K], recovered int64 [R, K])`` of the drafts ``input_ids[draft_idx]``
    against the target ``logits[spec_idx]`` (see the module docstring); ``positions``: each
    row's sampled position (its last draft's + 1); ``draft_probs [rows, >= K, V]`` at
    ``draft_rows``: the draft model's distributions (None: point masses). ``probs=True``:
    the rows hold (unnormalised) target probabilities instead of logits (top-k / top-p /
    min-p applied in torch); greedy rows then take their argmax. ``recovered`` is set
    where a valid slot was rejected (and for greedy rows), else 0. ``bonus_idx [R]``: also
    sample each row's bonus token from ``logits[bonus_idx]`` as ``workers.sampler.sample``
    would without penalties or logprobs (argmax, or its seeded draw at ``positions``);
    returned third (else None)."""
    R, K = spec_idx.shape
    accept = torch.empty(R, K, dtype=torch.int8, device=logits.device)
    recovered = torch.empty(R, K, dtype=torch.int64, device=logits.device)
    has_bonus = bonus_idx is not None
    if has_bonus and probs:
        raise ValueError("the bonus token is sampled from logits, not from probabilities")
    bonus = torch.empty(R, dtype=torch.int64, device=logits.device) if has_bonus else None
    if R == 0 or K + has_bonus == 0:
        return accept, recovered, bonus
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    has_q = draft_probs is not None
    if has_q and draft_probs.stride(-1) != 1:
        raise ValueError("draft_probs must have unit stride along the vocabulary")
    q = draft_probs if has_q else logits
    # the kernel indexes these as dense rows (no copy when they already are)
    spec_idx, draft_idx, num_drafts = spec_idx.contiguous(), draft_idx.contiguous(), num_drafts.contiguous()
    temperature, seeds, positions = temperature.contiguous(), seeds.contiguous(), positions.contiguous()
    draft_rows = draft_rows.contiguous() if has_q else num_drafts
    _verify_slots_kernel[(R, K + has_bonus)](
        logits,
        spec_idx,
        input_ids,
        draft_idx,
        num_drafts,
        temperature,
        seeds,
        positions,
        q,
        draft_rows,
        bonus_idx.contiguous() if has_bonus else num_drafts,
        accept,
        recovered,
        bonus if has_bonus else recovered,
        logits.shape[1],
        K,
        logits.stride(0),
        q.stride(0) if has_q else 0,
        q.stride(1) if has_q else 0,
        HAS_Q=has_q,
        PROBS=probs,
        BLOCK=block,
        num_warps=8 if block >= 2048 else 4,
    )
    return accept, recovered, bonus


def accept_commit_triton(
    accept: torch.Tensor,
    recovered: torch.Tensor,
    input_ids: torch.Tensor,
    draft_idx: torch.Tensor,
    num_drafts: torch.Tensor,
    bonus: torch.Tensor,
    positions: torch.Tensor,
    rows: torch.Tensor,
    token_table: torch.Tensor,
    num_computed: torch.Tensor,
    output_counts: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tokens int64 [R, K + 1], num_accepted int64 [R], known int64 [R])``; writes the
    tokens into ``token_table[rows]`` from each row's first new position, sets
    ``num_computed[rows]`` and counts the emitted tokens in ``output_counts`` (if given)."""
    R, K = accept.shape
    dev = accept.device
    tokens = torch.empty(R, K + 1, dtype=torch.int64, device=dev)
    n_acc = torch.empty(R, dtype=torch.int64, device=dev)
    known = torch.empty(R, dtype=torch.int64, device=dev)
    if R == 0:
        return tokens, n_acc, known
    if token_table.stride(-1) != 1 or (output_counts is not None and output_counts.stride(-1) != 1):
        raise ValueError("the token table and output counts must have unit stride along a row")
    accept, recovered, draft_idx = accept.contiguous(), recovered.contiguous(), draft_idx.contiguous()
    num_drafts, bonus, positions, rows = (
        num_drafts.contiguous(),
        bonus.contiguous(),
        positions.contiguous(),
        rows.contiguous(),
    )
    count = output_counts is not None
    counts = output_counts if count else num_computed
    _accept_commit_kernel[(R,)](
        accept,
        recovered,
        input_ids,
        draft_idx,
        num_drafts,
        bonus,
        positions,
        rows,
        token_table,
        num_computed,
        counts,
        tokens,
        n_acc,
        known,
        K,
        token_table.stride(0),
        token_table.shape[1] - 1,
        counts.stride(0) if count else 0,
        COUNT=count,
        num_warps=1,
    )
    return tokens, n_acc, known
