"""One launch for a whole decoder layer in decode: a persistent kernel with grid barriers.

Why: a batch-1 decode step of a small model is ~150 short kernels, and each pays a fixed
cost (launch, CTA ramp, drain, the first DRAM round trip) that its few MB of weights cannot
hide. Qwen3-0.6B on the H200 ran at 2.6x its roofline with attention removed altogether
(notes/2026-12-04h-h200-results.md): the five launches of a layer, not their bytes, set the
pace. Here one program an SM runs the layer's phases, separated by grid barriers
(``kernels.grid_sync``), and bulk-prefetches weight rows into L2 ahead of the phase that
reads them, so HBM keeps streaming across the phase boundaries:

  A  ``qkv = rms_norm(x + residual) @ Wqkv^T`` (each program computes ``rstd`` itself;
     program 0 stores the new residual ``r1``)
  B  attention: q/k norm + rotary + KV write + split-KV over device ``seq_lens``, merged
     by the last split of each KV head (``kernels.decode_layer_attention``)
  C  ``r2 = attn @ Wo^T + r1``, and each program's partial ``sum(r2^2)``
  D  ``act = silu_and_mul(rms_norm(r2) @ Wgu^T)``
  E  ``out = act @ Wd^T``; the layer returns ``(out, r2)`` as the multi-launch path does.

Prefetching: a weight of at most half of L2 is prefetched whole one phase ahead (a small
model's four); bigger ones stream with ``ahead`` row blocks prefetched ahead of the row
block being read; the K/V rows of a program's attention items before the PDL wait; and
the next layer's QKV rows in phase C (its launch cannot do that early itself: a program
of this kernel fills an SM's registers, so the next one starts as ours exit).

Batches: ``M`` <= ``MAX_BATCH`` tokens, one a request (a decode step), take the same kernel
with the GEMV phases on 16-row tensor-core tiles (``kernels.decode_layer_batched``) and
attention items per (request, KV head, split); ``M`` is not specialised, so every batch
size runs one compiled variant.

The grid never exceeds what is resident at once (one program an SM), which a grid barrier
needs. With PDL (batch 1) the kernel waits up front and releases the next launch before
its last phase, as ``kernels.mlp_block`` does. The interpreter (and ``phased=True``) runs
each phase as its own launch with the barriers compiled out: same device code,
sequential programs. No host syncs: the split count comes from the CPU length bound, the
real lengths from ``seq_lens``.

``SYNCLESS_DECODE_LAYER=1`` (default off until an H200 run shows it faster) makes the Llama
family's decoder layer use it for decode steps of up to ``MAX_BATCH`` requests (tensor
parallelism 1, no biases, CUDA; elsewhere its reference).
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels import grid_sync, ops, pdl
from kernels.decode_layer_batched import skinny_phase, sum_squares_rows
from kernels.decode_layer_attention import attention_phase
from kernels.decode_layer_phases import gemv_phase, prefetch_kv, prefetch_lead, prefetch_rows, sum_squares
from kernels.grid_sync import grid_barrier, rearm_counters, stamp
from kernels.paged_attention import row_lines
from kernels.pdl import release_only, wait_only

LOG2E = 1.4426950408889634
N_BARRIERS = 4  # counters 0..3: after phases A, B, C, D; 4: the exit count; 5..: KV heads
_NB = tl.constexpr(N_BARRIERS)  # the same, for the kernel
MAX_SPLITS = 32
# What each of a program's 11 profile stamps marks (``profile=``); columns 16-26 hold the
# same moments in SM clock cycles (``%clock64``), 0-10 in ns (``%globaltimer``).
PROFILE_STAMPS = ("start", "waited", "A done", "barrier 0", "B done", "barrier 1", "C done",
                  "barrier 2", "D done", "barrier 3", "E done")
# tokens (one a request): the batched phases pad them to one 16-row MMA tile; the model's
# bound (kernels.ops, which must not import triton) is the same constant
MAX_BATCH = ops.DECODE_LAYER_MAX_TOKENS
BATCH_BLOCK_N, BATCH_BLOCK_K = 32, 256  # batched GEMV tiles (gate|up: 16 rows each half)
# Not yet measured (no GPU since it was written): one program an SM of 8 warps, 16 KB
# weight tiles (8192 elements: a step's loads, both halves of gate|up together) of up to
# 1024 columns, each phase's rows prefetched into L2 a phase ahead, the next layer's QKV
# rows during the last two phases, attention tiles of 64 keys on the tensor cores (the GQA
# group padded to 16 rows; ``att_dot=0``: FMA products of ``att_rows`` = group x keys, which
# at 64 rows leave GQA 4 16-key tiles and spill 8 bytes under the H200's Triton 3.6,
# notes/2026-12-05-triton36-registers.md), barriers polled with acquire loads (``poll_load=0``:
# atomics, as the measured ``kernels.mlp_block``); weights too big to prefetch a phase ahead
# stream with 4 row blocks prefetched ahead (``ahead``).
DEFAULT_CONFIG = dict(num_warps=8, tile=8192, block_k=1024, prefetch=1, prefetch_next=1,
                      att_rows=64, poll_load=1, ahead=4, att_dot=1, att_keys=64)
NUM_WARPS = DEFAULT_CONFIG["num_warps"]
CONFIG_ENV = "SYNCLESS_DECODE_LAYER_CONFIG"


def config_from_env() -> dict:
    """``DEFAULT_CONFIG`` updated by ``SYNCLESS_DECODE_LAYER_CONFIG`` (``key=value,...``,
    an A/B knob for benchmarks): ``num_warps`` 4|8|16, ``tile``/``block_k``/``att_rows``/
    ``att_keys`` powers of two (at least 16), ``prefetch``/``prefetch_next``/``poll_load``/
    ``att_dot`` 0|1, ``ahead`` 0..16.
    Anything else raises ``ValueError``. Parsed once per distinct value."""
    return dict(_parse_config(os.environ.get(CONFIG_ENV, "").strip()))


@functools.lru_cache(maxsize=16)
def _parse_config(raw: str) -> tuple:
    cfg = dict(DEFAULT_CONFIG)
    for item in filter(None, (part.strip() for part in raw.split(","))):
        key, _, val = item.partition("=")
        key, val = key.strip(), val.strip()
        if key not in cfg or not val.isdigit():
            raise ValueError(f"{CONFIG_ENV}: bad item {item!r}; expected key=integer with key "
                             f"in {sorted(cfg)}")
        cfg[key] = int(val)
    pow2 = all(cfg[k] >= 16 and cfg[k] & (cfg[k] - 1) == 0
               for k in ("tile", "block_k", "att_rows", "att_keys"))
    if (cfg["num_warps"] not in (4, 8, 16) or not pow2 or cfg["tile"] < cfg["block_k"]
            or any(cfg[k] not in (0, 1) for k in ("prefetch", "prefetch_next", "poll_load", "att_dot"))
            or cfg["ahead"] > 16):
        raise ValueError(f"{CONFIG_ENV}: invalid config {cfg}")
    return tuple(cfg.items())


class LayerWeights(NamedTuple):
    """What one decoder layer's kernel reads: norms, fused projections (QKV rows ``q | k |
    v``; gate|up as ``(gate j, up j)`` row pairs when ``gate_up_pairs``, else stacked), and
    Qwen3's optional per-head q/k norms."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    gate_up_pairs: bool
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    qk_eps: float = 1e-6


@triton.jit(do_not_specialize=["kv_cap", "M"])  # M: every batch size, one variant
def _decode_layer_kernel(
    x_ptr, res_ptr, ln1_ptr, wqkv_ptr, wqkv_next_ptr, qkv_ptr, r1_ptr,
    k_ptr, v_ptr, bt_ptr, seq_ptr, pos_ptr, slot_ptr, cs_ptr, qw_ptr, kw_ptr,
    part_ptr, lse_ptr, attn_ptr, wo_ptr, r2_ptr, ss_ptr, ln2_ptr, wgu_ptr, act_ptr,
    wd_ptr, out_ptr, bar_ptr, err_ptr, prof_ptr,
    M, H, N_QKV, INTER, gu_up_off, kv_cap, kv_budget, eps, qk_eps, scale_log2, stride_cs,
    stride_bt, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    HQ: tl.constexpr, HK: tl.constexpr, HEAD_DIM: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, SPLITS: tl.constexpr, SPLITS_P: tl.constexpr,
    ATT_BLOCK_N: tl.constexpr, ATT_M: tl.constexpr, ATT_DOT: tl.constexpr,
    Q_NORM: tl.constexpr, K_NORM: tl.constexpr,
    HAS_RES: tl.constexpr, GU_ROW_MUL: tl.constexpr, SS_P: tl.constexpr,
    BN_QKV: tl.constexpr, BK_QKV: tl.constexpr, BN_O: tl.constexpr, BK_O: tl.constexpr,
    BN_GU: tl.constexpr, BK_GU: tl.constexpr, BN_D: tl.constexpr, BK_D: tl.constexpr,
    RUN_A: tl.constexpr, RUN_B: tl.constexpr, RUN_C: tl.constexpr, RUN_D: tl.constexpr,
    RUN_E: tl.constexpr, SYNC: tl.constexpr, PREFETCH: tl.constexpr,  # bits: QKV KV O GU D
    PREFETCH_NEXT: tl.constexpr, ESZ: tl.constexpr, KV_SPAN: tl.constexpr,
    LINE_ELEMS: tl.constexpr, ROW_LINES: tl.constexpr, POLL_LOAD: tl.constexpr,
    SS_BLOCK: tl.constexpr, AHEAD_QKV: tl.constexpr, AHEAD_O: tl.constexpr,
    AHEAD_GU: tl.constexpr, AHEAD_D: tl.constexpr,
    BATCHED: tl.constexpr, BLOCK_M: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    PROFILE: tl.constexpr = False, USE_PDL: tl.constexpr = False,
):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    stamp(prof_ptr, pid, 0, PROFILE)
    HD: tl.constexpr = HQ * HEAD_DIM
    if RUN_A:  # weights, cached keys, lengths: none written by the kernel before: before the wait
        prefetch_rows(wqkv_ptr, pid, P, N_QKV, H, 0, BN_QKV, 1, False, ESZ, (PREFETCH & 1) != 0)
        prefetch_lead(wqkv_ptr, pid, P, N_QKV, H, 0, BN_QKV, 1, False, ESZ, AHEAD_QKV)
        prefetch_kv(pid, P, M, k_ptr, v_ptr, bt_ptr, seq_ptr, kv_cap, kv_budget, stride_bt,
                    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, HK,
                    HEAD_DIM, KV_BLOCK_SIZE, SPLITS, ATT_BLOCK_N, KV_SPAN, LINE_ELEMS, ROW_LINES,
                    BATCHED, (PREFETCH & 2) != 0)
    wait_only(USE_PDL)
    stamp(prof_ptr, pid, 1, PROFILE)

    if RUN_A:
        prefetch_rows(wo_ptr, pid, P, H, HD, 0, BN_O, 1, False, ESZ, (PREFETCH & 4) != 0)
        prefetch_lead(wo_ptr, pid, P, H, HD, 0, BN_O, 1, False, ESZ, AHEAD_O)
        if BATCHED:
            ss1 = sum_squares_rows(x_ptr, res_ptr, r1_ptr, pid, M, H, HAS_RES, BLOCK_M,
                                   SS_BLOCK)
            skinny_phase(pid, P, M, x_ptr, res_ptr, ln1_ptr, tl.rsqrt(ss1 / H + eps), wqkv_ptr,
                         qkv_ptr, x_ptr, N_QKV, H, 0, BLOCK_M, BN_QKV, BK_QKV, 1, HAS_RES, True,
                         False, False, UPCAST, IEEE, AHEAD_QKV, ESZ, False)
        else:
            ss1 = sum_squares(x_ptr, res_ptr, r1_ptr, pid, H, HAS_RES, SS_BLOCK)
            gemv_phase(pid, P, x_ptr, res_ptr, ln1_ptr, tl.rsqrt(ss1 / H + eps), wqkv_ptr,
                       qkv_ptr, x_ptr, N_QKV, H, 0, BN_QKV, BK_QKV, 1, HAS_RES, True, False,
                       False, AHEAD_QKV, ESZ)
    stamp(prof_ptr, pid, 2, PROFILE)
    grid_barrier(bar_ptr + 0, P, err_ptr, SYNC, POLL_LOAD)
    stamp(prof_ptr, pid, 3, PROFILE)

    if RUN_B:
        prefetch_rows(wgu_ptr, pid, P, INTER, H, gu_up_off, BN_GU, GU_ROW_MUL, GU_ROW_MUL == 1,
                      ESZ, (PREFETCH & 8) != 0)
        prefetch_lead(wgu_ptr, pid, P, INTER, H, gu_up_off, BN_GU, GU_ROW_MUL, GU_ROW_MUL == 1,
                      ESZ, AHEAD_GU)
        attention_phase(pid, P, M, qkv_ptr, k_ptr, v_ptr, bt_ptr, seq_ptr, pos_ptr, slot_ptr,
                        cs_ptr, qw_ptr, kw_ptr, part_ptr, lse_ptr, attn_ptr,
                        bar_ptr + _NB + 1, kv_cap, kv_budget, qk_eps, scale_log2, stride_cs,
                        stride_bt, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                        stride_vh, HQ, HK, HEAD_DIM, KV_BLOCK_SIZE, GROUP, GROUP_P, SPLITS,
                        SPLITS_P, ATT_BLOCK_N, Q_NORM, K_NORM, BATCHED, (PREFETCH & 2) != 0,
                        KV_SPAN, LINE_ELEMS, ROW_LINES, ATT_M, ATT_DOT, UPCAST)
    stamp(prof_ptr, pid, 4, PROFILE)
    grid_barrier(bar_ptr + 1, P, err_ptr, SYNC, POLL_LOAD)
    stamp(prof_ptr, pid, 5, PROFILE)

    if RUN_C:
        prefetch_rows(wd_ptr, pid, P, H, INTER, 0, BN_D, 1, False, ESZ, (PREFETCH & 16) != 0)
        prefetch_lead(wd_ptr, pid, P, H, INTER, 0, BN_D, 1, False, ESZ, AHEAD_D)
        # the next layer's QKV rows: its programs cannot start (nor prefetch) before ours exit
        prefetch_rows(wqkv_next_ptr, pid, P, N_QKV, H, 0, BN_QKV, 1, False, ESZ, PREFETCH_NEXT)
        if BATCHED:  # one sum of squares a row and program
            ss2 = skinny_phase(pid, P, M, attn_ptr, attn_ptr, attn_ptr,
                               tl.full([BLOCK_M], 1.0, tl.float32), wo_ptr, r2_ptr, r1_ptr, H,
                               HD, 0, BLOCK_M, BN_O, BK_O, 1, False, False, False, True, UPCAST,
                               IEEE, AHEAD_O, ESZ, False)
            tl.store(ss_ptr + pid * BLOCK_M + tl.arange(0, BLOCK_M), ss2)
        else:
            ss2 = gemv_phase(pid, P, attn_ptr, attn_ptr, attn_ptr, 1.0, wo_ptr, r2_ptr, r1_ptr,
                             H, HD, 0, BN_O, BK_O, 1, False, False, False, True, AHEAD_O, ESZ)
            tl.store(ss_ptr + pid, ss2)
    stamp(prof_ptr, pid, 6, PROFILE)
    grid_barrier(bar_ptr + 2, P, err_ptr, SYNC, POLL_LOAD)
    stamp(prof_ptr, pid, 7, PROFILE)

    if RUN_D:
        offs_p = tl.arange(0, SS_P)
        if BATCHED:
            offs_m = tl.arange(0, BLOCK_M)
            ss_all = tl.load(ss_ptr + offs_p[:, None] * BLOCK_M + offs_m[None, :],
                             mask=(offs_p < P)[:, None], other=0.0, cache_modifier=".cg")
            skinny_phase(pid, P, M, r2_ptr, r2_ptr, ln2_ptr,
                         tl.rsqrt(tl.sum(ss_all, 0) / H + eps), wgu_ptr, act_ptr, r2_ptr, INTER,
                         H, gu_up_off, BLOCK_M, BN_GU, BK_GU, GU_ROW_MUL, False, True, True,
                         False, UPCAST, IEEE, AHEAD_GU, ESZ, GU_ROW_MUL == 1)
        else:
            ss_all = tl.load(ss_ptr + offs_p, mask=offs_p < P, other=0.0, cache_modifier=".cg")
            gemv_phase(pid, P, r2_ptr, r2_ptr, ln2_ptr, tl.rsqrt(tl.sum(ss_all, 0) / H + eps),
                       wgu_ptr, act_ptr, r2_ptr, INTER, H, gu_up_off, BN_GU, BK_GU, GU_ROW_MUL,
                       False, True, True, False, AHEAD_GU, ESZ, GU_ROW_MUL == 1)
    stamp(prof_ptr, pid, 8, PROFILE)
    grid_barrier(bar_ptr + 3, P, err_ptr, SYNC, POLL_LOAD)
    stamp(prof_ptr, pid, 9, PROFILE)
    release_only(USE_PDL)  # the next launch is queued; its programs start as ours exit

    if RUN_E:
        if BATCHED:
            skinny_phase(pid, P, M, act_ptr, act_ptr, act_ptr, tl.full([BLOCK_M], 1.0, tl.float32),
                         wd_ptr, out_ptr, act_ptr, H, INTER, 0, BLOCK_M, BN_D, BK_D, 1, False,
                         False, False, False, UPCAST, IEEE, AHEAD_D, ESZ, False)
        else:
            gemv_phase(pid, P, act_ptr, act_ptr, act_ptr, 1.0, wd_ptr, out_ptr, act_ptr, H, INTER,
                       0, BN_D, BK_D, 1, False, False, False, False, AHEAD_D, ESZ)
    stamp(prof_ptr, pid, 10, PROFILE)
    rearm_counters(bar_ptr, _NB, P, _NB, SYNC)


def _blocks(k: int, rows_per_out: int = 1, cfg: dict = DEFAULT_CONFIG) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) for a GEMV over ``k`` columns: chunks of at most ``block_k``
    columns (fewer for a short K), rows so a step loads ``tile`` weights (both gate|up
    halves together)."""
    block_k = min(cfg["block_k"], max(16, triton.next_power_of_2(k)))
    return max(1, cfg["tile"] // (block_k * rows_per_out)), block_k


def prefetch_bits(w: LayerWeights, budget: int) -> int:
    """Which weights are prefetched into L2 a phase ahead (bits 1 QKV, 4 o_proj, 8 gate|up,
    16 down): those of at most ``budget`` bytes (half of L2: bigger ones would evict each
    other before use). Bit 2, the K/V rows, is judged on the device (``kv_budget``)."""
    if budget <= 0:
        return 0
    mats = ((1, w.qkv), (4, w.o), (8, w.gate_up), (16, w.down))
    return 2 | sum(bit for bit, m in mats if m.numel() * m.element_size() <= budget)


@functools.lru_cache(maxsize=None)
def _l2_bytes_of(index: int) -> int:
    return int(getattr(torch.cuda.get_device_properties(index), "L2_cache_size", 50 << 20))


def _l2_bytes(device: torch.device) -> int:
    """The device's L2 size (cached)."""
    return _l2_bytes_of(device.index if device.index is not None else torch.cuda.current_device())


def supported(x: torch.Tensor, w: LayerWeights, k_cache: torch.Tensor,
              v_cache: torch.Tensor | None = None,
              block_table: torch.Tensor | None = None) -> str | None:
    """Why the one-launch layer cannot run these tensors (None: it can)."""
    v_cache = k_cache if v_cache is None else v_cache
    d = w.head_dim
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_BATCH:
        return f"needs 1 to {MAX_BATCH} tokens (one a request)"
    if block_table is not None and (block_table.dim() != 2 or block_table.shape[1] < 1
                                    or block_table.shape[0] < x.shape[0]):
        return "needs a block table of a row a request"
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"dtype {x.dtype}"
    mats = (w.qkv, w.o, w.gate_up, w.down)
    if any(m.dtype != x.dtype or not m.is_contiguous() for m in mats):
        return "weights must be contiguous and of the activations' dtype"
    if d & (d - 1) or not 16 <= d <= 256 or w.num_heads % w.num_kv_heads:
        return "head_dim must be a power of two in 16..256, heads a multiple of KV heads"
    if any(c.dtype != x.dtype or c.stride(-1) != 1 or c.dim() != 4
           or tuple(c.shape[2:]) != (w.num_kv_heads, d) for c in (k_cache, v_cache)) \
            or k_cache.shape != v_cache.shape:
        return "KV cache dtype, layout or heads"
    h, inter = x.shape[1], w.gate_up.shape[0] // 2
    if (w.qkv.shape != ((w.num_heads + 2 * w.num_kv_heads) * d, h) or w.gate_up.shape[0] % 2
            or w.o.shape != (h, w.num_heads * d) or w.gate_up.shape[1] != h
            or w.down.shape != (h, inter) or w.input_norm.shape != (h,)
            or w.post_norm.shape != (h,)):
        return "projection shapes do not chain"
    return None


def decode_layer_triton(x, residual, w: LayerWeights, positions, cos_sin_cache, k_cache, v_cache,
                        slot_mapping, block_table, seq_lens, max_seq_len_upper_bound: int,
                        scale: float, *, next_qkv: torch.Tensor | None = None,
                        phased: bool | None = None, programs: int | None = None,
                        splits: int | None = None, block_n: int | None = None,
                        config: dict | None = None, profile: torch.Tensor | None = None):
    """``(out, new_residual)`` of one decoder layer for ``M = x.shape[0]`` tokens, token
    ``m`` the only query token of request ``m`` (``M`` <= ``MAX_BATCH``; above 1 the
    batched phases, ``kernels.decode_layer_batched``), as
    ``kernels.reference.decode_layer_reference``; writes the tokens' K/V to the cache.
    ``residual`` None: the first layer (``x`` is the residual). ``next_qkv``: the next
    layer's QKV weight (same shape), prefetched into L2 during the last phases. ``config``:
    ``DEFAULT_CONFIG`` overrides (default: ``config_from_env()``). ``phased``: one launch a
    phase (always on the interpreter). ``programs``/``splits``/``block_n`` override the
    grid, the split count and the attention's tile width (tests). ``profile``: an int64
    ``[programs, 32]`` buffer that receives each program's timestamps (``PROFILE_STAMPS``;
    compiled only, for benchmarks). Returns None when
    ``supported`` refuses, or inside a CUDA-graph capture before any eager launch made the
    counter buffer (the caller then runs the layer op by op)."""
    if supported(x, w, k_cache, v_cache, block_table) is not None:
        return None
    cfg = dict(config_from_env(), **(config or {}))
    dev, dt = x.device, x.dtype
    hq, hk, d = w.num_heads, w.num_kv_heads, w.head_dim
    h, n_qkv, inter = x.shape[1], w.qkv.shape[0], w.gate_up.shape[0] // 2
    m = x.shape[0]
    batched = m > 1
    interpreted = not x.is_cuda or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    p = programs or (pdl.sm_count(dev) if x.is_cuda else 4)
    group = hq // hk
    group_p = triton.next_power_of_2(group)
    # tensor-core attention tiles: the group's rows padded to one 16-row MMA tile, at least
    # 16 keys (float32 activations keep the FMA tiles: a float32 tl.dot would round to tf32)
    att_dot = bool(cfg["att_dot"]) and dt != torch.float32 and (block_n or 16) >= 16
    att_m = max(16, group_p) if att_dot else group_p
    # batched: half the attention rows (the tensor-core phases need the registers)
    # (head_dim 256 halves the keys: a 64 x 256 tile spilled, review 2026-12-05)
    att_block_n = block_n or (max(16, cfg["att_keys"] * 128 // max(d, 128)) if att_dot else
                              max(8, cfg["att_rows"] // (2 if batched else 1) // group_p))
    # not scaled down by the batch: one compiled variant for every batch size (a batch's
    # M * HK * n_splits items are walked round-robin; splits past a row's length skip)
    n_splits = splits or max(1, min(MAX_SPLITS, p // hk,
                                    triton.cdiv(max_seq_len_upper_bound, att_block_n)))
    # sized for the largest batch at once: a bigger buffer first asked for inside a graph
    # capture could not be made, and the layer would fall back to the op-by-op path there
    bars = grid_sync.counters(dev, N_BARRIERS + 1 + MAX_BATCH * hk)
    if bars is None:
        return None
    phased = interpreted if phased is None else (phased or interpreted)
    if profile is not None and (interpreted or phased or tuple(profile.shape) != (p, 32)
                                or profile.dtype != torch.int64):
        raise ValueError(f"profile needs one compiled launch and an int64 [{p}, 32] buffer")
    x = x.contiguous()
    res = residual.contiguous() if residual is not None else x
    empty = lambda *shape, dtype=dt: torch.empty(shape, dtype=dtype, device=dev)  # noqa: E731
    qkv, r1, attn, r2, act, out = (empty(m, n_qkv), empty(m, h), empty(m, hq * d), empty(m, h),
                                   empty(m, inter), empty(m, h))
    part = empty(n_splits, m, hq, d, dtype=torch.float32)
    lse = empty(n_splits, m, hq, dtype=torch.float32)
    ss = empty(p * (MAX_BATCH if batched else 1), dtype=torch.float32)
    kv_cap = max(1, min(triton.cdiv(max_seq_len_upper_bound, k_cache.shape[1]),
                        block_table.shape[1]))  # >= 1 block: the split plan divides by tiles
    if batched:  # tensor-core tiles: 16 padded rows x BATCH_BLOCK_N weight rows
        bk = lambda k: min(BATCH_BLOCK_K, max(16, triton.next_power_of_2(k)))  # noqa: E731
        # 16 weight rows where 32 would leave programs without a row block (0.6B o_proj, down)
        bn = lambda n: BATCH_BLOCK_N if triton.cdiv(n, BATCH_BLOCK_N) >= p else 16  # noqa: E731
        bn_qkv, bk_qkv = bn(n_qkv), bk(h)
        bn_o, bk_o = bn(h), bk(hq * d)
        bn_gu, bk_gu = 16, bk(h)
        bn_d, bk_d = bn(h), bk(inter)
    else:
        bn_qkv, bk_qkv = _blocks(h, 1, cfg)
        bn_o, bk_o = _blocks(hq * d, 1, cfg)
        bn_gu, bk_gu = _blocks(h, 2, cfg)
        bn_d, bk_d = _blocks(inter, 1, cfg)
    mats = (w.qkv, w.o, w.gate_up, w.down)
    prefetch = bool(cfg["prefetch"]) and not interpreted and pdl.rows_prefetchable(x, *mats) \
        and all((t.shape[1] * t.element_size()) % 16 == 0 for t in mats)
    budget = _l2_bytes(dev) // 2 if prefetch else 0
    pf_bits = prefetch_bits(w, budget)
    # K/V rows: what L2 holds besides the weights prefetched while attention reads them
    live = sum(t.numel() * t.element_size() for bit, t in ((4, w.o), (8, w.gate_up))
               if pf_bits & bit)
    kv_budget = max(0, 3 * budget // 2 - live) // (2 * hk * d * k_cache.element_size())
    ahead = {bit: 0 if (pf_bits & bit or not prefetch) else cfg["ahead"]
             for bit in (1, 4, 8, 16)}
    nxt_ok = (next_qkv is not None and next_qkv.shape == w.qkv.shape and next_qkv.is_contiguous()
              and next_qkv.dtype == dt)
    prefetch_next = bool(pf_bits & 1) and bool(cfg["prefetch_next"]) and nxt_ok \
        and pdl.rows_prefetchable(x, next_qkv)
    args = (
        x, res, w.input_norm, w.qkv, next_qkv if prefetch_next else w.qkv, qkv, r1,
        k_cache, v_cache, block_table, seq_lens, positions, slot_mapping, cos_sin_cache,
        w.q_norm if w.q_norm is not None else x, w.k_norm if w.k_norm is not None else x,
        part, lse, attn, w.o, r2, ss, w.post_norm, w.gate_up, act, w.down, out, bars[1:],
        bars[grid_sync.ERROR_INDEX:], profile if profile is not None else bars,
        m, h, n_qkv, inter, 1 if w.gate_up_pairs else inter, kv_cap * k_cache.shape[1], kv_budget,
        float(w.eps), float(w.qk_eps), float(scale) * LOG2E, cos_sin_cache.stride(0),
        block_table.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
    )
    const = dict(
        HQ=hq, HK=hk, HEAD_DIM=d, KV_BLOCK_SIZE=k_cache.shape[1], GROUP=group, GROUP_P=group_p,
        SPLITS=n_splits, SPLITS_P=triton.next_power_of_2(n_splits), ATT_BLOCK_N=att_block_n,
        ATT_M=att_m, ATT_DOT=att_dot,
        Q_NORM=w.q_norm is not None, K_NORM=w.k_norm is not None, HAS_RES=residual is not None,
        GU_ROW_MUL=2 if w.gate_up_pairs else 1, SS_P=triton.next_power_of_2(p),
        BN_QKV=bn_qkv, BK_QKV=bk_qkv, BN_O=bn_o, BK_O=bk_o, BN_GU=bn_gu, BK_GU=bk_gu,
        BN_D=bn_d, BK_D=bk_d, PREFETCH=pf_bits, PREFETCH_NEXT=prefetch_next,
        ESZ=x.element_size(), KV_SPAN=256, **row_lines(d, k_cache.element_size()),
        POLL_LOAD=bool(cfg["poll_load"]) and not interpreted,
        SS_BLOCK=min(512 if batched else 16384, triton.next_power_of_2(h)), AHEAD_QKV=ahead[1], AHEAD_O=ahead[4],
        AHEAD_GU=ahead[8], AHEAD_D=ahead[16], BATCHED=batched, BLOCK_M=MAX_BATCH,
        UPCAST=interpreted and dt != torch.float32, IEEE=dt == torch.float32,
        PROFILE=profile is not None,
        num_warps=cfg["num_warps"], num_stages=1,
    )
    if phased:
        for i in range(5):
            run = {f"RUN_{c}": i == j for j, c in enumerate("ABCDE")}
            _decode_layer_kernel[(p,)](*args, **const, **run, SYNC=False)
    else:
        run = {f"RUN_{c}": True for c in "ABCDE"}
        _decode_layer_kernel[(p,)](*args, **const, **run, SYNC=True, **pdl.launch_kwargs(x))
    return out, r2
