"""Prompt-lookup (n-gram) drafts in one Triton launch, written where the next step reads them.

``ngram_propose_triton(token_ids, rows, known, width, k, n_min, n_max)`` is
``kernels.reference.ngram_drafts_reference`` followed by the draft write: for each row
``r`` (device row ``rows[r]``, ``known[r]`` tokens on the device) the latest earlier
occurrence of the row's last ``n`` tokens (longest ``n`` first, ``n_max`` down to ``n_min``)
is continued for ``k`` tokens (never past the row's last known token); a row without a
match proposes its last token repeated. The drafts land at ``known .. known + k - 1``
(those past the table's last column are dropped).

In torch that is about 40 small launches per ``n`` (unfold, compare, reduce, gather,
where ...); one program a row does it here. No host syncs; ``width`` (the host's bound on
every ``known``), ``n_min`` and ``n_max`` are runtime arguments and the grid is the row
count, so one compilation serves every step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from kernels.fast_launch import fast_launch

MAX_N = 16  # the longest n-gram the kernel matches (the option's range is checked in config)


@fast_launch
@triton.jit(do_not_specialize=["width", "n_min", "n_max", "max_col", "stride_t"])
def _ngram_kernel(
    tok_ptr,
    rows_ptr,
    known_ptr,
    stride_t,
    width,
    max_col,
    n_min,
    n_max,
    K: tl.constexpr,
    N_CAP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    row = tl.load(rows_ptr + r).to(tl.int64)
    known = tl.load(known_ptr + r).to(tl.int64)
    base = tok_ptr + row * stride_t
    last = tl.load(base + tl.maximum(known - 1, 0))
    best_start = known * 0 - 1
    best_n = known * 0
    offs = tl.arange(0, BLOCK)
    for t in range(0, n_max - n_min + 1):
        n = n_max - t
        found = known * 0 - 1
        if (n < width) & (best_n == 0):
            for b in range(0, width, BLOCK):
                p = (b + offs).to(tl.int64)
                m = (p + n < known) & (p + n <= width)  # a continuation exists; inside the window
                for i in tl.static_range(N_CAP):
                    in_gram = (p * 0 + i) < n  # (a vector: a constexpr i against a runtime n)
                    # the suffix token (an index past the gram is clamped to a known token)
                    s_i = tl.load(base + tl.maximum(tl.minimum(known - n + i, known - 1), 0))
                    a = tl.load(base + p + i, mask=m & in_gram, other=0)
                    m = m & ((a == s_i) | ~in_gram)
                found = tl.maximum(found, tl.max(tl.where(m, p, -1), 0))
        take = (found >= 0) & (best_n == 0)
        best_start = tl.where(take, found, best_start)
        best_n = tl.where(take, n, best_n)
    for j in tl.static_range(K):
        idx = tl.maximum(tl.minimum(best_start + best_n + j, known - 1), 0)
        tok = tl.load(base + idx)
        tok = tl.where(best_n > 0, tok, last)
        if known + j <= max_col:  # past the table's last column: not written
            tl.store(base + known + j, tok)


def ngram_propose_triton(
    token_ids: torch.Tensor, rows: torch.Tensor, known: torch.Tensor, width: int, k: int, n_min: int, n_max: int
) -> None:
    """Writes each row's ``k`` drafts into ``token_ids [rows_total, L]`` (int64) at
    ``known .. known + k - 1``; ``width``: a host bound on every ``known`` (columns searched)."""
    if not 1 <= n_min <= n_max <= MAX_N:
        raise ValueError(f"n-gram lengths must satisfy 1 <= n_min <= n_max <= {MAX_N}, got {n_min}, {n_max}")
    if token_ids.dtype != torch.int64 or token_ids.stride(-1) != 1:
        raise ValueError("ngram drafts: token_ids must be int64 with unit stride along a row")
    if rows.numel() == 0 or k == 0:
        return
    _ngram_kernel[(rows.numel(),)](
        token_ids,
        rows,
        known,
        token_ids.stride(0),
        int(width),
        token_ids.shape[1] - 1,
        int(n_min),
        int(n_max),
        K=k,
        N_CAP=triton.next_power_of_2(n_max),
        BLOCK=256,
        num_warps=4,
    )
