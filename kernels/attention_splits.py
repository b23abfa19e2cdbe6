"""Launch sizing and split-KV for ``kernels.paged_attention``: tiles and split count (from CPU
values only), the separate reduce kernel and the arrival counters of the in-kernel (fused)
merge."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.pdl import wait_and_release

DECODE_MAX_Q = 16  # up to this many query tokens per request: one q-block per request
MAX_SPLITS = 64
# Split sizing and decode tiles, from a graph-replay sweep
# (``python -m benchmarks.kernels.bench --only attention-sweep``; docs/decisions.md):
# a split's fixed cost (its partial's store, the arrival atomic, the merge) is about one
# tile's latency, so short bounds split down to one 128-token tile per split, long ones to
# 256 tokens; and 2 CTAs per SM already saturate HBM (4 were slower).
MIN_TOKENS_PER_SPLIT = 256
MIN_TOKENS_PER_SPLIT_SHORT = 128  # for bounds up to SHORT_BOUND
SHORT_BOUND = 2048
CTAS_PER_SM = 2  # split target: enough CTAs in flight to saturate HBM
# Decode grids of at most this many (request, KV head) programs use 128-key tiles: at 33-64
# programs (b8, 8 KV heads) the 128-key tiles ran bimodal (one run fast, the next ~25 %
# slower) where the 64-key tiles were stable (docs/decisions.md).
WIDE_TILE_MAX_CTAS = 32
# Narrow-tile grids of at most this many programs split for LONG_CTAS_PER_SM past SHORT_BOUND
# (b8 ctx 4096: 9 splits beat 5 by about 10 %).
NARROW_SPLIT_MAX_CTAS = 64
LONG_CTAS_PER_SM = 4


def _device_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return pdl.sm_count(device)
    return 132  # interpreter / CPU tensors: model a 132-SM Hopper GPU


def choose_num_splits(
    num_reqs: int,
    num_kv_heads: int,
    max_query_len: int,
    max_seq_len_upper_bound: int,
    num_sms: int = 132,
    ctas_per_sm: int = CTAS_PER_SM,
) -> int:
    """Split count from CPU values only (batch shape and the length *bound*).

    Only decode-shaped batches split: prefill already has many query blocks.
    Target ``ctas_per_sm * num_sms`` programs, but give each split at least
    ``MIN_TOKENS_PER_SPLIT`` tokens of the bound. Rows shorter than the bound
    just get shorter chunks (the kernel divides their real length).
    """
    if max_query_len > DECODE_MAX_Q:
        return 1
    base = max(1, num_reqs * num_kv_heads)
    want = triton.cdiv(ctas_per_sm * num_sms, base)
    bound = max(max_seq_len_upper_bound, 1)
    cap = triton.cdiv(bound, MIN_TOKENS_PER_SPLIT_SHORT if bound <= SHORT_BOUND else MIN_TOKENS_PER_SPLIT)
    return max(1, min(want, cap, MAX_SPLITS))


class LaunchConfig(NamedTuple):
    one_qblock: bool  # decode-shaped: one query block a request
    grid0: int  # grid axis 0 (an upper bound for prefill)
    block_q: int
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int  # grid axis 2


def one_token_launch(one_qblock: bool, block_q: int, block_m: int) -> bool:
    """The swept one-query-token decode launch (its GQA group fits one 16-row tile)."""
    return one_qblock and block_q == 1 and block_m == 16


def one_token_stages(block_n: int, num_splits: int, max_seq_len_upper_bound: int) -> int:
    """Pipelining depth of the one-token decode launch: 1 when the bound gives at most one
    tile a split (nothing to pipeline, and no second stage's shared memory), else 2: one
    stage saves ~2 % of a batch-1 step but costs up to 29 % where a split has 2+ tiles
    (docs/decisions.md)."""
    return 1 if triton.cdiv(max(1, max_seq_len_upper_bound), block_n) <= num_splits else 2


def floor_pow2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def floor_pow4(n: int) -> int:
    return 1 << ((max(1, n).bit_length() - 1) & ~1)


EAGER_ONE_TOKEN_STAGES = 2


def launch_config(
    num_reqs: int,
    num_tokens: int,
    num_kv_heads: int,
    group_p: int,
    block_d: int,
    max_query_len: int,
    max_seq_len_upper_bound: int,
    num_sms: int = 132,
    eager: bool = False,
) -> LaunchConfig:
    """The attention launch's tiles and split count, from CPU values only (the batch shape,
    the padded GQA group ``group_p``, the padded head dim ``block_d`` and the bounds).

    ``eager`` (a launch outside any CUDA graph): the shape comes from a small fixed set, so
    that eager steps of any batch and length reuse a few compiled variants. Windows of 2 to
    ``DECODE_MAX_Q`` tokens take the prefill shape (the one start-up's scratch prefill
    compiles; ``max_query_len`` is an upper bound, so raising it is always valid), and the
    split count of one-token windows is rounded down to a power of two (any count is exact:
    a split divides its row's real length). Eager one-token windows (``enforce_eager`` decode)
    also keep the default tile and CTA target (no small-grid heuristics), fix their depth
    (``EAGER_ONE_TOKEN_STAGES``) and round the split count down to a power of four, so that
    every batch and bound lands on at most four shapes, which start-up compiles
    (``eager_one_token_cases``); an eager step's cost is its Python launches, not these
    tiles. Graph captures keep the exact, tuned shapes:
    their variants are compiled at capture. Without this, an eager mixed step whose longest
    window was 5-16 tokens compiled attention variants mid-serving (each new ``BLOCK_Q`` and
    split count; docs/decisions.md). The cost: such eager windows lose split-KV (a few
    long-context rows run one program a KV head), which only eager mixed, verify and draft
    steps pay."""
    if eager and 1 < max_query_len <= DECODE_MAX_Q:
        max_query_len = DECODE_MAX_Q + 1
    ctas_per_sm = CTAS_PER_SM
    block_n = 64 if block_d <= 128 else 32
    if max_query_len <= DECODE_MAX_Q:
        block_q = triton.next_power_of_2(max(1, max_query_len))
        block_m = max(16, block_q * group_p)
        one_qblock, grid0 = True, num_reqs
        num_warps, num_stages = 4, 3
        if block_m == 16 and block_d <= 128:  # one query token (swept), or q_len x group <= 16
            # small grids: fewer, wider tiles (each serial tile costs a DRAM round trip);
            # the narrow-tile grids up to NARROW_SPLIT_MAX_CTAS split for more CTAs a SM
            # past SHORT_BOUND (not eagerly: one shape for every batch, see above)
            if not eager:
                base = num_reqs * num_kv_heads
                block_n = 128 if base <= WIDE_TILE_MAX_CTAS else 64
                if block_n == 64 and base <= NARROW_SPLIT_MAX_CTAS and max_seq_len_upper_bound > SHORT_BOUND:
                    ctas_per_sm = LONG_CTAS_PER_SM
            num_stages = 2
    else:
        block_m = max(128 if block_d <= 128 else 64, group_p)
        block_q = block_m // group_p
        one_qblock, grid0 = False, num_tokens // block_q + num_reqs
        num_warps, num_stages = (8 if block_m >= 128 else 4), 2
    splits = choose_num_splits(num_reqs, num_kv_heads, max_query_len, max_seq_len_upper_bound, num_sms, ctas_per_sm)
    if eager and one_token_launch(one_qblock, block_q, block_m):
        num_stages = EAGER_ONE_TOKEN_STAGES
        splits = floor_pow4(splits)
    elif eager:
        splits = floor_pow2(splits)
    elif one_token_launch(one_qblock, block_q, block_m):
        num_stages = one_token_stages(block_n, splits, max_seq_len_upper_bound)
    return LaunchConfig(one_qblock, grid0, block_q, block_m, block_n, num_warps, num_stages, splits)


@triton.jit(do_not_specialize=["num_reqs", "stride_ls"])  # stride_ls: tokens x heads
def _reduce_splits_kernel(
    part_ptr,
    lse_ptr,
    out_ptr,
    qsl_ptr,
    num_reqs,
    num_q_heads,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_ls,
    stride_lt,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Merge the split partials of one token, BLOCK_H q heads; lse is in log2 units."""
    t = tl.program_id(0).to(tl.int64)
    wait_and_release(USE_PDL)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    if t >= tl.load(qsl_ptr + num_reqs):
        return  # padding token: no request wrote partials for it
    h_ok = offs_h < num_q_heads
    offs_s = tl.arange(0, SPLITS_P)
    lse = tl.load(
        lse_ptr + offs_s[:, None] * stride_ls + t * stride_lt + offs_h[None, :],
        mask=(offs_s[:, None] < NUM_SPLITS) & h_ok[None, :],
        other=float("-inf"),
    )
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits neutral: weights stay 0
    w_sum = tl.sum(tl.exp2(lse - m[None, :]), 0)
    offs_d = tl.arange(0, BLOCK_D)
    mask = h_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    row = part_ptr + t * stride_pt + offs_h[:, None] * stride_ph + offs_d[None, :]
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for s in range(NUM_SPLITS):
        w = tl.exp2(tl.load(lse_ptr + s * stride_ls + t * stride_lt + offs_h, mask=h_ok, other=float("-inf")) - m)
        acc += w[:, None] * tl.load(row + s * stride_ps, mask=mask, other=0.0)
    o = acc / tl.where(w_sum > 0.0, w_sum, 1.0)[:, None]
    tl.store(
        out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


# Arrival counters of the fused split reduce, one int32 per (query block, KV head), and
# of the temperature sampler's fused pick (kernels.sample_logits), one per row: zero
# between launches (the last arriving program re-arms its counter). One growing buffer
# per device and user; outgrown buffers stay alive because captured CUDA graphs keep
# their addresses.
_SEMAPHORES: dict[tuple[str, str, int], torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []
MIN_SEMAPHORES = 1 << 14


def reduce_splits(
    part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, query_start_loc: torch.Tensor, num_reqs: int, block_d: int
) -> None:
    """Merge ``part`` / ``lse`` (``[splits, tokens, heads, ...]``) into ``out`` in a second
    launch: forced splits of prefill-shaped batches, or no arrival counters to be had."""
    num_splits, num_tokens, hq, head_dim = part.shape
    block_h = min(triton.next_power_of_2(hq), max(1, 2048 // block_d))
    _reduce_splits_kernel[(num_tokens, triton.cdiv(hq, block_h))](
        part,
        lse,
        out,
        query_start_loc,
        num_reqs,
        hq,
        part.stride(0),
        part.stride(1),
        part.stride(2),
        lse.stride(0),
        lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_H=block_h,
        NUM_SPLITS=num_splits,
        SPLITS_P=triton.next_power_of_2(num_splits),
        num_warps=4,
        **pdl.launch_kwargs(part),
    )


def arrival_counters(device: torch.device, n: int, user: str = "attention") -> torch.Tensor | None:
    """Arrival counters of kernels whose last program to finish a unit does its final work (the
    split attention's fused reduce, the sampler's pick; each re-arms its counters to zero).
    A zeroed counter buffer of >= n entries, ``user``'s own, or None while capturing a CUDA
    graph with a buffer too small (allocating then would tie it to the graph's pool): each
    caller has its own way out (the attention falls back to the reduce kernel)."""
    key = (user, device.type, device.index if device.index is not None else -1)
    buf = _SEMAPHORES.get(key)
    if buf is not None and buf.numel() >= n:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    if buf is not None:
        _RETIRED.append(buf)
    buf = torch.zeros(max(n, MIN_SEMAPHORES if buf is None else 2 * buf.numel()), dtype=torch.int32, device=device)
    _SEMAPHORES[key] = buf
    return buf


def eager_one_token_cases(
    num_kv_heads: int,
    group_p: int,
    block_d: int,
    max_num_seqs: int,
    max_model_len: int,
    num_sms: int,
    variant_of=lambda reqs, bound: (),
) -> list[tuple[int, int]]:
    """``(num_reqs, max_seq_len_upper_bound)`` pairs, one for each distinct compiled shape of
    the eager one-token attention launch over every batch of 1..``max_num_seqs`` requests and
    bound of 1..``max_model_len``: its ``launch_config`` less the grid size, plus what
    ``variant_of(reqs, bound)`` says also picks the variant (whether PDL applies, whether
    rope runs inside the launch). Start-up runs one eager decode pass per pair under
    ``enforce_eager`` so serving compiles none of them. A bound only matters through the
    split cap ``cdiv(bound, tokens a split)``, a step function whose steps start and end at
    multiples of ``MIN_TOKENS_PER_SPLIT_SHORT`` and that saturates at ``MAX_SPLITS`` splits;
    ``variant_of`` must be monotone in the bound (a token x bound limit), so both ends of
    each step (``m`` and ``m + 1``, and the two ends of the range) stand for every bound."""
    top = min(max_model_len, MAX_SPLITS * MIN_TOKENS_PER_SPLIT + MIN_TOKENS_PER_SPLIT)
    steps = range(MIN_TOKENS_PER_SPLIT_SHORT, top + 1, MIN_TOKENS_PER_SPLIT_SHORT)
    bounds = sorted({1, max_model_len, *(b for m in steps for b in (m, m + 1) if b <= max_model_len)})
    seen: dict[tuple, tuple[int, int]] = {}
    for reqs in range(1, max_num_seqs + 1):
        for bound in bounds:
            lc = launch_config(reqs, reqs, num_kv_heads, group_p, block_d, 1, bound, num_sms, eager=True)
            seen.setdefault((lc._replace(grid0=0), variant_of(reqs, bound)), (reqs, bound))
    return sorted(seen.values())
