"""Triton skinny GEMM (decode-sized M) with fused RMSNorm prologue and SiLU*mul epilogue.

``y = act(norm(x [+ residual]) @ W^T + b)`` for ``x [M, K]`` with small ``M``
(decode batches), ``W [N, K]`` row-major as ``nn.Linear`` stores it. At decode
the projections are bound by reading ``W`` once; every program owns
``BLOCK_N`` output columns for all ``M`` rows, so ``W`` is read exactly once
and the ``M`` rows of ``x`` come from L2.

Fusions, each removing a launch per layer (and its round trip through HBM):

* **RMSNorm prologue** (``norm_weight``, optional ``residual``): the input
  ``s = x + residual`` (rounded to the dtype; program 0 stores it as the new
  residual) is normalised on the fly. Each program accumulates ``sum(s^2)``
  over its K loop, multiplies ``s * norm_weight`` into the product and scales
  the result by ``rstd`` at the end: ``W @ (rstd * s * g) = rstd * (W @ (s * g))``.
  The math is the reference's; only the rounding point of the normalised input
  moves (it is rounded before the ``rstd`` scale rather than after), so results
  agree within 16-bit tolerance, not bit for bit.
* **SiLU-and-mul epilogue** (``act="silu_and_mul"`` on a fused gate|up weight
  ``[2I, K]``): the program computes gate rows ``n`` and up rows ``I + n``
  together and writes ``silu(gate) * up`` (rounded like the reference: gate and
  up to the dtype, silu to the dtype, the product to the dtype).
  ``act="silu_and_mul_pairs"`` takes the row-interleaved layout instead (gate row
  ``n`` at ``2n``, up row ``n`` at ``2n + 1``): a program then streams one
  contiguous row set, as a plain GEMV does, and splits the pairs in registers.

* **Norm handoff** (``kernels.norm_handoff``): ``EPI_NORM`` does the next RMSNorm's
  elementwise part in the epilogue (residual add, ``s * g``, sum-of-squares partials);
  ``PRE_NORMED`` streams such an ``s * g`` and applies ``rstd`` from the partials at the end.

``USE_DOT`` picks the tensor-core path (``x`` padded to ``BLOCK_M >= 16`` rows,
``tl.dot`` on a ``[BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N]`` tile, loads
software-pipelined by ``num_stages``); without it (``M == 1`` only) a
``[BLOCK_N, BLOCK_K]`` float32 FMA accumulator is reduced once at the end
(``PREFETCH`` double-buffers the W tile in registers; under PDL, ``PRELOAD`` peels the
first one or two K chunks so their W tiles load before the wait). The sum of squares of
the norm is also kept per lane and reduced once: a reduction inside the
streaming loop costs barriers every iteration (2-10x slower; docs/decisions.md).

Which path and tile a call uses is a CPU decision by weight shape and M class
(1, or 2..16): ``select_config`` reads ``kernels/skinny_tuning.json`` (written
on the target GPU by ``python -m benchmarks.kernels.bench --tune``, or the file named by
the ``skinny_tuning`` option; each entry is the fastest candidate, or null where
the unfused RMSNorm + cuBLAS + SiLU*mul path was faster; a batch-1 entry with
``"kernel": "gemv"`` routes to ``kernels.gemv``), else ``DEFAULTS``.

No host syncs; the grid depends on ``N`` only. ``M`` is not specialised, so
every padded CUDA-graph batch size of one ``BLOCK_M`` shares one compilation.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.norm_handoff import PreNormed, handoff_norm, handoff_rstd
from kernels.pdl import prefetch_l2, wait_and_release
from kernels.tuning_file import load_entries


@triton.jit
def _skinny_step(k0, w, wu, acc, acc_u, ss, x_rows, r_rows, nr_rows, nw_ptr, m_ok, res_ok,
                 offs_k, K, HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr,
                 USE_DOT: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
                 UPCAST: tl.constexpr):
    """One K chunk: the x rows (+ residual, stored by program 0; normalised) against the
    weight tile(s) ``w`` (``wu``: the stacked up rows) already loaded."""
    if EVEN_K:
        x_mask = m_ok[:, None]
    else:
        k_ok = (k0 + offs_k) < K
        x_mask = m_ok[:, None] & k_ok[None, :]
    a = tl.load(x_rows + k0, mask=x_mask, other=0.0)
    if HAS_RES:
        r = tl.load(r_rows + k0, mask=x_mask, other=0.0)
        a = (a.to(tl.float32) + r.to(tl.float32)).to(a.dtype)
        if EVEN_K:
            tl.store(nr_rows + k0, a, mask=res_ok[:, None])
        else:
            tl.store(nr_rows + k0, a, mask=res_ok[:, None] & k_ok[None, :])
    if HAS_NORM:
        af = a.to(tl.float32)
        ss += af * af
        if EVEN_K:
            g = tl.load(nw_ptr + k0 + offs_k).to(tl.float32)
        else:
            g = tl.load(nw_ptr + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        a = (af * g[None, :]).to(a.dtype)
    if USE_DOT:
        if UPCAST:  # the interpreter's dot mishandles bf16: exact fp32 copies instead
            acc += tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            if ACT == 1:
                acc_u += tl.dot(a.to(tl.float32), tl.trans(wu.to(tl.float32)),
                                input_precision="ieee")
        elif IEEE:
            acc += tl.dot(a, tl.trans(w), input_precision="ieee")
            if ACT == 1:
                acc_u += tl.dot(a, tl.trans(wu), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(w))
            if ACT == 1:
                acc_u += tl.dot(a, tl.trans(wu))
    else:
        af1 = a.to(tl.float32)  # [1, BLOCK_K], broadcast over the BLOCK_N rows
        acc += w.to(tl.float32) * af1
        if ACT == 1:
            acc_u += wu.to(tl.float32) * af1
    return acc, acc_u, ss


@triton.jit
def _first_tiles(w_rows, mask, up_rows_off, ACT: tl.constexpr):
    """The first K chunk's weight tile and (stacked gate|up) its up tile (else the same)."""
    w = tl.load(w_rows, mask=mask, other=0.0)
    wu = w
    if ACT == 1:
        wu = tl.load(w_rows + up_rows_off, mask=mask, other=0.0)
    return w, wu


@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(
    x_ptr, r_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, nr_ptr, ss_ptr,
    M, N_OUT, K, up_off, eps, n_parts,
    stride_xm, stride_rm, stride_wn, stride_ym, stride_nrm,
    HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
    USE_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, PREFETCH: tl.constexpr,
    PREFETCH_L2: tl.constexpr = 0, PRELOAD: tl.constexpr = 0, USE_PDL: tl.constexpr = False,
    EPI_NORM: tl.constexpr = False, PRE_NORMED: tl.constexpr = False, BLOCK_P: tl.constexpr = 1,
):
    pid = tl.program_id(0)
    DT = x_ptr.dtype.element_ty
    if PREFETCH_L2 > 0:
        # The first PREFETCH_L2 bytes of each of this program's weight rows (the K-tiles
        # it reads first) are requested at once, before the PDL wait, so HBM streams them
        # while the previous kernel (attention, a norm) is still running.
        w_first = w_ptr + (pid * BLOCK_N).to(tl.int64) * stride_wn
        for pr in tl.static_range(BLOCK_N):
            if pid * BLOCK_N + pr < (2 * N_OUT if ACT == 2 else N_OUT):  # weight rows
                prefetch_l2(w_first + pr * stride_wn, PREFETCH_L2)
                if ACT == 1:
                    prefetch_l2(w_first + (up_off + pr) * stride_wn, PREFETCH_L2)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    res_ok = m_ok & ((offs_m * 0 + pid) == 0)  # program 0 stores the new residual
    if ACT == 2:  # BLOCK_N interleaved weight rows -> BLOCK_N // 2 outputs
        n_ok = offs_n < 2 * N_OUT
    else:
        n_ok = offs_n < N_OUT
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    x_rows = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    r_rows = r_ptr + offs_m[:, None] * stride_rm + offs_k[None, :]
    nr_rows = nr_ptr + offs_m[:, None] * stride_nrm + offs_k[None, :]
    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    # sum(s^2) kept per lane and reduced once after the loop: a cross-thread
    # reduction every iteration would put barriers in the streaming loop.
    ss = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    # The first weight tile (no kernel writes weights) is in flight before the PDL wait
    # for the kernel that produced x and the residual: with register double-buffering
    # (PREFETCH), or as PRELOAD (1 or 2) peeled K chunks (the host's choice under PDL).
    # (The host never sets both: a peeled chunk would be counted twice.)
    first_mask = n_ok[:, None] & (offs_k[None, :] < K)
    if PREFETCH or PRELOAD >= 1:
        w_nxt, wu_nxt = _first_tiles(w_rows, first_mask, up_off * stride_wn, ACT)
    if PRELOAD >= 2:
        w_2, wu_2 = _first_tiles(w_rows + BLOCK_K, n_ok[:, None] & (BLOCK_K + offs_k[None, :] < K),
                                 up_off * stride_wn, ACT)
    wait_and_release(USE_PDL)

    k_first = 0
    if PRELOAD >= 1:
        acc, acc_u, ss = _skinny_step(0, w_nxt, wu_nxt, acc, acc_u, ss, x_rows, r_rows,
                                      nr_rows, nw_ptr, m_ok, res_ok, offs_k, K, HAS_NORM,
                                      HAS_RES, ACT, USE_DOT, EVEN_K, IEEE, UPCAST)
        k_first = BLOCK_K
    if PRELOAD >= 2:
        if K > BLOCK_K:  # (x rows past K must not be read)
            acc, acc_u, ss = _skinny_step(BLOCK_K, w_2, wu_2, acc, acc_u, ss, x_rows, r_rows,
                                          nr_rows, nw_ptr, m_ok, res_ok, offs_k, K, HAS_NORM,
                                          HAS_RES, ACT, USE_DOT, EVEN_K, IEEE, UPCAST)
        k_first = 2 * BLOCK_K
    for k0 in range(k_first, K, BLOCK_K):
        if EVEN_K:
            w_mask = n_ok[:, None]
        else:
            w_mask = n_ok[:, None] & ((k0 + offs_k) < K)[None, :]
        if PREFETCH:
            w = w_nxt
            nxt_mask = n_ok[:, None] & ((k0 + BLOCK_K + offs_k) < K)[None, :]
            w_nxt = tl.load(w_rows + (k0 + BLOCK_K), mask=nxt_mask, other=0.0)
            wu = w
            if ACT == 1:
                wu = wu_nxt
                wu_nxt = tl.load(w_rows + up_off * stride_wn + (k0 + BLOCK_K), mask=nxt_mask,
                                 other=0.0)
        else:
            w = tl.load(w_rows + k0, mask=w_mask, other=0.0)
            wu = w
            if ACT == 1:
                wu = tl.load(w_rows + up_off * stride_wn + k0, mask=w_mask, other=0.0)
        acc, acc_u, ss = _skinny_step(k0, w, wu, acc, acc_u, ss, x_rows, r_rows, nr_rows,
                                      nw_ptr, m_ok, res_ok, offs_k, K, HAS_NORM, HAS_RES, ACT,
                                      USE_DOT, EVEN_K, IEEE, UPCAST)

    if USE_DOT:
        y = acc
        y_u = acc_u
    else:
        y = tl.sum(acc, 1)[None, :]
        y_u = tl.sum(acc_u, 1)[None, :]
    if HAS_NORM:
        rstd = tl.rsqrt(tl.sum(ss, 1) / K + eps)
        y = y * rstd[:, None]
        y_u = y_u * rstd[:, None]
    if PRE_NORMED:
        rstd = handoff_rstd(ss_ptr, offs_m, m_ok, n_parts, K, eps, BLOCK_M, BLOCK_P)
        y = y * rstd[:, None]
        y_u = y_u * rstd[:, None]
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if ACT == 1:
            y_u += tl.load(b_ptr + up_off + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if ACT == 2:  # columns (2j, 2j + 1) are output j's (gate, up)
        y, y_u = tl.split(tl.reshape(y, [BLOCK_M, BLOCK_N // 2, 2]))
        offs_n = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        n_ok = offs_n < N_OUT
    if EPI_NORM:  # (ACT == 0, no bias: the host checks)
        y = handoff_norm(y, offs_m, offs_n, m_ok, n_ok, r_ptr, nw_ptr, nr_ptr, ss_ptr,
                          stride_rm, stride_nrm, n_parts, pid, DT)
    if ACT:
        gate = y.to(DT).to(tl.float32)
        up = y_u.to(DT).to(tl.float32)
        y = (gate / (1.0 + tl.exp(-gate))).to(DT).to(tl.float32) * up
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, y.to(DT).to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


MAX_M = 64  # the kernel's limit (one M block); kernels.ops routes M <= SKINNY_MAX_M here

# Per (kind, M class) defaults from a sweep (docs/decisions.md);
# None: the unfused path (RMSNorm kernel + cuBLAS + SiLU*mul kernel) is faster there.
# kernels/skinny_tuning.json, written by ``python -m benchmarks.kernels.bench --tune``, overrides
# them per weight shape.
_F = dict(use_dot=False, prefetch=False)
_D = dict(use_dot=True, prefetch=False)
DEFAULTS: dict[tuple[str, int], dict | None] = {
    ("plain", 1): dict(_F, block_n=8, block_k=512, num_warps=4, num_stages=2),
    ("plain_f32", 1): dict(_F, block_n=8, block_k=256, num_warps=2, num_stages=3),
    ("norm", 1): dict(_F, block_n=8, block_k=512, num_warps=4, num_stages=2),
    ("norm_act", 1): dict(_F, block_n=4, block_k=1024, num_warps=4, num_stages=2),
    ("act", 1): dict(_F, block_n=4, block_k=1024, num_warps=4, num_stages=2),
    # the interleaved gate|up (``benchmarks.kernels.bench --only probe``): no register
    # double-buffering with the norm fused (8B: 74 us with it, 62 without)
    ("norm_act_pairs", 1): dict(_F, block_n=8, block_k=1024, num_warps=4, num_stages=2),
    ("act_pairs", 1): dict(_F, block_n=8, block_k=1024, num_warps=4, num_stages=2),
    ("plain", 16): dict(_D, block_n=32, block_k=256, num_warps=4, num_stages=4),
    ("plain_f32", 16): dict(_D, block_n=64, block_k=128, num_warps=4, num_stages=4),
    ("norm", 16): None, ("norm_act", 16): None, ("act", 16): None,
    ("norm_act_pairs", 16): None, ("act_pairs", 16): None,
}
TUNING_FILE = Path(__file__).with_name("skinny_tuning.json")  # the skinny_tuning option: another


# the kernel's ACT: 0 none, 1 gate|up stacked (a second row set at up_off), 2 row pairs
ACT_CODES = {None: 0, "silu_and_mul": 1, "silu_and_mul_pairs": 2}


def kind_of(norm: bool, act: bool | str | None, out_f32: bool) -> str:
    """Tuning kind of a call: 'plain', 'plain_f32' (logits), 'norm', 'act', 'norm_act', and
    'act_pairs' / 'norm_act_pairs' for the row-interleaved gate|up layout."""
    act_part = "act_pairs" if act == "silu_and_mul_pairs" else "act"
    parts = [p for p, on in (("norm", norm), (act_part, act)) if on]
    if parts:
        return "_".join(parts)
    return "plain_f32" if out_f32 else "plain"


def m_class(m: int) -> int | None:
    return 1 if m == 1 else 16 if m <= 16 else None


def load_table(path: str | None = None) -> dict[str, dict | None]:
    """The entries of a tuning file (None: the packaged one, which may be absent: an empty
    table, the defaults); a file named by the ``skinny_tuning`` option must load."""
    return _load_tuning(str(path or TUNING_FILE))


@functools.lru_cache(maxsize=4)
def _load_tuning(path: str) -> dict[str, dict | None]:
    return load_entries(path, TUNING_FILE, "skinny_tuning", "skinny-GEMM")


def tuning_key(kind: str, mc: int, n: int, k: int) -> str:
    return f"{kind}|m{mc}|{n}x{k}"


def select_config(m: int, n: int, k: int, kind: str,
                  table: dict[str, dict | None] | None = None) -> dict | None:
    """The skinny config for this call from ``table`` (None: the packaged one), else the
    defaults; None where the unfused path is faster (CPU ints only: shapes, batch class)."""
    mc = m_class(m)
    if mc is None:
        return None
    table = load_table() if table is None else table
    key = tuning_key(kind, mc, n, k)
    if key in table:
        return table[key]
    return DEFAULTS.get((kind, mc))


def fallback_config(m: int) -> dict:
    """A config for any M <= MAX_M (direct calls, tests) when no tuned one applies."""
    if m == 1:
        return dict(DEFAULTS[("plain", 1)])
    if m <= 16:
        return dict(DEFAULTS[("plain", 16)])
    if m <= 32:
        return dict(_D, block_n=32, block_k=256, num_warps=4, num_stages=3)
    return dict(_D, block_n=64, block_k=128, num_warps=4, num_stages=3)


def _l2_prefetch_bytes(cfg: dict, x: torch.Tensor, weight: torch.Tensor, k: int) -> int:
    """Bytes of each weight row a program bulk-prefetches into L2 before its PDL wait (0:
    none): a config's ``prefetch_l2`` (bytes, or True for whole rows). Rounded down to 16
    bytes; needs an sm_90+ device and 16-byte aligned rows."""
    want = cfg.get("prefetch_l2")
    if not want:  # the default: no size or alignment checks on the launch path
        return 0
    row = k * weight.element_size()
    nbytes = row if want is True else min(int(want), row)
    nbytes -= nbytes % 16
    return nbytes if nbytes > 0 and pdl.rows_prefetchable(x, weight) else 0


PRELOAD_CHOICES = (0, 1, 2)


def _preload(cfg: dict, use_dot: bool, use_pdl: bool) -> int:
    """How many leading K chunks are peeled, their weight tiles loaded before the PDL wait:
    a config's ``preload`` (0-2; true means 1), else 1 whenever PDL is on; 0 with
    register double-buffering, which always loads the first tile there."""
    want = cfg.get("preload")
    if want is None:
        want = 1 if use_pdl else 0
    if isinstance(want, bool):
        want = int(want)
    if type(want) is not int or want not in PRELOAD_CHOICES:
        raise ValueError(f"skinny GEMM config: preload must be one of {PRELOAD_CHOICES}, got "
                         f"{cfg.get('preload')!r}")
    return 0 if bool(cfg.get("prefetch")) and not use_dot else want


def skinny_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    act: str | None = None,
    out_dtype: torch.dtype | None = None,
    config: dict | None = None,
    prenormed_ss: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns ``(y, new_residual)``; ``new_residual = x + residual`` when a residual is
    given (it requires ``norm_weight``), else None. ``x [M, K]`` with ``M <= MAX_M``,
    ``weight [N, K]`` (``[2I, K]`` for ``act="silu_and_mul"``: gate rows then up rows;
    ``"silu_and_mul_pairs"``: rows ``2n, 2n + 1`` are gate and up of output ``n``; output
    ``[M, I]``).
    ``out_dtype`` (e.g. float32 logits) stores the dtype-rounded result widened.
    ``prenormed_ss [M, P]`` (``kernels.norm_handoff``): ``x`` is already ``s * g`` of an
    RMSNorm whose ``sum(s^2)`` is the row sum of these partials; the result is scaled by
    its ``rstd`` (``eps``) at the end, as the fused prologue would."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1]
    assert act in ACT_CODES, f"unknown activation {act!r}"
    assert residual is None or norm_weight is not None, "a residual is only fused into a norm"
    assert prenormed_ss is None or (norm_weight is None and prenormed_ss.is_contiguous()
                                    and prenormed_ss.shape[0] == x.shape[0]), "pre-normed input"
    m, k = x.shape
    assert m <= MAX_M, f"skinny GEMM is for M <= {MAX_M}, got {m}"
    x = x if x.stride(-1) == 1 else x.contiguous()
    n = weight.shape[0]
    if act is not None:
        assert n % 2 == 0
    y = torch.empty((m, n // 2 if act is not None else n), dtype=out_dtype or x.dtype,
                    device=x.device)
    new_res = None
    if residual is not None:
        residual = residual if residual.stride(-1) == 1 else residual.contiguous()
        new_res = torch.empty((m, k), dtype=x.dtype, device=x.device)
    if m == 0:
        return y, new_res
    if config is None:
        kind = kind_of(norm_weight is not None or prenormed_ss is not None, act,
                       out_dtype == torch.float32)
        config = select_config(m, n, k, kind) or fallback_config(m)
    r = residual if residual is not None else x
    launch_skinny(x, weight, bias, y, r, norm_weight, new_res if new_res is not None else x,
                  prenormed_ss, eps, act, config, has_res=residual is not None,
                  pre_normed=prenormed_ss is not None)
    return y, new_res


def launch_skinny(x, weight, bias, y, r, nw, nr, ss, eps: float, act: str | None, config: dict,
                  *, has_res: bool = False, epi_norm: bool = False,
                  pre_normed: bool = False) -> None:
    """One ``_skinny_kernel`` launch into ``y`` (tiles from ``config``). ``epi_norm``: ``r``
    is the residual to add and ``nw`` the next norm's weight, ``nr`` gets the new residual
    and ``ss [M, grid]`` the sum-of-squares partials; ``pre_normed``: ``ss [M, P]`` holds a
    producer's partials. Otherwise ``nw`` (may be None) is the fused prologue's norm."""
    m, k = x.shape
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    n = weight.shape[0]
    n_out = n // 2 if act is not None else n
    cfg = dict(fallback_config(m), **config)
    use_dot = cfg["use_dot"] or m > 1
    block_m = max(16, triton.next_power_of_2(m)) if use_dot else 1
    block_k = min(cfg["block_k"], max(16, triton.next_power_of_2(k)))
    block_n, grid = row_tiles(m, n, config, act)
    n_parts = ss.shape[1] if pre_normed else grid if epi_norm else 1
    if epi_norm:
        assert act is None and bias is None and ss.shape == (m, grid), "handoff producer shape"
    launch = pdl.launch_kwargs(x)
    _skinny_kernel[(grid,)](
        x, r, nw if nw is not None else x, weight, bias if bias is not None else weight, y, nr,
        ss if ss is not None else y,
        m, n_out, k, n_out, float(eps), n_parts,
        x.stride(0), r.stride(0), weight.stride(0), y.stride(0), nr.stride(0),
        HAS_NORM=nw is not None and not epi_norm, HAS_RES=has_res, HAS_BIAS=bias is not None,
        ACT=ACT_CODES[act], USE_DOT=use_dot, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=k % block_k == 0, IEEE=x.dtype == torch.float32,
        UPCAST=(not x.is_cuda) and x.dtype == torch.bfloat16,
        PREFETCH=bool(cfg.get("prefetch")) and not use_dot,
        PREFETCH_L2=_l2_prefetch_bytes(cfg, x, weight, k),
        PRELOAD=_preload(cfg, use_dot, launch["USE_PDL"]),
        EPI_NORM=epi_norm, PRE_NORMED=pre_normed,
        BLOCK_P=min(1024, triton.next_power_of_2(n_parts)) if pre_normed else 1,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch,
    )


def row_tiles(m: int, n: int, config: dict, act: str | None = None) -> tuple[int, int]:
    """``(BLOCK_N, programs)`` of a launch over ``weight [n, K]`` at ``M = m`` (the
    programs: a handoff producer's count of sum-of-squares partials)."""
    block_n = dict(fallback_config(m), **config)["block_n"]
    pairs = act == "silu_and_mul_pairs"
    if pairs:
        block_n = max(2, block_n)
    return block_n, triton.cdiv(n if pairs else (n // 2 if act is not None else n), block_n)


def linear_handoff_triton(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                          norm_weight: torch.Tensor, eps: float, config: dict,
                          ) -> tuple[PreNormed, torch.Tensor]:
    """``y = x @ weight^T`` handed over to the next RMSNorm (``norm_weight``, ``eps``) with
    the residual add (``kernels.norm_handoff``): returns ``(PreNormed(s * g, partials), s)``.
    One skinny launch."""
    m, n = x.shape[0], weight.shape[0]
    grid = row_tiles(m, n, config)[1]
    sg = torch.empty((m, n), dtype=x.dtype, device=x.device)
    new_res = torch.empty((m, n), dtype=x.dtype, device=x.device)
    ss = torch.empty((m, grid), dtype=torch.float32, device=x.device)
    residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    launch_skinny(x if x.stride(-1) == 1 else x.contiguous(), weight, None, sg, residual,
                  norm_weight, new_res, ss, eps, None, config, epi_norm=True)
    return PreNormed(sg, ss, float(eps)), new_res
