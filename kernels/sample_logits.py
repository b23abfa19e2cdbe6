"""Temperature sampling straight from the logits: one Triton launch per step.

A step whose sampled rows use no top-k / top-p / min-p draws ``argmax_j softmax(x / t)_j / E_j``
(``kernels.sampling``: E = -log U, U a hash of (seed, position, token id)), and greedy rows
(t = 0) take the argmax they already have. The torch composition (``kernels.reference.
sample_logits_reference``: divide, softmax, the race's two launches, compare, select, and
their allocations) cost a launch some ten host operations. Here the softmax's normaliser is
not needed at all (it scales every score of a row alike): each program takes a fixed slice
of a row's vocabulary, finds its largest ``z = x / t`` and its best ``exp(z - m) / E``; the
row's last program to finish (an arrival counter, as the split attention's fused reduce
keeps) rescales each slice's best by ``exp(m - M)`` (M the row's largest ``z``), picks the
winner (ties to the lowest token id) and writes the greedy argmax for greedy rows. (A second
launch for the pick cost about as much host time again: a Triton launch is 45-90 us of it.)

Where a step samples by temperature only, the options need not be gathered first: with
``option_rows`` the kernel reads each row's divisor, temperature and seed from the option
table at its device row, and with ``commit`` the pick also writes each token into the token
table the next step reads (the commit that was one more operator a step).

The slice size is fixed, not derived from the batch, so a row's draw is the same whatever
else is in the batch. Against the reference, ranks can differ only where two tokens' scores
agree to float32 rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.attention_splits import arrival_counters
from kernels.fast_launch import fast_launch
from kernels.pdl import wait_and_release
from kernels.sampling import _exp_noise, _hash_key, _row_key

SLICE = 16384  # vocabulary entries a program takes (a multiple of BLOCK)
BLOCK = 2048
MAX_SLICES = 64
MAX_VOCAB = MAX_SLICES * SLICE  # 1M entries (kernels.ops takes the torch path above)


@triton.jit
def _option_float(ptr, row, rows_ptr, FROM_TABLE: tl.constexpr):
    """A row's float option: ``ptr[row]``, or from an option-table word row (float32 bits in
    int64 words, ``workers.device_state.option_words``) at the row's device row."""
    if FROM_TABLE:
        value = tl.load(ptr + tl.load(rows_ptr + row)).to(tl.int32).to(tl.float32, bitcast=True)
    else:
        value = tl.load(ptr + row)
    return value


@triton.jit
def _pick(
    row, max_ptr, best_ptr, idx_ptr, temp_ptr, greedy_ptr, out_ptr, rows_ptr, pos_ptr, tok_ptr, num_slices,
    tok_stride, SLICES: tl.constexpr, FROM_TABLE: tl.constexpr, COMMIT: tl.constexpr,
):  # fmt: skip
    """Row ``row``'s winner among its slices' bests (``.cg`` loads: the other programs'
    stores, seen through L2 only)."""
    s = tl.arange(0, SLICES)
    ok = s < num_slices
    m = tl.load(max_ptr + row * num_slices + s, mask=ok, other=float("-inf"), cache_modifier=".cg")
    b = tl.load(best_ptr + row * num_slices + s, mask=ok, other=-1.0, cache_modifier=".cg")
    i = tl.load(idx_ptr + row * num_slices + s, mask=ok, other=2147483647, cache_modifier=".cg")
    top = tl.max(m, axis=0)
    score = tl.where(m > float("-inf"), b * tl.exp(m - top), -1.0)
    win = tl.max(score, axis=0)
    pick = tl.min(tl.where(score == win, i, 2147483647), axis=0).to(tl.int64)
    greedy = tl.load(greedy_ptr + row)
    token = tl.where(_option_float(temp_ptr, row, rows_ptr, FROM_TABLE) > 0, pick, greedy)
    tl.store(out_ptr + row, token)
    # the token into its row's token table at its position, where the next step's input kernel
    # reads it (that kernel waits for this grid's completion under PDL: no earlier read)
    if COMMIT:
        tl.store(tok_ptr + tl.load(rows_ptr + row) * tok_stride + tl.load(pos_ptr + row), token)


@fast_launch
@triton.jit(
    do_not_specialize=["vocab", "stride", "num_slices", "tok_stride"],
    do_not_specialize_on_alignment=[
        "seed_ptr", "pos_ptr", "div_ptr", "rows_ptr", "temp_ptr", "greedy_ptr", "tok_ptr", "count_ptr",
    ],
)  # fmt: skip
def _slice_race_kernel(
    logits_ptr,
    div_ptr,
    seed_ptr,
    pos_ptr,
    rows_ptr,
    max_ptr,
    best_ptr,
    idx_ptr,
    temp_ptr,
    greedy_ptr,
    out_ptr,
    tok_ptr,
    count_ptr,
    vocab,
    stride,
    num_slices,
    tok_stride,
    SLICE: tl.constexpr,
    BLOCK: tl.constexpr,
    SLICES: tl.constexpr,
    FROM_TABLE: tl.constexpr = False,
    COMMIT: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    sl = tl.program_id(1)
    wait_and_release(USE_PDL)
    t = _option_float(div_ptr, row, rows_ptr, FROM_TABLE)
    lo = sl * SLICE
    hi = tl.minimum(lo + SLICE, vocab)
    base = logits_ptr + row * stride
    m = tl.full((), float("-inf"), tl.float32)
    for start in range(lo, hi, BLOCK):  # the slice's largest z
        ids = start + tl.arange(0, BLOCK)
        x = tl.load(base + ids, mask=ids < hi, other=float("-inf")).to(tl.float32)
        m = tl.maximum(m, tl.max(tl.math.div_rn(x, t), axis=0))
    if FROM_TABLE:
        key = _hash_key(tl.load(seed_ptr + tl.load(rows_ptr + row)), tl.load(pos_ptr + row).to(tl.int64))
    else:
        key = _row_key(seed_ptr, pos_ptr, row)
    key7 = key >> 7
    best = tl.full((), -1.0, tl.float32)
    best_i = tl.full((), 0, tl.int32)
    if m > float("-inf"):  # (a slice of masked tokens only keeps -1: never the winner)
        for start in range(lo, hi, BLOCK):
            ids = start + tl.arange(0, BLOCK)
            ok = ids < hi
            x = tl.load(base + ids, mask=ok, other=float("-inf")).to(tl.float32)
            p = tl.exp(tl.math.div_rn(x, t) - m)
            score = tl.where(ok, tl.math.div_rn(p, _exp_noise(key, key7, ids)), -1.0)
            s = tl.max(score, axis=0)
            i = tl.min(tl.where(score == s, ids, 2147483647), axis=0)
            better = s > best
            best_i = tl.where(better, i, best_i)
            best = tl.where(better, s, best)
    tl.store(max_ptr + row * num_slices + sl, m)
    tl.store(best_ptr + row * num_slices + sl, best)
    tl.store(idx_ptr + row * num_slices + sl, best_i)
    # the row's last slice to finish picks: its slices' stores released, arrivals counted
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + row, 1, sem="acq_rel", scope="gpu")
    if arrived == num_slices - 1:
        _pick(
            row, max_ptr, best_ptr, idx_ptr, temp_ptr, greedy_ptr, out_ptr, rows_ptr, pos_ptr, tok_ptr,
            num_slices, tok_stride, SLICES, FROM_TABLE, COMMIT,
        )  # fmt: skip
        tl.atomic_xchg(count_ptr + row, 0, sem="relaxed")  # re-armed for the next launch


def sample_logits_triton(
    logits: torch.Tensor,
    divisor: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    greedy: torch.Tensor,
    slice_size: int = SLICE,
    block: int = BLOCK,
    option_rows: torch.Tensor | None = None,
    commit: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per row of ``logits [R, V]``: ``greedy`` where ``temperature`` is 0, else the seeded draw
    from ``softmax(logits / divisor)``; int64 ``[R]``. (``slice_size`` and ``block``: smaller
    for the interpreter's tests; serving keeps the defaults, fixed whatever the batch.)

    ``option_rows`` (int64 device rows [>= R]): ``divisor``, ``temperature`` and ``seeds`` are
    word rows of the option table (``DeviceState.option_table``), read at each row's device
    row, so no gather runs first. ``commit`` (the token table [rows, L], with
    ``option_rows``): each row's token is also written at ``commit[option_rows[r],
    positions[r]]``, the commit a step would otherwise launch."""
    rows, vocab = logits.shape
    if commit is not None and option_rows is None:
        raise ValueError("commit needs option_rows (the rows of the token table to write)")
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    n = triton.cdiv(vocab, slice_size)
    if n > MAX_SLICES:
        raise ValueError(f"a vocabulary of {vocab} exceeds the sampler's {MAX_SLICES * slice_size}")
    # each slice's max, best score and its index (int32 bits); rows of a multiple of 4
    # entries, so that each starts on 16 bytes whatever the batch (no new variant mid-serving)
    work = torch.empty(3, -(-rows * n // 4) * 4, dtype=torch.float32, device=logits.device)
    counts = arrival_counters(logits.device, rows, user="sampler")
    if counts is None:
        raise RuntimeError(f"sample_logits: {rows} rows captured in a CUDA graph before any larger eager call")
    table = option_rows is not None
    idx = option_rows if table else positions  # (an unread pointer where no table is given)
    tok = commit if commit is not None else positions
    _slice_race_kernel[(rows, n)](
        logits, divisor, seeds, positions, idx, work[0], work[1], work[2].view(torch.int32), temperature, greedy,
        out, tok, counts, vocab, logits.stride(0), n, tok.stride(0) if commit is not None else 0,
        SLICE=slice_size, BLOCK=block, SLICES=MAX_SLICES, FROM_TABLE=table, COMMIT=commit is not None,
        num_warps=8, **pdl.launch_kwargs(logits),
    )  # fmt: skip
    return out
