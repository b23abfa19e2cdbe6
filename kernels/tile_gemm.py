"""Triton tiled GEMM for mid-sized decode batches (``16 < M <= 256``), optionally split-K.

``y = x @ W^T`` for ``x [M, K]`` and ``W [N, K]`` row-major (as ``nn.Linear`` stores it).
At these batch sizes the small-hidden projections (Qwen3-0.6B: ``N`` or ``K`` of 1,024) give
cuBLAS too few output tiles to fill the GPU: its kernels stream the weights at 1.3-2 TB/s
(0.6B batch 128; docs/decisions.md). Here a program owns
a ``[BLOCK_M, BLOCK_N]`` output tile and one of ``split_k`` equal slices of ``K``, so the grid
can be sized to the SM count by ``BLOCK_N`` and ``split_k`` alone.

With ``split_k > 1`` each program stores its float32 partial tile; a second launch sums the
slices in a fixed order (deterministic: no atomics) and rounds once to the output dtype, as
an unsplit product would be rounded. The result is therefore the float32 sum of the same
products in another order than cuBLAS's: equal within 16-bit rounding, not bit for bit.

``out_dtype=torch.float32`` (logits): the product is rounded to ``x``'s dtype first and then
widened, exactly ``linear(x, W).to(torch.float32)``, without the separate widening copy.

No host syncs: the grid depends on CPU shapes only, and ``M`` is not specialised, so every
padded CUDA-graph batch size of one ``BLOCK_M`` shares one compilation.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import triton
import triton.language as tl

from kernels.tuning_file import check_tiles, load_entries

MAX_M = 256
# A batch of 2+ rows takes the smallest class that holds it. The 16-row class (2-16 rows)
# competes with the skinny GEMM too: where its table has an entry, ``kernels.ops.linear``
# takes it over the skinny config (Qwen3-0.6B at batch 8: the skinny dot tiles give an
# N=1024 projection 32 programs; docs/decisions.md).
M_CLASSES = (16, 32, 64, 128, 256)
# Per (M class, N, K): the fastest config on the target GPU, or null where cuBLAS won.
# Written by ``python -m benchmarks.kernels.bench_tile_gemm --tuning-out``; no entry: cuBLAS.
# Another table (the ``tile_gemm_tuning`` option) replaces it; an empty one (``tile_gemm``
# off) sends every batch to cuBLAS.
TUNING_FILE = Path(__file__).with_name("tile_gemm_tuning.json")


@triton.jit(do_not_specialize=["M"])
def _tile_gemm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_om,
    stride_os,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PARTIAL: tl.constexpr,
    ROUND_TO_X: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    ACT: tl.constexpr = False,
):
    pid_m = tl.program_id(0)  # fastest: the M tiles of one W tile run together (W read once)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_ok = (k0 + offs_k) < k_hi
        a = tl.load(x_rows + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_rows + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter's dot mishandles bf16: exact fp32 copies instead
            acc += tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
        elif IEEE:
            acc += tl.dot(a, tl.trans(b), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(b))
    mask = m_ok[:, None] & n_ok[None, :]
    o_off = offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    if PARTIAL:
        tl.store(out_ptr + split.to(tl.int64) * stride_os + o_off, acc, mask=mask)
    elif ACT:
        y, offs_j = _silu_mul_pairs(acc, pid_n, BLOCK_M, BLOCK_N, x_ptr.dtype.element_ty)
        tl.store(
            out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_j[None, :],
            y.to(out_ptr.dtype.element_ty),
            mask=m_ok[:, None] & (offs_j < N // 2)[None, :],
        )
    else:
        y = acc
        if ROUND_TO_X:
            y = y.to(x_ptr.dtype.element_ty)
        tl.store(out_ptr + o_off, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_pairs(acc, tile, ROWS: tl.constexpr, COLS: tl.constexpr, DT: tl.constexpr):
    """``silu(gate) * up`` of a tile whose columns (2j, 2j + 1) are output j's (gate, up),
    rounded as ``kernels.reference`` rounds (gate, up, silu and the product to ``DT``); and
    the tile's output columns."""
    gate, up = tl.split(tl.reshape(acc, [ROWS, COLS // 2, 2]))
    gate = gate.to(DT).to(tl.float32)
    up = up.to(DT).to(tl.float32)
    y = (gate / (1.0 + tl.exp(-gate))).to(DT).to(tl.float32) * up
    return y.to(DT), tile * (COLS // 2) + tl.arange(0, COLS // 2)


@triton.jit(do_not_specialize=["M"])
def _split_sum_kernel(
    part_ptr,
    out_ptr,
    M,
    N,
    stride_ps,
    stride_pm,
    stride_om,
    SPLIT_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    ROUND_TO: tl.constexpr,
    ACT: tl.constexpr = False,
):
    """``out = sum_s part[s]`` in split order, rounded once (via ``ROUND_TO``'s dtype);
    ``ACT``: then ``silu(gate) * up`` of the column pairs."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (offs_r < M)[:, None] & (offs_c < N)[None, :]
    p_off = offs_r.to(tl.int64)[:, None] * stride_pm + offs_c[None, :]
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * stride_ps.to(tl.int64) + p_off, mask=mask, other=0.0)
    if ACT:
        y, offs_j = _silu_mul_pairs(acc, tl.program_id(1), BLOCK_R, BLOCK_C, ROUND_TO)
        tl.store(
            out_ptr + offs_r.to(tl.int64)[:, None] * stride_om + offs_j[None, :],
            y.to(out_ptr.dtype.element_ty),
            mask=(offs_r < M)[:, None] & (offs_j < N // 2)[None, :],
        )
    else:
        y = acc.to(ROUND_TO)
        tl.store(
            out_ptr + offs_r.to(tl.int64)[:, None] * stride_om + offs_c[None, :],
            y.to(out_ptr.dtype.element_ty),
            mask=mask,
        )


@triton.jit(do_not_specialize=["M"])
def _split_sum_add_norm_kernel(
    part_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    new_res_ptr,
    M,
    N,
    eps,
    stride_ps,
    stride_pm,
    stride_rm,
    stride_om,
    stride_nrm,
    SPLIT_K: tl.constexpr,
    BLOCK_C: tl.constexpr,
    DT: tl.constexpr,
):
    """One row: the split sum rounded to ``DT`` (the GEMM's output), plus the residual
    (rounded: the new residual), then RMSNorm, in ``kernels.rms_norm``'s exact order."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    ok = cols < N
    g = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * stride_ps.to(tl.int64) + row * stride_pm + cols, mask=ok, other=0.0)
    r = tl.load(res_ptr + row * stride_rm + cols, mask=ok, other=0.0).to(tl.float32)
    x = (acc.to(DT).to(tl.float32) + r).to(DT)
    tl.store(new_res_ptr + row * stride_nrm + cols, x.to(new_res_ptr.dtype.element_ty), mask=ok)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)
    normed = (xf * rstd).to(DT).to(tl.float32)
    tl.store(out_ptr + row * stride_om + cols, (normed * g).to(out_ptr.dtype.element_ty), mask=ok)


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


CONFIG_KEYS = ("block_m", "block_n", "block_k", "split_k", "num_warps", "num_stages")


def check_config(cfg: dict, k: int) -> None:
    """Reject a config this kernel cannot run (a bad tuning entry, a typo in a sweep)."""
    check_tiles(cfg, CONFIG_KEYS, "tile GEMM")
    if k % (cfg["split_k"] * cfg["block_k"]):
        raise ValueError(f"tile GEMM: K={k} is not a multiple of split_k x block_k: {cfg}")


def m_class(m: int) -> int | None:
    """The tuning class of a batch of ``m`` rows (None: not a mid-sized batch)."""
    return next((c for c in M_CLASSES if 1 < m <= c), None)


def smallest_rows(mc: int) -> int:
    """The smallest batch of class ``mc`` (one past the class below it; 2 for the first)."""
    i = M_CLASSES.index(mc)
    return M_CLASSES[i - 1] + 1 if i else 2


def tuning_key(mc: int, n: int, k: int, kind: str = "plain") -> str:
    """``kind``: "plain" (the GEMM, with whatever epilogue its shape is always called with),
    or "add_norm" (``tile_linear_add_norm_triton``)."""
    return f"m{mc}|{n}x{k}" if kind == "plain" else f"{kind}|m{mc}|{n}x{k}"


def load_table(path: str | None = None) -> dict[str, dict | None]:
    """A tuning file's entries, each checked (None: the packaged file, which may be absent: no
    entries, cuBLAS everywhere); a file named by the ``tile_gemm_tuning`` option must load."""
    return _load_tuning(str(path or TUNING_FILE))


@functools.lru_cache(maxsize=4)
def _load_tuning(path: str) -> dict[str, dict | None]:
    return load_entries(
        path,
        TUNING_FILE,
        "tile_gemm_tuning",
        "tile-GEMM",
        lambda key, cfg: check_config(cfg, int(key.rsplit("x", 1)[1])),
    )


def select_config(
    m: int, n: int, k: int, kind: str = "plain", table: dict[str, dict | None] | None = None
) -> dict | None:
    """The tile config for ``x [m, k] @ W[n, k]^T`` (``kind`` as in ``tuning_key``) from
    ``table`` (None: the packaged one), or None for cuBLAS (CPU ints only)."""
    mc = m_class(m)
    if mc is None:
        return None
    return (load_table() if table is None else table).get(tuning_key(mc, n, k, kind))


ACTS = (None, "silu_and_mul_pairs")


def _check_operands(x: torch.Tensor, weight: torch.Tensor, config: dict) -> None:
    assert x.shape[1] == weight.shape[1] and x.dtype == weight.dtype
    assert x.stride(-1) == 1 and weight.stride(-1) == 1
    check_config(config, x.shape[1])


def _split_partials(split: int, m: int, n: int, device: torch.device) -> torch.Tensor:
    """``[split, m, n]`` float32 partials whose split stride is a multiple of 16 elements:
    Triton specialises int arguments on ``% 16``, so a stride of ``m * n`` with an odd ``n``
    (a vocabulary) would compile one variant per batch-size class, mid-serving."""
    plane = -(-m * n // 16) * 16
    flat = torch.empty(split * plane, dtype=torch.float32, device=device)
    return flat.as_strided((split, m, n), (plane, n, 1))


def _launch_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    config: dict,
    out: torch.Tensor,
    partial: bool,
    round_to_x: bool = False,
    act: bool = False,
) -> None:
    """``_tile_gemm_kernel`` into ``out``: ``[M, N]`` (or ``[M, N / 2]`` with ``act``), or with
    ``partial`` the float32 ``[split_k, M, N]`` partials of the K slices."""
    (m, k), n = x.shape, weight.shape[0]
    bm, bn, split = config["block_m"], config["block_n"], config["split_k"]
    _tile_gemm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn), split)](
        x,
        weight,
        out,
        m,
        n,
        k,
        k // split,
        x.stride(0),
        weight.stride(0),
        out.stride(-2),
        out.stride(0) if partial else 0,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=config["block_k"],
        PARTIAL=partial,
        ROUND_TO_X=round_to_x,
        UPCAST=(not x.is_cuda) and x.dtype == torch.bfloat16,
        IEEE=x.dtype == torch.float32,
        ACT=act,
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )


def tile_linear_triton(
    x: torch.Tensor, weight: torch.Tensor, config: dict, out_dtype: torch.dtype | None = None, act: str | None = None
) -> torch.Tensor:
    """``linear(x, weight)`` (no bias), widened to ``out_dtype`` after rounding to ``x``'s
    dtype; ``config``: ``block_m``, ``block_n``, ``block_k``, ``split_k``, ``num_warps``,
    ``num_stages`` (see ``check_config``). ``act="silu_and_mul_pairs"``: ``weight`` holds
    (gate j, up j) row pairs and the result is ``silu(gate) * up`` ``[M, N / 2]``, fused
    into the epilogue (of the GEMM, or of the split sum)."""
    m, k = x.shape
    n = weight.shape[0]
    _check_operands(x, weight, config)
    if act not in ACTS:
        raise ValueError(f"tile GEMM: unknown activation {act!r} (known: {ACTS})")
    if act is not None and (n % 2 or out_dtype not in (None, x.dtype)):
        raise ValueError("tile GEMM: silu_and_mul_pairs needs an even N and x's dtype out")
    out_dtype = out_dtype or x.dtype
    out = torch.empty((m, n // 2 if act else n), dtype=out_dtype, device=x.device)
    if m == 0:
        return out
    split = config["split_k"]
    if split == 1:
        _launch_gemm(x, weight, config, out, partial=False, round_to_x=out_dtype != x.dtype, act=act is not None)
        return out
    part = _split_partials(split, m, n, x.device)
    _launch_gemm(x, weight, config, part, partial=True)
    block_r, block_c = 16, 128
    _split_sum_kernel[(triton.cdiv(m, block_r), triton.cdiv(n, block_c))](
        part,
        out,
        m,
        n,
        part.stride(0),
        part.stride(1),
        out.stride(0),
        SPLIT_K=split,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        ROUND_TO=_TL_DTYPES[x.dtype],
        ACT=act is not None,
        num_warps=4,
    )
    return out


def tile_linear_add_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, config: dict, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm(linear(x, weight), norm_weight, eps, residual)`` -> ``(normed,
    new_residual)`` in two launches: the GEMM's float32 partials (any ``split_k``, 1 too),
    then one program a row sums them, adds the residual and normalises, with the rounding
    points of the unfused ops (the new residual equals the tile GEMM then ``kernels.rms_norm``
    bit for bit; the normalised output may differ by one rounding, its sum of squares
    reducing in another order). Saves the norm's launch and its round trip through memory.
    (Doing the split sum, add and norm inside the GEMM's launch, by the programs that arrive
    last, was 2-10 % slower end to end: docs/decisions.md.)"""
    m, n = x.shape[0], weight.shape[0]
    _check_operands(x, weight, config)
    assert residual.shape == (m, n) and residual.stride(-1) == 1 and norm_weight.shape == (n,)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    new_res = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out, new_res
    split = config["split_k"]
    part = _split_partials(split, m, n, x.device)
    _launch_gemm(x, weight, config, part, partial=True)
    block_c = triton.next_power_of_2(n)
    _split_sum_add_norm_kernel[(m,)](
        part,
        residual,
        norm_weight,
        out,
        new_res,
        m,
        n,
        float(eps),
        part.stride(0),
        part.stride(1),
        residual.stride(0),
        out.stride(0),
        new_res.stride(0),
        SPLIT_K=split,
        BLOCK_C=block_c,
        DT=_TL_DTYPES[x.dtype],
        num_warps=max(1, min(8, block_c // 256)),
    )
    return out, new_res


USES = ("plain", "act", "logits", "add_norm")  # how a model calls a weight (precompile)


def precompile(
    uses: list[tuple[torch.Tensor, str]],
    max_rows: int = MAX_M,
    max_logit_rows: int = MAX_M,
    table: dict[str, dict | None] | None = None,
) -> int:
    """Launch, once on zero rows, every kernel variant ``table`` (None: the packaged one) selects for these
    ``(weight, use)`` pairs (``use`` in ``USES``) in each batch class a step can reach (at
    most ``max_rows`` rows; ``max_logit_rows`` for the logits), so that no eager step of a
    mid-sized batch compiles one while serving (M is not specialised: one launch a config
    suffices; each launch takes the smallest row count of its class). Returns the number of
    launches."""
    launched, seen = 0, set()
    for weight, use in uses:
        if use not in USES:
            raise ValueError(f"tile GEMM precompile: unknown use {use!r} (known: {USES})")
        if not (weight.is_cuda and weight.dim() == 2 and weight.dtype in _TL_DTYPES and weight.dtype != torch.float32):
            continue
        n, k = weight.shape
        if (n, k, weight.dtype, use) in seen:  # every layer has the same shapes: once each
            continue
        seen.add((n, k, weight.dtype, use))
        reach = max_logit_rows if use == "logits" else max_rows
        for mc in M_CLASSES:
            rows = smallest_rows(mc)
            if rows > reach:
                break
            cfg = select_config(mc, n, k, "add_norm" if use == "add_norm" else "plain", table)
            if cfg is None:
                continue
            x = torch.zeros((rows, k), dtype=weight.dtype, device=weight.device)
            if use == "add_norm":
                tile_linear_add_norm_triton(
                    x,
                    weight,
                    cfg,
                    torch.zeros((rows, n), dtype=x.dtype, device=x.device),
                    torch.ones(n, dtype=x.dtype, device=x.device),
                    1e-6,
                )
            else:
                tile_linear_triton(
                    x,
                    weight,
                    cfg,
                    out_dtype=torch.float32 if use == "logits" else None,
                    act="silu_and_mul_pairs" if use == "act" else None,
                )
            launched += 1
    return launched


def tile_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None, act: str | None = None
) -> torch.Tensor:
    """The plain-torch meaning: float32 products and sums, rounded once to ``x``'s dtype
    (then ``kernels.reference.silu_and_mul_reference`` of the pairs, with ``act``)."""
    from kernels.reference import silu_and_mul_reference

    y = (x.float() @ weight.float().t()).to(x.dtype)
    if act is not None:
        y = silu_and_mul_reference(y, pairs=True)
    return y.to(out_dtype) if out_dtype is not None else y
