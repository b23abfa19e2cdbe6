"""The input kernel reading its step from a header in the staged words (a launch a CUDA
graph can hold).

``kernels.input_prep``'s launch takes about twenty step-dependent ints (token and request
counts, padding, the placement's sizes) and a pointer per staged segment: a launch whose
arguments change every step, which costs the host a Triton launch (tens to hundreds of
microseconds as served) each step. With ``HEADER`` the kernel reads those from the first
``HEADER_WORDS`` int64 words of one fixed device buffer, the *stage*, and finds every
segment (rows, query starts and lengths, capacities, the block table, the sampled-token
indices, the new requests' words) at the word offsets the header gives. Its arguments are
then the same every step of a padded shape, so the launch is captured once per shape
(``workers.input_graphs``) and a step is one copy into the stage and one graph replay.

Header words, in order: ``n_tokens, n_reqs, n_iter, n_blk, stride_bt, pad_tokens,
pad_reqs, n_logits, pad_seq_rows, pad_seq_len, st_tok, st_prompt, st_req`` (the launch
arguments of the same names), then the word offsets of ``rows, qsl_in, q_lens, capacity,
block_table`` (its int32 rows as int64 words), ``logits_src, staged, new_j``; the rest zero.
An offset of a segment the step lacks is 0 (its count is 0: never read).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.input_prep import _prepare_inputs_kernel, search_halvings

HEADER_WORDS = 24  # (even: the segments after it start on 16 bytes)
SEGMENTS = ("rows", "qsl_in", "q_lens", "capacity", "block_table", "logits_src", "staged", "new_j")


def header_words(
    n_tokens: int,
    n_reqs: int,
    n_blk: int,
    stride_bt: int,
    pad_tokens: int,
    pad_reqs: int,
    pad_seq_rows: int,
    pad_seq_len: int,
    offsets: dict,
    n_logits: int = 0,
    st_tok: int = 0,
    st_prompt: int = 0,
    st_req: int = 0,
) -> list[int]:
    """One step's header (the module docstring); ``offsets``: word offsets by ``SEGMENTS``
    name (a missing one: 0)."""
    unknown = set(offsets) - set(SEGMENTS)
    if unknown:
        raise ValueError(f"input header: unknown segments {sorted(unknown)}")
    words = [
        n_tokens, n_reqs, search_halvings(n_tokens, n_reqs), n_blk, stride_bt, pad_tokens, pad_reqs, n_logits,
        pad_seq_rows, pad_seq_len, st_tok, st_prompt, st_req, *(offsets.get(name, 0) for name in SEGMENTS),
    ]  # fmt: skip
    return words + [0] * (HEADER_WORDS - len(words))


def prepare_inputs_from_header(
    stage: torch.Tensor,
    n_in: int,
    place_programs: int,
    token_ids: torch.Tensor,
    num_computed: torch.Tensor,
    out: tuple,
    qsl_out: torch.Tensor,
    block_size: int,
    block_table_dst: torch.Tensor | None = None,
    logits_dst: torch.Tensor | None = None,
    place_state: tuple | None = None,
    commit_lengths: bool = False,
    block: int = 256,
) -> None:
    """The input kernel over the step the header of ``stage`` (int64) describes: ``n_in``
    input programs (at least the padded tokens over ``block``) and ``place_programs``
    placement programs (with ``place_state`` = (prompt_len, prompt_mask, output_counts,
    option_table): at least ``1 + cdiv(st_tok, block)``). Writes ``out`` = (positions,
    input_ids, seq_lens, slot_mapping) and ``qsl_out`` (a graph's static buffers, large enough
    for its padding), the block table into ``block_table_dst`` and the sampled-token indices
    into ``logits_dst`` where given. Every argument is fixed for a padded shape."""
    positions, input_ids, seq_lens, slots = out
    if stage.dtype != torch.int64 or stage.dim() != 1 or stage.shape[0] < HEADER_WORDS:
        raise ValueError("prepare_inputs_from_header: the stage is a 1-d int64 buffer holding a header")
    if place_state is not None and commit_lengths:
        raise ValueError("prepare_inputs_from_header: a placing launch reads the old lengths (no commit_lengths)")
    if place_state is None:
        place_programs = 0
        prompt_len = mask = counts = opt = stage
        vocab = s_mask = s_counts = s_opt = 0
        words = 1
    else:
        prompt_len, mask, counts, opt = place_state
        vocab, words = mask.shape[1], opt.shape[0]
        s_mask, s_counts, s_opt = mask.stride(0), counts.stride(0), opt.stride(0)
    bt_dst = block_table_dst if block_table_dst is not None else slots
    _prepare_inputs_kernel[(n_in + place_programs,)](
        stage, num_computed, stage, stage, stage, stage, token_ids, stage,
        positions, input_ids, seq_lens, slots, qsl_out,
        0, 0, 0, 0, token_ids.stride(0), 0, token_ids.shape[1] - 1, 0, 0,
        bt_dst, block_table_dst.stride(0) if block_table_dst is not None else 0,
        stage, logits_dst if logits_dst is not None else slots,
        0, 0, 0, n_in, stage, stage, prompt_len, mask, counts, opt, 0, 0, 0, vocab, s_mask, s_counts, s_opt,
        KV_BLOCK_SIZE=block_size, BLOCK=block, STARTS_BY_ROW=True, COPY_TABLE=block_table_dst is not None,
        COPY_LOGITS=logits_dst is not None, COMMIT_LENGTHS=commit_lengths, PLACE=place_state is not None,
        WORDS=words, HEADER=True, num_warps=4, USE_PDL=False,
    )  # fmt: skip


@triton.jit
def _commit_lengths_kernel(hdr_ptr, seq_lens_ptr, num_computed_ptr, BLOCK: tl.constexpr):
    """Each of the header's step rows' ``num_computed`` set to its new length (``seq_lens``)."""
    n_reqs = tl.load(hdr_ptr + 1).to(tl.int32)
    rows_ptr = hdr_ptr + tl.load(hdr_ptr + 13)
    for start in range(0, n_reqs, BLOCK):
        r = start + tl.arange(0, BLOCK)
        m = r < n_reqs
        row = tl.load(rows_ptr + r, mask=m, other=0)
        tl.store(num_computed_ptr + row, tl.load(seq_lens_ptr + r, mask=m, other=0), mask=m)


def commit_lengths_from_header(stage: torch.Tensor, seq_lens: torch.Tensor, num_computed: torch.Tensor) -> None:
    """After the input kernel of a step of several tokens a row (which cannot set the lengths it
    reads: ``prepare_inputs_from_header``), each of its rows' ``num_computed`` becomes its new
    length, in one program: what ``ModelRunner`` would otherwise index-write after the forward
    (nothing between reads the old lengths)."""
    _commit_lengths_kernel[(1,)](stage, seq_lens, num_computed, BLOCK=256, num_warps=4)
