"""Batch-1 decode: o_proj -> (+residual) RMSNorm -> gate|up -> SiLU*mul -> down in ONE launch.

Status (H200, 2026-12-04): correct (GPU tests, greedy vs transformers) but slower than the
three launches it replaces, so off unless ``SYNCLESS_FUSED_MLP=1``: configs spread
112-214 us on the 8B shape against 101.5 unfused, by bytes in flight per SM. The next
step is deeper weight streaming inside the phases, both in and swept by ``kernels.bench
--only mlp-block`` but not yet measured on the GPU: ``depth=2`` (two register tiles ahead)
and ``use_dot`` (the activation as row 0 of a 16-row tensor-core operand, so the compiler
streams weight tiles through ``num_stages`` cp.async stages in shared memory: Triton
pipelines only loads that feed a dot, and only with sizes it can prove are multiples of 16,
which the JIT does for these shapes; ``pre_l2`` bytes of each first-block row are
bulk-prefetched into L2 before each barrier instead of the register preload).

At batch 1 each of a layer's GEMVs loses a fixed ~4-5 us to its kernel boundary
(launch gap, the first DRAM round trip, the drain of the last loads; measured on the
H200 with ``kernels.bench --only gemv``), whatever the tiling. This kernel runs the
three projections after attention as phases of one persistent grid of ``P`` programs
(at most one per SM, so all are resident at once), separated by two grid barriers.
Before each barrier a program already loads its first weight tile of the next phase
(weights are never written during a step), so DRAM keeps streaming while the
barrier settles; the boundary costs a barrier, not a ramp.

Phases, each a flat walk over (row block, K chunk) with the next tile (``depth`` 2: the
next two) in flight:

1. ``o = attn @ Wo^T`` (rounded to the dtype, into a scratch vector).
2. barrier; every program recomputes ``rstd`` of ``s = o + residual`` (program 0
   stores ``s``, the new residual); ``gu = norm(s) @ Wgu^T`` as a plain GEMV over
   all ``2I`` rows (gate and up rounded to the dtype, into scratch).
3. barrier; ``h = (silu(gate) * up) @ Wd^T``, the activation computed per K chunk.

Rounding is the unfused path's (``kernels.reference.skinny_linear_reference`` three
times), with the skinny GEMM's one shift: the normalised input is rounded before the
``rstd`` scale. Scratch written by other programs is read with ``.cg`` (L2, not a
stale L1) after an acquire barrier. The barrier counter is re-armed by the last
program to leave, so launches and graph replays need no memset. Under PDL the first
weight tile is loaded before the wait, and dependents are released only after the last
barrier (when every program is resident: an early dependent must not take the SM
a program of ours still needs). Tensor parallelism would put an all-reduce between
phases 1 and 2, so the model uses this only at ``tp == 1``. One barrier counter pair per
device: launches on one stream at a time (the engine's model stream), never concurrently
from two streams or processes sharing the SMs (MPS), which could also starve residency.
"""

from __future__ import annotations

import os
import warnings

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.grid_sync import grid_barrier, rearm_counters
from kernels.pdl import prefetch_l2
from kernels.pdl import release_only as _release
from kernels.pdl import wait_only as _wait


@triton.jit
def _tile(w_ptr, stride_wn, N, K, step, total, pid, P, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr):
    """Weight tile of this program's ``step``-th (row block, K chunk); zeros past the end."""
    KT = tl.cdiv(K, BLOCK_K)
    rows = (pid + (step // KT) * P) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = (step % KT) * BLOCK_K + tl.arange(0, BLOCK_K)
    row_end = tl.where(step < total, N, 0)
    ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + ks[None, :]
    return tl.load(ptrs, mask=(rows < row_end)[:, None] & (ks < K)[None, :], other=0.0)


@triton.jit
def _steps(N, K, pid, P, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    n_blocks = tl.cdiv(N, BLOCK_N)
    return tl.cdiv(tl.maximum(n_blocks - pid, 0), P) * tl.cdiv(K, BLOCK_K)


@triton.jit
def _first_tiles(w_ptr, stride_wn, N, K, pid, P, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DEPTH: tl.constexpr, USE_DOT: tl.constexpr, PRE_L2: tl.constexpr):
    """Before a barrier: a phase's first DEPTH weight tiles into registers (the second is
    the first again when DEPTH == 1); with USE_DOT (the compiler's pipeline loads them in
    the loop) the first PRE_L2 bytes of each first-block row are bulk-prefetched into L2."""
    if USE_DOT:
        if PRE_L2 > 0:
            for pr in tl.static_range(BLOCK_N):
                if pid * BLOCK_N + pr < N:
                    prefetch_l2(w_ptr + (pid * BLOCK_N + pr).to(tl.int64) * stride_wn, PRE_L2)
        w_a = 0.0
        w_b = 0.0
    else:
        total = _steps(N, K, pid, P, BLOCK_N, BLOCK_K)
        w_a = _tile(w_ptr, stride_wn, N, K, 0, total, pid, P, BLOCK_N, BLOCK_K)
        if DEPTH == 2:
            w_b = _tile(w_ptr, stride_wn, N, K, 1, total, pid, P, BLOCK_N, BLOCK_K)
        else:
            w_b = w_a
    return w_a, w_b


@triton.jit
def _phase(w_a, w_b, w_ptr, stride_wn, N, K, a_ptr, b_ptr, g_ptr, y_ptr, rstd, pid, P,
           MODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
           DEPTH: tl.constexpr, USE_DOT: tl.constexpr, IEEE: tl.constexpr,
           UPCAST: tl.constexpr):
    """``y[n] = rstd * sum_k W[n, k] * a[k]`` over this program's row blocks, where ``a`` is
    MODE 0: ``a_ptr`` (scratch, .cg); MODE 1: ``((a + b) * g)`` rounded (the norm's input);
    MODE 2: ``silu(a[k]) * a[k + b_off]`` rounded, ``b_ptr`` pointing at the up half.

    FMA form: DEPTH weight tiles are in flight in registers ahead of the one being
    multiplied (1 or 2). USE_DOT form: ``a`` is row 0 of a 16-row tensor-core operand and
    the weight tile is loaded in the loop, so the compiler streams it through shared
    memory with ``num_stages`` cp.async stages in flight (only dot operands get that
    pipeline; FMA loads never do)."""
    DT = w_ptr.dtype.element_ty
    KT = tl.cdiv(K, BLOCK_K)
    total = _steps(N, K, pid, P, BLOCK_N, BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, 16)
    if USE_DOT:
        acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for i in range(0, total):
        if USE_DOT:
            w = _tile(w_ptr, stride_wn, N, K, i, total, pid, P, BLOCK_N, BLOCK_K)
        else:
            w = w_a
            if DEPTH == 2:
                w_a = w_b
                w_b = _tile(w_ptr, stride_wn, N, K, i + 2, total, pid, P, BLOCK_N, BLOCK_K)
            else:
                w_a = _tile(w_ptr, stride_wn, N, K, i + 1, total, pid, P, BLOCK_N, BLOCK_K)
        kc = i % KT
        ks = kc * BLOCK_K + offs_k
        k_ok = ks < K
        a = tl.load(a_ptr + ks, mask=k_ok, other=0.0, cache_modifier=".cg")
        if MODE == 1:
            r = tl.load(b_ptr + ks, mask=k_ok, other=0.0)
            g = tl.load(g_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
            a = ((a.to(tl.float32) + r.to(tl.float32)).to(DT).to(tl.float32) * g).to(DT)
        if MODE == 2:
            up = tl.load(b_ptr + ks, mask=k_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
            gate = a.to(tl.float32)
            a = ((gate / (1.0 + tl.exp(-gate))).to(DT).to(tl.float32) * up).to(DT)
        if USE_DOT:
            a2 = tl.where(offs_m[:, None] == 0, a.to(DT)[None, :],
                          tl.zeros([16, BLOCK_K], dtype=DT))
            if UPCAST:  # the interpreter's dot mishandles bf16: exact fp32 copies instead
                acc += tl.dot(a2.to(tl.float32), tl.trans(w.to(tl.float32)),
                              input_precision="ieee")
            elif IEEE:
                acc += tl.dot(a2, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(a2, tl.trans(w))
        else:
            acc += w.to(tl.float32) * a.to(tl.float32)[None, :]
        if kc == KT - 1:
            rows = (pid + (i // KT) * P) * BLOCK_N + tl.arange(0, BLOCK_N)
            if USE_DOT:
                y = tl.sum(acc, 0) * rstd  # rows 1..15 of the operand are zero
                acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
            else:
                y = tl.sum(acc, 1) * rstd
                acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            tl.store(y_ptr + rows, y.to(DT), mask=rows < N)


@triton.jit
def _mlp_block_kernel(
    attn_ptr, wo_ptr, res_ptr, nw_ptr, wgu_ptr, wd_ptr, out_ptr, nres_ptr, o_ptr, gu_ptr,
    bar_ptr, H, A, I, eps, stride_wo, stride_wgu, stride_wd,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False,
    DEPTH: tl.constexpr = 1, USE_DOT: tl.constexpr = False, IEEE: tl.constexpr = False,
    UPCAST: tl.constexpr = False, PRE_L2: tl.constexpr = 0,
):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    DT = wo_ptr.dtype.element_ty
    offs_k = tl.arange(0, BLOCK_K)

    # phase 1: o = attn @ Wo^T ([H], K = A)
    w0a, w0b = _first_tiles(wo_ptr, stride_wo, H, A, pid, P, BLOCK_N, BLOCK_K, DEPTH,
                              USE_DOT, PRE_L2)
    _wait(USE_PDL)
    _phase(w0a, w0b, wo_ptr, stride_wo, H, A, attn_ptr, attn_ptr, attn_ptr, o_ptr, 1.0, pid, P,
           0, BLOCK_N, BLOCK_K, DEPTH, USE_DOT, IEEE, UPCAST)
    w1a, w1b = _first_tiles(wgu_ptr, stride_wgu, 2 * I, H, pid, P, BLOCK_N, BLOCK_K, DEPTH,
                              USE_DOT, PRE_L2)
    grid_barrier(bar_ptr, P, bar_ptr + 2, True)

    # phase 2: s = o + residual, rstd, gu = norm(s) @ Wgu^T ([2I], K = H)
    ss = tl.zeros([BLOCK_K], dtype=tl.float32)
    res_end = tl.where(pid == 0, H, 0)  # program 0 stores the new residual
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < H
        o = tl.load(o_ptr + ks, mask=k_ok, other=0.0, cache_modifier=".cg")
        r = tl.load(res_ptr + ks, mask=k_ok, other=0.0)
        s = (o.to(tl.float32) + r.to(tl.float32)).to(DT)
        tl.store(nres_ptr + ks, s, mask=ks < res_end)
        sf = s.to(tl.float32)
        ss += sf * sf
    rstd = tl.rsqrt(tl.sum(ss, 0) / H + eps)
    _phase(w1a, w1b, wgu_ptr, stride_wgu, 2 * I, H, o_ptr, res_ptr, nw_ptr, gu_ptr, rstd, pid,
           P, 1, BLOCK_N, BLOCK_K, DEPTH, USE_DOT, IEEE, UPCAST)
    w2a, w2b = _first_tiles(wd_ptr, stride_wd, H, I, pid, P, BLOCK_N, BLOCK_K, DEPTH,
                              USE_DOT, PRE_L2)
    grid_barrier(bar_ptr, 2 * P, bar_ptr + 2, True)
    _release(USE_PDL)  # every program is resident now: a dependent may take free slots

    # phase 3: h = (silu(gate) * up) @ Wd^T ([H], K = I)
    _phase(w2a, w2b, wd_ptr, stride_wd, H, I, gu_ptr, gu_ptr + I, gu_ptr, out_ptr, 1.0, pid, P,
           2, BLOCK_N, BLOCK_K, DEPTH, USE_DOT, IEEE, UPCAST)

    # re-arm: the last program out resets the counter (all have passed both barriers)
    rearm_counters(bar_ptr, 1, P, 1, True)


# The fastest measured on the H200 for the Llama-3.1-8B shape (111.9 us; the three unfused
# launches take 101.5, so ops.mlp_block keeps this off by default). A tuning-table entry
# "mlp_block|m1|HxAxI" (kernels.bench --only mlp-block --tuning-out) overrides it per
# shape, null meaning the unfused path is faster.
DEFAULT_CONFIG = dict(block_n=16, block_k=512, num_warps=8, ctas_per_sm=2)

_BARRIERS: dict[tuple[str, int], torch.Tensor] = {}


def tuning_key(h: int, a: int, inter: int) -> str:
    return f"mlp_block|m1|{h}x{a}x{inter}"


def select_config(h: int, a: int, inter: int) -> dict | None:
    """This shape's config, or None where the unfused three launches were measured faster."""
    from kernels.skinny_gemm import _tuning

    table = _tuning()
    key = tuning_key(h, a, inter)
    if key in table:
        return None if table[key] is None else dict(DEFAULT_CONFIG, **table[key])
    return dict(DEFAULT_CONFIG)


def _barrier(device: torch.device) -> torch.Tensor | None:
    """The device's zeroed [arrivals, exits, barrier timeouts (sticky)] counters, or None
    while capturing a CUDA graph before they exist (allocating then would tie them to the
    graph's pool)."""
    key = (device.type, device.index if device.index is not None else -1)
    buf = _BARRIERS.get(key)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = _BARRIERS[key] = torch.zeros(3, dtype=torch.int32, device=device)
    return buf


def resident_per_sm(n_regs: int, num_warps: int, shared: int, device_index: int) -> int:
    """How many programs of a compiled kernel fit on one SM at once (registers, threads,
    shared memory): the grid barrier needs every program resident."""
    props = torch.cuda.get_device_properties(device_index)
    regs = getattr(props, "regs_per_multiprocessor", 65536)
    threads = getattr(props, "max_threads_per_multi_processor", 2048)
    smem = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
    per_warp = -(-max(n_regs, 1) // 8) * 8 * 32
    # conservative: a block's warps as if spread over whole 4-warp sub-partition sets, and
    # the 1 KB of shared memory the driver reserves per block
    warp_slots = -(-num_warps // 4) * 4
    fits = min(regs // (per_warp * warp_slots), threads // (32 * num_warps), 32)
    fits = min(fits, smem // (shared + 1024))
    return max(fits, 0)


_GRIDS: dict[tuple, int] = {}


def _grid_programs(args: tuple, consts: dict, cfg: dict, device: torch.device) -> int:
    """Programs for this config on this device: ``ctas_per_sm`` per SM, capped by what
    the compiled kernel can keep resident (compiled once per specialisation, without
    launching). The key holds what Triton specialises on (dtype, sizes and strides, whose
    16-divisibility changes the compiled kernel and its registers), not only the config."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    spec = tuple((a.dtype, tuple(a.shape)) if torch.is_tensor(a) else a
                 for a in args if not isinstance(a, float))
    key = (idx, tuple(sorted(consts.items())), cfg["ctas_per_sm"], spec)
    if key not in _GRIDS:
        try:
            compiled = _mlp_block_kernel.warmup(*args, grid=(1,), **consts)
            compiled._init_handles()
            fits = resident_per_sm(compiled.n_regs, consts["num_warps"],
                                   compiled.metadata.shared, idx)
        except Exception as e:  # an older triton without warmup/n_regs: one a SM is safe
            warnings.warn(f"mlp block: cannot read the kernel's resources ({e!r}); "
                          "one program an SM", RuntimeWarning, stacklevel=3)
            fits = 1
        if fits < 1:
            raise RuntimeError(f"mlp block config {cfg} does not fit on an SM")
        _GRIDS[key] = pdl.sm_count(device) * min(cfg["ctas_per_sm"], fits)
    return _GRIDS[key]


def _pre_l2_bytes(cfg: dict, x: torch.Tensor, weights, block_k: int) -> int:
    """Bytes of each first-block row a dot-form phase bulk-prefetches into L2 before its
    barrier (``pre_l2``; 0 off): 16-byte multiples, aligned rows, sm_90+, not interpreted."""
    want = int(cfg.get("pre_l2", 0))
    if want <= 0 or not pdl.rows_prefetchable(x, *weights):
        return 0
    nbytes = min(want, min(w.shape[1] for w in weights) * x.element_size())
    return nbytes - nbytes % 16


def mlp_block_ready(x: torch.Tensor) -> bool:
    """Whether ``mlp_block_triton`` can launch for ``x`` now (the barrier counters exist,
    or may be allocated because no graph is being captured)."""
    return _barrier(x.device) is not None


def mlp_block_triton(attn, wo, residual, norm_weight, eps: float, w_gate_up, w_down, *,
                     config: dict | None = None, max_programs: int | None = None):
    """``(h, new_residual)`` for ``attn [1, A]``, ``wo [H, A]``, ``residual [1, H]``,
    ``w_gate_up [2I, H]`` (gate rows then up rows), ``w_down [H, I]``. ``max_programs``
    bounds the grid (the interpreter runs programs one after another, so a grid barrier
    there needs a single program)."""
    h_dim, a_dim = wo.shape
    inter = w_down.shape[1]
    if attn.shape != (1, a_dim) or residual.shape != (1, h_dim) or norm_weight.shape != (h_dim,) \
            or w_gate_up.shape != (2 * inter, h_dim) or w_down.shape != (h_dim, inter):
        raise ValueError(
            f"mlp block shapes do not chain: attn {tuple(attn.shape)}, wo {tuple(wo.shape)}, "
            f"residual {tuple(residual.shape)}, norm {tuple(norm_weight.shape)}, gate_up "
            f"{tuple(w_gate_up.shape)}, down {tuple(w_down.shape)}")
    bar = _barrier(attn.device)
    if bar is None:
        raise RuntimeError("mlp_block_triton: first call inside a CUDA graph capture "
                           "(check mlp_block_ready first)")
    attn, residual = attn.contiguous(), residual.contiguous()
    cfg = dict(DEFAULT_CONFIG, **(config or {}))
    dev = attn.device
    out = torch.empty((1, h_dim), dtype=attn.dtype, device=dev)
    new_res = torch.empty((1, h_dim), dtype=attn.dtype, device=dev)
    o = torch.empty(h_dim, dtype=attn.dtype, device=dev)
    gu = torch.empty(2 * inter, dtype=attn.dtype, device=dev)
    block_k = min(cfg["block_k"], triton.next_power_of_2(max(16, min(h_dim, a_dim, inter))))
    depth = int(cfg.get("depth", 1))
    if depth not in (1, 2):
        raise ValueError(f"mlp block prefetch depth must be 1 or 2, got {depth}")
    use_dot = bool(cfg.get("use_dot", False))
    block_n = cfg["block_n"]
    if use_dot and (block_n < 16 or block_n & (block_n - 1)):
        raise ValueError(f"the tensor-core mlp block needs block_n a power of 2 >= 16, got {block_n}")
    consts = dict(BLOCK_N=block_n, BLOCK_K=block_k, DEPTH=depth, USE_DOT=use_dot,
                  IEEE=attn.dtype == torch.float32,
                  UPCAST=(not attn.is_cuda) and attn.dtype == torch.bfloat16,
                  PRE_L2=_pre_l2_bytes(cfg, attn, (wo, w_gate_up, w_down), block_k) if use_dot
                  else 0,
                  num_warps=cfg["num_warps"],
                  num_stages=int(cfg.get("num_stages", 3 if use_dot else 1)),
                  **pdl.launch_kwargs(attn))
    args = (attn, wo, residual, norm_weight, w_gate_up, w_down, out, new_res, o, gu, bar,
            h_dim, a_dim, inter, float(eps), wo.stride(0), w_gate_up.stride(0),
            w_down.stride(0))
    if not attn.is_cuda or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        programs = 1  # the interpreter runs programs one after another: one passes barriers
    else:
        programs = _grid_programs(args, consts, cfg, dev)
    if max_programs is not None:
        programs = min(programs, max_programs)
    _mlp_block_kernel[(max(1, programs),)](*args, **consts)
    return out, new_res
