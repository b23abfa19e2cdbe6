"""Triton exponential race: one seeded draw per row of ``probs`` in one read of it.

The torch reference (``kernels.reference.exponential_race_reference``) builds the
[rows, vocab] noise tensor with some twenty int64 element-wise passes before the
``argmax``: at 256 rows x 152k tokens that is over 10 GB of memory traffic per
step, more than the decode step itself. Here each program hashes its tile's
noise in registers (the same 32-bit hash, in uint32 arithmetic, so the same U
bit for bit), scores ``p / -log U`` and keeps the tile's best; a second launch
reduces the per-split winners. The vocabulary is split so that small batches
still fill the GPU. Ties go to the lowest token id, as in ``torch.argmax``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.pdl import wait_and_release
from kernels.fast_launch import fast_launch


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x2C1B3C6D
    x = x ^ (x >> 16)
    return x


@triton.jit
def _hash_key(seed, pos):
    """``kernels.reference.noise_row_key`` of an int64 (seed, position), in registers."""
    s = seed.to(tl.uint64, bitcast=True)
    key = _mix32((s & 0xFFFFFFFF).to(tl.uint32) ^ _mix32((s >> 32).to(tl.uint32) ^ 0x9E3779B9))
    return _mix32(key ^ (pos.to(tl.uint64, bitcast=True) & 0xFFFFFFFF).to(tl.uint32))


@triton.jit
def _exp_noise(key, key7, ids):
    """E = -log U of token ``ids`` under a row's hash ``key`` (``key7 = key >> 7``), as
    ``kernels.reference.exponential_noise``: U = (k + 0.5) / 2^24 exactly in float64 (never
    1.0) and -log U in float64 (a float32 log with absolute error, as GPUs approximate it, is
    far off in relative terms as U -> 1, where the winners are)."""
    h = _mix32(_mix32(key ^ ids.to(tl.uint32)) ^ key7)
    return (0.0 - tl.log(((h >> 8).to(tl.float64) + 0.5) * (1.0 / 16777216.0))).to(tl.float32)


@triton.jit
def _running_best(score, ids, best, best_i):
    """One tile folded into a running ``(max, argmax)``; ties go to the lowest id (as torch)."""
    m = tl.max(score, axis=0)
    i = tl.min(tl.where(score == m, ids, 2147483647), axis=0).to(tl.int64)
    return tl.maximum(best, m), tl.where(m > best, i, best_i)


@triton.jit
def _softmax_fold(x, t, m, s):
    """One tile of logits ``x`` folded into ``softmax(x / t)``'s running max ``m`` and sum ``s``."""
    z = tl.math.div_rn(x, t)
    m_new = tl.maximum(m, tl.max(z, axis=0))
    return m_new, s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)


@triton.jit
def _row_stats(row, vocab, t, PROBS: tl.constexpr, BLOCK: tl.constexpr):
    """One pass over a row of logits (``PROBS``: of unnormalised probabilities): its argmax
    (lowest id among the maxima) and its normaliser, ``softmax(x / t)``'s running max and sum
    when ``t > 0`` (``PROBS``: the plain sum, max unused). Returns ``(argmax, max, sum)``."""
    offs = tl.arange(0, BLOCK)
    best = tl.full((), float("-inf"), tl.float32)
    best_i = tl.full((), 0, tl.int64)
    m = tl.full((), -3.0e38, tl.float32)
    s = tl.full((), 0.0, tl.float32)
    for start in range(0, vocab, BLOCK):
        ids = start + offs
        ok = ids < vocab
        x = tl.load(row + ids, mask=ok, other=float("-inf")).to(tl.float32)
        best, best_i = _running_best(x, ids, best, best_i)
        if PROBS:
            s += tl.sum(tl.where(ok, x, 0.0), axis=0)
        elif t > 0:
            m, s = _softmax_fold(x, t, m, s)
    return best_i, m, s


# Sizes are not specialised on, so one compile serves every batch and vocabulary.
@triton.jit
def _row_key(seed_ptr, pos_ptr, row):
    """``kernels.reference.noise_row_key`` of one row, in registers: computing it here
    instead of in torch saves some twenty tiny launches a call (a step must stay far below
    the device's launch-queue depth, or its launch waits for the device)."""
    return _hash_key(tl.load(seed_ptr + row).to(tl.int64), tl.load(pos_ptr + row).to(tl.int64))


# The seed and position rows are often views into a stacked [3, rows] tensor, whose offset is
# 16-byte aligned only for an even row count: specialising on it would compile a variant mid-serving.
@fast_launch
@triton.jit(
    do_not_specialize=["vocab", "stride_p", "per_split", "num_splits"],
    do_not_specialize_on_alignment=["seed_ptr", "pos_ptr"],
)
def _race_partial_kernel(
    probs_ptr,
    seed_ptr,
    pos_ptr,
    best_ptr,
    idx_ptr,
    vocab,
    stride_p,
    per_split,
    num_splits,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    wait_and_release(USE_PDL)
    key = _row_key(seed_ptr, pos_ptr, row)
    key7 = key >> 7
    lo = split * per_split
    hi = tl.minimum(lo + per_split, vocab)
    best = tl.full((), -1.0, tl.float32)
    best_i = tl.full((), 0, tl.int32)
    for start in range(lo, hi, BLOCK):
        ids = start + tl.arange(0, BLOCK)
        mask = ids < hi
        p = tl.load(probs_ptr + row * stride_p + ids, mask=mask, other=0.0).to(tl.float32)
        e = _exp_noise(key, key7, ids)
        score = tl.where(mask, tl.math.div_rn(p, e), -1.0)  # IEEE division, as torch's
        m = tl.max(score, axis=0)
        i = tl.min(tl.where(score == m, ids, 2147483647), axis=0)  # lowest id among the tile's best
        better = m > best
        best_i = tl.where(better, i, best_i)
        best = tl.where(better, m, best)
    tl.store(best_ptr + row * num_splits + split, best)
    tl.store(idx_ptr + row * num_splits + split, best_i)


MAX_SPLITS = 64


@fast_launch
@triton.jit(do_not_specialize=["num_splits"])
def _race_reduce_kernel(best_ptr, idx_ptr, out_ptr, num_splits, SPLITS: tl.constexpr, USE_PDL: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    wait_and_release(USE_PDL)
    s = tl.arange(0, SPLITS)
    mask = s < num_splits
    b = tl.load(best_ptr + row * num_splits + s, mask=mask, other=-2.0)
    i = tl.load(idx_ptr + row * num_splits + s, mask=mask, other=2147483647)
    m = tl.max(b, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(b == m, i, 2147483647), axis=0).to(tl.int64))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int | None) -> int:
    """The device's SM count (``get_device_properties`` costs microseconds a call)."""
    return torch.cuda.get_device_properties(
        index if index is not None else torch.cuda.current_device()
    ).multi_processor_count


def vocab_splits(x: torch.Tensor, block: int, num_splits: int | None) -> tuple[int, int]:
    """``(per_split, num_splits)`` for a row-wise reduction of ``x [rows, vocab]`` split over
    the vocabulary: about four programs per SM over all rows, none tinier than one tile
    (``num_splits`` overrides, 1..MAX_SPLITS); ``per_split`` is a multiple of ``block``."""
    rows, vocab = x.shape
    if num_splits is None:
        sms = _sm_count(x.device.index) if x.is_cuda else 4
        num_splits = max(1, min(triton.cdiv(vocab, block), triton.cdiv(4 * sms, rows), MAX_SPLITS))
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")
    per_split = triton.cdiv(triton.cdiv(vocab, num_splits), block) * block
    return per_split, triton.cdiv(vocab, per_split)


def exponential_race_triton(
    probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, block: int = 2048, num_splits: int | None = None
) -> torch.Tensor:
    """``argmax_j probs[r, j] / -log U(seed_r, pos_r, j)`` per row; int64 [rows]."""
    rows, vocab = probs.shape
    out = torch.empty(rows, dtype=torch.int64, device=probs.device)
    if rows == 0:
        return out
    if probs.stride(-1) != 1:
        probs = probs.contiguous()
    per_split, num_splits = vocab_splits(probs, block, num_splits)
    best = torch.empty(rows, num_splits, dtype=torch.float32, device=probs.device)
    idx = torch.empty(rows, num_splits, dtype=torch.int32, device=probs.device)
    launch = pdl.launch_kwargs(probs)  # one PDL decision for both launches
    _race_partial_kernel[(rows, num_splits)](
        probs,
        seeds,
        positions,
        best,
        idx,
        vocab,
        probs.stride(0),
        per_split,
        num_splits,
        BLOCK=block,
        num_warps=8 if block >= 2048 else 4,
        **launch,
    )
    _race_reduce_kernel[(rows,)](best, idx, out, num_splits, SPLITS=MAX_SPLITS, **launch)
    return out
