"""Triton paged attention for mixed prefill + decode batches, with split-KV.

One kernel serves every batch shape. A program owns one *query block* (up to
``BLOCK_Q`` query tokens of one request) times one KV head, and processes all
``GROUP = num_q_heads // num_kv_heads`` query heads of that KV head together,
so each K/V tile is loaded once per group. Its ``BLOCK_M = BLOCK_Q * GROUP_P``
rows are laid out token-major: row ``m`` is token ``m // GROUP_P``, head
``m % GROUP_P`` (``GROUP_P`` = group rounded up to a power of two; the extra
heads are masked).

Everything exact comes from the device: ``query_start_loc`` gives each
request's query range, ``seq_lens`` its KV length, ``block_table`` its pages.
The CPU ints only size grids and pick constexpr configs:

* ``max_query_len <= DECODE_MAX_Q`` (decode, spec-decode verify): one query
  block per request, so grid axis 0 is exactly ``num_reqs``.
* otherwise (prefill / chunked prefill): request ``r``'s query blocks start at
  global index ``query_start_loc[r] // BLOCK_Q + r``. That index is strictly
  increasing and leaves room for ``cdiv(q_len, BLOCK_Q)`` blocks, so
  ``num_tokens // BLOCK_Q + num_reqs`` programs always suffice; it is an upper
  bound, and programs past their request's last query block exit at once.
  A program finds its request by binary search over ``query_start_loc``.

Split-KV (flash decoding): grid axis 2 splits each program's KV range into
``num_splits`` equal chunks *of its real length* (read from device
``seq_lens``), so short and long rows are both balanced. A split whose chunk
is empty writes a neutral partial (o = 0, lse = -inf). For decode batches the
partials are merged in the same launch: each split bumps a per-(request, KV
head) arrival counter (acq_rel atomic, after a CTA barrier), and the split that
arrives last reads every partial back from L2, writes the merged output and
re-arms the counter to 0 for the next launch or graph replay. There a row uses
only as many splits as it has KV tiles (``NUM_SPLITS`` is sized from the bound,
often ``max_model_len``): the surplus splits exit at once, and the merge reads
only the used partials, all loads in flight together. That saves the
reduce kernel's launch (~2.5 us a layer inside a graph at batch 1); the
separate reduce kernel remains for forced splits of prefill-shaped batches and
when no counter buffer can be had (first use inside a graph capture).
``num_splits`` is chosen on the CPU from ``max_seq_len_upper_bound`` and the
batch size only.

No host synchronisation happens here and all buffers come from ``torch.empty``
with shapes fixed by the CPU ints, so a decode step is CUDA-graph capturable.
Capture with the largest ``max_seq_len_upper_bound`` the graph will replay
with (e.g. ``max_model_len``): the split count is baked into the graph, and
only the device ``seq_lens`` may change between replays.
"""

from __future__ import annotations

import torch
import triton

from kernels import pdl
from kernels.attention_splits import (  # noqa: F401 - the launch sizing is re-exported here
    CTAS_PER_SM,
    MAX_SPLITS,
    MIN_TOKENS_PER_SPLIT,
    MIN_TOKENS_PER_SPLIT_SHORT,
    _device_sms,
    arrival_counters,
    reduce_splits,
    choose_num_splits,
    launch_config,
    one_token_launch,
    one_token_stages,
)
from kernels.kv_write import check_kv_cache
from kernels.paged_attention_kernel import _paged_attention_kernel
from kernels.rope_inline import DecodeRope

LOG2E = 1.4426950408889634


def row_lines(head_dim: int, element_size: int) -> dict[str, int]:
    """The L2 prefetch's view of one K/V row: ``ROW_LINES`` (a power of two) 128-byte lines,
    ``LINE_ELEMS`` elements apart, cover its ``head_dim`` elements (short rows: one line)."""
    return dict(
        LINE_ELEMS=max(1, 128 // element_size),
        ROW_LINES=triton.next_power_of_2(triton.cdiv(head_dim * element_size, 128)),
    )


def _rope_args(rope: DecodeRope) -> tuple:
    """The fused-rope pointer arguments (a missing norm weight: any tensor, unread)."""
    return (
        rope.k,
        rope.v,
        rope.positions,
        rope.slot_mapping,
        rope.cos_sin_cache,
        rope.q_norm_weight if rope.q_norm_weight is not None else rope.k,
        rope.k_norm_weight if rope.k_norm_weight is not None else rope.k,
    )


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_seq_len_upper_bound: int,
    scale: float,
    *,
    num_splits: int | None = None,
    fused_reduce: bool | None = None,
    config: dict | None = None,
    rope: DecodeRope | None = None,
    eager: bool = False,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal paged attention; layouts as in ``kernels.reference``.

    ``rope`` (batches of one query token a request, ``max_query_len == 1``): ``q`` is the
    raw projection; the kernel also does ``kernels.rope_kv``'s work (q/k norm, rotary,
    the new K/V written to the cache), as ``rope_and_write_kv_reference`` followed by
    this function would (within 16-bit rounding). One difference: a request whose new
    token has slot -1 (a draft lookahead past its KV capacity) attends its fresh key,
    where the two-launch path attends whatever the cache holds at that position.

    ``max_query_len`` and ``max_seq_len_upper_bound`` are CPU ints that must be
    >= the real values; they only size grids and pick configs. ``num_splits``
    overrides the split-KV heuristic (tests, benchmarks). Decode-shaped splits
    merge their partials in the last arriving program (``fused_reduce``, default
    on) instead of a second launch. ``eager``: a launch outside any CUDA graph takes its
    shape from the small fixed set of ``launch_config(eager=True)``. ``config`` overrides
    ``block_n`` /
    ``num_warps`` / ``num_stages`` (benchmarks). Rows of ``q`` past
    ``query_start_loc[-1]`` (padding) are left unwritten.

    An FP8 (``float8_e4m3fn``) cache holds ``K / k_scale`` and ``V / v_scale``
    (``kernels.kv_write``): the kernel dequantizes its tiles in registers (see
    ``kernels.paged_attention_kernel``) and, with ``rope``, stores the new K/V quantized
    with the same scales (``rope.k_scale`` / ``rope.v_scale`` must equal them). Python
    floats, passed as runtime float32 arguments; ignored with any other cache dtype.
    """
    num_tokens, hq, head_dim = q.shape
    _, kv_block_size, hkv, _ = k_cache.shape
    num_reqs = query_start_loc.shape[0] - 1
    assert hq % hkv == 0, "num_q_heads must be a multiple of num_kv_heads"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    check_kv_cache(k_cache, v_cache)
    k_scale, v_scale = float(k_scale), float(v_scale)
    if rope is not None:
        assert max_query_len == 1, "fused rope: one query token a request"
        assert head_dim % 2 == 0 and rope.cos_sin_cache.shape[-1] == head_dim
        assert rope.k.shape[1:] == (hkv, head_dim) and rope.v.shape[1:] == (hkv, head_dim)
        assert rope.k.stride(-1) == 1 and rope.v.stride(-1) == 1
        assert rope.cos_sin_cache.stride(-1) == 1 and rope.slot_mapping.shape[0] >= num_tokens
        if k_cache.element_size() == 1:  # one FP8 cache: the scales it is read and written with
            assert (rope.k_scale, rope.v_scale) == (k_scale, v_scale), "rope's KV scales differ from the launch's"
    group = hq // hkv
    group_p = triton.next_power_of_2(group)
    block_d = max(16, triton.next_power_of_2(head_dim))
    out = torch.empty((num_tokens, hq, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_reqs == 0:
        return out

    lc = launch_config(
        num_reqs,
        num_tokens,
        hkv,
        group_p,
        block_d,
        max_query_len,
        max_seq_len_upper_bound,
        _device_sms(q.device),
        eager=eager,
    )
    one_qblock, grid0, block_q, block_m = lc.one_qblock, lc.grid0, lc.block_q, lc.block_m
    block_n, num_warps, num_stages = lc.block_n, lc.num_warps, lc.num_stages
    one_token = one_token_launch(one_qblock, block_q, block_m)
    if config:
        block_n = config.get("block_n", block_n)
        num_warps = config.get("num_warps", num_warps)
    if num_splits is None:
        num_splits = lc.num_splits
    num_splits = max(1, min(int(num_splits), MAX_SPLITS))
    if one_token and not eager:  # the depth follows the tiles a split gets after any override
        num_stages = one_token_stages(block_n, num_splits, max_seq_len_upper_bound)
    if config:
        num_stages = config.get("num_stages", num_stages)
    sem = None
    if num_splits > 1 and one_qblock and fused_reduce is not False:
        sem = arrival_counters(q.device, grid0 * hkv)
    if num_splits > 1:
        part = torch.empty((num_splits, num_tokens, hq, head_dim), dtype=torch.float32, device=q.device)
        lse = torch.empty((num_splits, num_tokens, hq), dtype=torch.float32, device=q.device)
        dst, stride_os, stride_ls, stride_lt = part, part.stride(0), lse.stride(0), lse.stride(1)
    else:
        lse, dst, stride_os, stride_ls, stride_lt = out, out, 0, 0, 0  # lse unused

    launch = pdl.launch_kwargs(q)
    # with PDL, a one-tile split's K and V tile load before the wait (5 % off a Qwen3-0.6B
    # batch-1 step, 1 % off Llama-3.1-8B's; the keys alone were slower: docs/decisions.md);
    # a longer split's first tile is prefetched into L2 instead
    # An FP8 cache takes no preload (its tiles' conversion spills then, sm_90) and 8 warps for
    # 128-key one-token tiles (at 4 the converted tiles take 166-255 registers; with the rope
    # prologue and two stages they spill); test_kernels_fp8_kv compiles these for sm_90.
    fp8 = k_cache.element_size() == 1
    preload = one_token and rope is not None and num_stages == 1 and launch["USE_PDL"] and not fp8
    if (preload or (fp8 and one_token and block_n >= 128)) and not (config and "num_warps" in config):
        num_warps = 8  # K and V tiles held across the wait (or FP8 tiles converted): 4 warps spill (sm_90)
    kv_cap = min(triton.cdiv(max_seq_len_upper_bound, kv_block_size), block_table.shape[1])
    kv_cap *= kv_block_size
    _paged_attention_kernel[(grid0, hkv, num_splits)](
        q,
        k_cache,
        v_cache,
        dst,
        lse,
        out,
        sem if sem is not None else seq_lens,
        block_table,
        seq_lens,
        query_start_loc,
        *(_rope_args(rope) if rope is not None else (q,) * 7),
        num_reqs,
        kv_cap,
        float(scale) * LOG2E,
        k_scale,
        v_scale,
        float(rope.eps) if rope is not None else 0.0,
        rope.cos_sin_cache.stride(0) if rope is not None else 0,
        *(
            (rope.k.stride(0), rope.k.stride(1), rope.v.stride(0), rope.v.stride(1))
            if rope is not None
            else (0, 0, 0, 0)
        ),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_table.stride(0),
        stride_os,
        dst.stride(-3),
        dst.stride(-2),
        stride_ls,
        stride_lt,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        KV_BLOCK_SIZE=kv_block_size,
        GROUP=group,
        GROUP_P=group_p,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        ONE_QBLOCK_PER_REQ=one_qblock,
        IEEE=q.dtype == torch.float32,
        # The interpreter's tl.dot multiplies bf16 as raw uint16 bits (triton 3.9):
        # off-GPU only, feed it fp32 copies of the same bf16 values.
        UPCAST=(not q.is_cuda) and torch.bfloat16 in (q.dtype, k_cache.dtype),
        FUSED_REDUCE=sem is not None,
        **row_lines(head_dim, k_cache.element_size()),
        ROPE=rope is not None,
        Q_NORM=rope is not None and rope.q_norm_weight is not None,
        K_NORM=rope is not None and rope.k_norm_weight is not None,
        PRELOAD=preload,
        num_warps=num_warps,
        num_stages=num_stages,
        **launch,
    )
    if num_splits > 1 and sem is None:
        reduce_splits(part, lse, out, query_start_loc, num_reqs, block_d)
    return out
