"""Triton row-wise argmax of logits (greedy decoding), with ``torch.argmax``'s answer.

``torch.argmax`` over one [1, 128k] float32 row runs as a single-block reduction
(tens of microseconds, more than a whole decode layer's attention). Here the
vocabulary is split over many programs, each keeping its split's best value and
lowest index, and a second launch reduces the splits: two short launches.

Semantics match ``torch.argmax(dim=-1)`` exactly: the lowest index among equal
maxima, a NaN counts as larger than everything (the first NaN wins), and a row of
all ``-inf`` gives 0. The torch reference is ``torch.argmax`` itself.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.pdl import wait_and_release
from kernels.sampling import MAX_SPLITS, vocab_splits
from kernels.fast_launch import fast_launch

BIG = tl.constexpr(2147483647)  # "no index" (a jit global must be a constexpr)


@fast_launch
@triton.jit(do_not_specialize=["vocab", "stride_x", "per_split", "num_splits"])
def _argmax_partial_kernel(
    x_ptr,
    best_ptr,
    idx_ptr,
    nan_ptr,
    vocab,
    stride_x,
    per_split,
    num_splits,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    wait_and_release(USE_PDL)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, vocab)
    best = tl.full((), float("-inf"), tl.float32)
    best_i = tl.full((), BIG, tl.int32)
    nan_i = tl.full((), BIG, tl.int32)
    for start in range(lo, hi, BLOCK):
        ids = start + tl.arange(0, BLOCK)
        mask = ids < hi
        v = tl.load(x_ptr + row * stride_x + ids, mask=mask, other=float("-inf")).to(tl.float32)
        is_nan = v != v
        nan_i = tl.minimum(nan_i, tl.min(tl.where(is_nan & mask, ids, BIG), axis=0))
        v = tl.where(is_nan, float("-inf"), v)
        m = tl.max(v, axis=0)
        i = tl.min(tl.where(mask & (v == m), ids, BIG), axis=0)
        # strictly better, or the split's first tile (so an all -inf split reports its lo)
        take = (m > best) | (best_i == BIG)
        best_i = tl.where(take, i, best_i)
        best = tl.where(take, m, best)
    tl.store(best_ptr + row * num_splits + split, best)
    tl.store(idx_ptr + row * num_splits + split, best_i)
    tl.store(nan_ptr + row * num_splits + split, nan_i)


@fast_launch
@triton.jit(do_not_specialize=["num_splits"])
def _argmax_reduce_kernel(
    best_ptr, idx_ptr, nan_ptr, out_ptr, num_splits, SPLITS: tl.constexpr, USE_PDL: tl.constexpr = False
):
    row = tl.program_id(0).to(tl.int64)
    wait_and_release(USE_PDL)
    s = tl.arange(0, SPLITS)
    mask = s < num_splits
    b = tl.load(best_ptr + row * num_splits + s, mask=mask, other=float("-inf"))
    i = tl.load(idx_ptr + row * num_splits + s, mask=mask, other=BIG)
    n = tl.min(tl.load(nan_ptr + row * num_splits + s, mask=mask, other=BIG), axis=0)
    m = tl.max(b, axis=0)
    first = tl.min(tl.where(mask & (b == m), i, BIG), axis=0)
    tl.store(out_ptr + row, tl.where(n < BIG, n, first).to(tl.int64))


def argmax_triton(x: torch.Tensor, block: int = 2048, num_splits: int | None = None) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for a 2-D ``x`` (any float dtype); int64 [rows]."""
    assert x.dim() == 2, "argmax_triton takes [rows, vocab]"
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    if vocab == 0:
        raise ValueError("argmax of an empty row")
    if x.stride(-1) != 1:
        x = x.contiguous()
    per_split, num_splits = vocab_splits(x, block, num_splits)
    best = torch.empty(rows, num_splits, dtype=torch.float32, device=x.device)
    idx = torch.empty(rows, num_splits, dtype=torch.int32, device=x.device)
    nan = torch.empty(rows, num_splits, dtype=torch.int32, device=x.device)
    launch = pdl.launch_kwargs(x)  # one PDL decision for both launches
    _argmax_partial_kernel[(rows, num_splits)](
        x,
        best,
        idx,
        nan,
        vocab,
        x.stride(0),
        per_split,
        num_splits,
        BLOCK=block,
        num_warps=8 if block >= 2048 else 4,
        **launch,
    )
    _argmax_reduce_kernel[(rows,)](best, idx, nan, out, num_splits, SPLITS=MAX_SPLITS, **launch)
    return out
