"""Placing new requests in the device state in one Triton launch.

``DeviceState.stage`` packs every new request's tokens with their rows and columns (they
reach the device in the step inputs' copy); this writes them: each token into
``token_ids[row, col]``, a prompt token's bit into ``prompt_mask[row, token]``, an output
token (a resumed request's, after preemption) counted in ``output_counts[row, token]``
(atomically: a token may repeat), and each request's ``num_computed`` (its cached tokens),
``prompt_len`` and its column of sampling option words (``DeviceState.option_table``).
Through torch that was six indexed writes and a cast, each a launch with tens of
microseconds of host time.
The rows' clears (``output_counts``, ``prompt_mask``; penalty requests only) stay before it
in the stream.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.fast_launch import fast_launch


def place_requests_reference(
    token_ids,
    num_computed,
    prompt_len,
    prompt_mask,
    output_counts,
    option_table,
    tok,
    trow,
    tcol,
    tp,
    rows,
    cached,
    plen,
    words,
):
    """What the kernel writes (torch); ``tp``: how many of the tokens are prompt tokens (they
    come first); ``words``: ``[len(rows) * option_table.shape[0]]``, request-major."""
    token_ids.index_put_((trow, tcol), tok)
    option_table.index_copy_(1, rows, words.view(rows.shape[0], option_table.shape[0]).t())
    num_computed.index_put_((rows,), cached.to(num_computed.dtype))
    prompt_len.index_put_((rows,), plen.to(prompt_len.dtype))
    prompt_mask.index_put_((trow[:tp], tok[:tp]), torch.ones((), dtype=torch.bool, device=tok.device))
    if tok.shape[0] > tp:
        o = tok[tp:]
        output_counts.view(-1).index_add_(
            0, trow[tp:] * output_counts.shape[1] + o, torch.ones_like(o, dtype=output_counts.dtype)
        )


# fmt: off
@triton.jit
def place_program(
    pid, tok_ptr, trow_ptr, tcol_ptr, rows_ptr, cached_ptr, plen_ptr, words_ptr, token_ids_ptr,
    num_computed_ptr, prompt_len_ptr, mask_ptr, counts_ptr, opt_ptr, n_tok, n_prompt, n_req, vocab, stride_tok,
    stride_mask, stride_counts, stride_opt, WORDS: tl.constexpr, BLOCK: tl.constexpr
):
    # fmt: on
    """Placement program ``pid`` of ``1 + cdiv(n_tok, BLOCK)``: 0 writes the requests' lengths
    and option words, ``pid >= 1`` a block of tokens (``_place_kernel``; also run by the
    input kernel's extra programs: ``kernels.input_prep``)."""
    if pid == 0:  # the requests' lengths
        for start in range(0, n_req, BLOCK):
            r = start + tl.arange(0, BLOCK)
            m = r < n_req
            row = tl.load(rows_ptr + r, mask=m, other=0)
            tl.store(num_computed_ptr + row, tl.load(cached_ptr + r, mask=m, other=0).to(tl.int32), mask=m)
            tl.store(prompt_len_ptr + row, tl.load(plen_ptr + r, mask=m, other=0).to(tl.int32), mask=m)
            for j in tl.static_range(WORDS):  # the sampling options, one word of each request at a time
                w = tl.load(words_ptr + r * WORDS + j, mask=m, other=0)
                tl.store(opt_ptr + j * stride_opt + row, w, mask=m)
    else:
        i = (pid - 1) * BLOCK + tl.arange(0, BLOCK)
        m = i < n_tok
        t = tl.load(tok_ptr + i, mask=m, other=0)
        row = tl.load(trow_ptr + i, mask=m, other=0)
        col = tl.load(tcol_ptr + i, mask=m, other=0)
        tl.store(token_ids_ptr + row * stride_tok + col, t, mask=m)
        m = m & (t >= 0) & (t < vocab)  # (ids are checked on admission: never another row's bits)
        prompt = m & (i < n_prompt)
        tl.store(mask_ptr + row * stride_mask + t, tl.full([BLOCK], 1, tl.int1), mask=prompt)
        out = m & (i >= n_prompt)
        tl.atomic_add(counts_ptr + row * stride_counts + t, tl.full([BLOCK], 1, tl.int32), mask=out)


@fast_launch
# the input segments follow the placement's token count: their 16-byte alignment varies, and
# specialising on it would compile variants mid-serving
@triton.jit(
    do_not_specialize=[
        "n_tok",
        "n_prompt",
        "n_req",
        "vocab",
        "stride_tok",
        "stride_mask",
        "stride_counts",
        "stride_opt",
    ],
    do_not_specialize_on_alignment=[
        "tok_ptr",
        "trow_ptr",
        "tcol_ptr",
        "rows_ptr",
        "cached_ptr",
        "plen_ptr",
        "words_ptr",
    ],
)
def _place_kernel(
    tok_ptr,
    trow_ptr,
    tcol_ptr,
    rows_ptr,
    cached_ptr,
    plen_ptr,
    words_ptr,
    token_ids_ptr,
    num_computed_ptr,
    prompt_len_ptr,
    mask_ptr,
    counts_ptr,
    opt_ptr,
    n_tok,
    n_prompt,
    n_req,
    vocab,
    stride_tok,
    stride_mask,
    stride_counts,
    stride_opt,
    WORDS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    place_program(
        tl.program_id(0),
        tok_ptr, trow_ptr, tcol_ptr, rows_ptr, cached_ptr, plen_ptr, words_ptr,
        token_ids_ptr, num_computed_ptr, prompt_len_ptr, mask_ptr, counts_ptr, opt_ptr,
        n_tok, n_prompt, n_req, vocab, stride_tok, stride_mask, stride_counts, stride_opt,
        WORDS, BLOCK,
    )  # fmt: skip


def place_requests_triton(
    token_ids,
    num_computed,
    prompt_len,
    prompt_mask,
    output_counts,
    option_table,
    tok,
    trow,
    tcol,
    tp: int,
    rows,
    cached,
    plen,
    words,
    block: int = 256,
):
    """``place_requests_reference`` in one launch. ``tp``: a host int."""
    for t in (token_ids, prompt_mask, output_counts, option_table):
        assert t.stride(-1) == 1
    n_tok, n_req = tok.shape[0], rows.shape[0]
    _place_kernel[(1 + triton.cdiv(n_tok, block),)](
        tok, trow, tcol, rows, cached, plen, words,
        token_ids, num_computed, prompt_len, prompt_mask, output_counts, option_table,
        n_tok, tp, n_req, prompt_mask.shape[1],
        token_ids.stride(0), prompt_mask.stride(0), output_counts.stride(0), option_table.stride(0),
        WORDS=option_table.shape[0], BLOCK=block,
    )  # fmt: skip


def place_requests(
    token_ids,
    num_computed,
    prompt_len,
    prompt_mask,
    output_counts,
    option_table,
    tok,
    trow,
    tcol,
    tp: int,
    rows,
    cached,
    plen,
    words,
) -> None:
    """Writes new requests' tokens, lengths and sampling options (see the module docstring):
    one launch on CUDA, the torch reference elsewhere. ``tp``: a host int."""
    fn = place_requests_triton if tok.is_cuda else place_requests_reference
    fn(
        token_ids, num_computed, prompt_len, prompt_mask, output_counts, option_table,
        tok, trow, tcol, tp, rows, cached, plen, words,
    )  # fmt: skip


class Placement(NamedTuple):
    """New requests placed by the input kernel's own launch (``prepare_inputs``' ``place``):
    ``words``, ``DeviceState.stage``'s words on the device (``n_tok`` tokens, the first
    ``n_prompt`` prompt tokens, ``n_req`` requests, ``WORDS`` option words each, then each
    request's prompt and output offsets among the tokens); ``new_j`` (int64 [R]): each of the
    step's requests' index among them, -1 for a row placed before; and the state tensors
    the placement writes besides ``token_ids`` and ``num_computed``."""

    words: torch.Tensor
    new_j: torch.Tensor | None  # (None where nothing but ``place_staged`` reads it)
    n_tok: int
    n_prompt: int
    n_req: int
    prompt_len: torch.Tensor
    prompt_mask: torch.Tensor
    output_counts: torch.Tensor
    option_table: torch.Tensor


def place_staged(place: Placement, token_ids, num_computed) -> None:
    """``place``'s writes on their own (``place_requests``: the input kernel's reference path)."""
    t, n, w = place.n_tok, place.n_req, place.option_table.shape[0]
    tok, trow, tcol, rows, cached, plen, words = place.words[: 3 * t + (3 + w) * n].split_with_sizes(
        (t, t, t, n, n, n, w * n)
    )
    place_requests(
        token_ids, num_computed, place.prompt_len, place.prompt_mask, place.output_counts, place.option_table,
        tok, trow, tcol, place.n_prompt, rows, cached, plen, words,
    )  # fmt: skip


def placement_args(place: Placement | None, by_row: bool, commit_lengths: bool, n_reqs: int, dummy) -> tuple:
    """The input kernel's placement arguments (``staged_ptr`` .. ``stride_opt``); dummies
    without ``place``."""
    if place is None:
        return (dummy,) * 6 + (0,) * 7
    if not by_row or commit_lengths or place.new_j.shape != (n_reqs,):
        raise ValueError("prepare_inputs place: needs num_computed, no commit_lengths and one new_j a request")
    for t in (place.prompt_mask, place.output_counts, place.option_table):
        assert t.stride(-1) == 1
    return (
        place.words, place.new_j, place.prompt_len, place.prompt_mask, place.output_counts, place.option_table,
        place.n_tok, place.n_prompt, place.n_req, place.prompt_mask.shape[1],
        place.prompt_mask.stride(0), place.output_counts.stride(0), place.option_table.stride(0),
    )  # fmt: skip
