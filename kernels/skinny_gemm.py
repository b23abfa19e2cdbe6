"""Skinny GEMM (decode-sized M), host side: the config of a call and its launch.

``y = act(norm(x [+ residual]) @ W^T + b)`` for ``x [M, K]`` with small ``M``, ``W [N, K]``;
the kernel and its fusions (RMSNorm prologue, SiLU*mul epilogue, FP8 weight-only, norm handoff) are
``kernels.skinny_gemm_kernel``.

Which path and tile a call uses is a CPU decision by weight shape and M class
(1, or 2..16; FP8 weights also 17..32 and 33..64, from their own entries only):
``select_config`` reads ``kernels/skinny_tuning.json`` (written on the target GPU by
``python -m benchmarks.kernels.bench --tune``, or the file named by the ``skinny_tuning``
option; each entry is the fastest candidate, or null where the unfused RMSNorm + cuBLAS +
SiLU*mul path was faster; a batch-1 entry with ``"kernel": "gemv"`` routes to
``kernels.gemv``), else ``DEFAULTS``. FP8 weights move half the bytes a tile of the same
shape, so they have entries of their own (``|fp8`` keys, written by ``--tune ... --weights
fp8``); a shape without one takes its 16-bit entry.

No host syncs; the grid depends on ``N`` only. ``M`` is not specialised, so
every padded CUDA-graph batch size of one ``BLOCK_M`` shares one compilation.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import triton

from kernels import pdl
from kernels.norm_handoff import PreNormed
from kernels.skinny_gemm_kernel import _skinny_kernel
from kernels.tuning_file import load_entries


MAX_M = 64  # the kernel's limit (one M block); kernels.ops routes M <= SKINNY_MAX_M here (FP8: to 64, by entry)

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
    ("norm", 16): None,
    ("norm_act", 16): None,
    ("act", 16): None,
    ("norm_act_pairs", 16): None,
    ("act_pairs", 16): None,
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


FP8_M_CLASSES = (32, 64)  # FP8 weights only: weight-only rows past 16, where a tuned entry says so


def m_class(m: int, fp8: bool = False) -> int | None:
    """The batch class a call's tuning entry is keyed by: 1, 2-16, and for FP8 weights also
    17-32 and 33-64 (entries only from a tune: no defaults there)."""
    if m == 1:
        return 1
    if m <= 16:
        return 16
    if fp8:
        return next((c for c in FP8_M_CLASSES if m <= c), None)
    return None


def load_table(path: str | None = None) -> dict[str, dict | None]:
    """The entries of a tuning file (None: the packaged one, which may be absent: an empty
    table, the defaults); a file named by the ``skinny_tuning`` option must load."""
    return _load_tuning(str(path or TUNING_FILE))


@functools.lru_cache(maxsize=4)
def _load_tuning(path: str) -> dict[str, dict | None]:
    return load_entries(path, TUNING_FILE, "skinny_tuning", "skinny-GEMM")


def tuning_key(kind: str, mc: int, n: int, k: int, fp8: bool = False) -> str:
    """A tuning table's key; ``fp8``: the entry for FP8 (e4m3) weights of that shape."""
    return f"{kind}|m{mc}|{n}x{k}" + ("|fp8" if fp8 else "")


def select_config(
    m: int, n: int, k: int, kind: str, table: dict[str, dict | None] | None = None, fp8: bool = False
) -> dict | None:
    """The skinny config for this call from ``table`` (None: the packaged one), else the
    defaults; None where the unfused path is faster (CPU ints only: shapes, batch class).
    ``fp8``: an FP8 weight, whose own entry (``tuning_key(..., fp8=True)``) comes first; past
    16 rows only such an entry applies (``FP8_M_CLASSES``)."""
    mc = m_class(m, fp8)
    if mc is None:
        return None
    table = load_table() if table is None else table
    if fp8 and (key := tuning_key(kind, mc, n, k, fp8=True)) in table:
        return table[key]
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
        raise ValueError(f"skinny GEMM config: preload must be one of {PRELOAD_CHOICES}, got {cfg.get('preload')!r}")
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
    weight_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns ``(y, new_residual)``; ``new_residual = x + residual`` when a residual is
    given (it requires ``norm_weight``), else None. ``x [M, K]`` with ``M <= MAX_M``,
    ``weight [N, K]`` (``[2I, K]`` for ``act="silu_and_mul"``: gate rows then up rows;
    ``"silu_and_mul_pairs"``: rows ``2n, 2n + 1`` are gate and up of output ``n``; output
    ``[M, I]``).
    ``out_dtype`` (e.g. float32 logits) stores the dtype-rounded result widened.
    ``prenormed_ss [M, P]`` (``kernels.norm_handoff``): ``x`` is already ``s * g`` of an
    RMSNorm whose ``sum(s^2)`` is the row sum of these partials; the result is scaled by
    its ``rstd`` (``eps``) at the end, as the fused prologue would.
    ``weight_scale [N]`` (float32): ``weight`` is FP8 e4m3 with one scale per row, multiplied
    by the 16-bit ``x`` as it is (weight-only; not with ``prenormed_ss``)."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1]
    assert act in ACT_CODES, f"unknown activation {act!r}"
    assert residual is None or norm_weight is not None, "a residual is only fused into a norm"
    assert prenormed_ss is None or (
        weight_scale is None
        and norm_weight is None
        and prenormed_ss.is_contiguous()
        and prenormed_ss.shape[0] == x.shape[0]
    ), "pre-normed input"
    m, k = x.shape
    assert m <= MAX_M, f"skinny GEMM is for M <= {MAX_M}, got {m}"
    x = x if x.stride(-1) == 1 else x.contiguous()
    n = weight.shape[0]
    if act is not None:
        assert n % 2 == 0
    y = torch.empty((m, n // 2 if act is not None else n), dtype=out_dtype or x.dtype, device=x.device)
    new_res = None
    if residual is not None:
        residual = residual if residual.stride(-1) == 1 else residual.contiguous()
        new_res = torch.empty((m, k), dtype=x.dtype, device=x.device)
    if m == 0:
        return y, new_res
    if config is None:
        kind = kind_of(norm_weight is not None or prenormed_ss is not None, act, out_dtype == torch.float32)
        config = select_config(m, n, k, kind) or fallback_config(m)
    r = residual if residual is not None else x
    launch_skinny(
        x,
        weight,
        bias,
        y,
        r,
        norm_weight,
        new_res if new_res is not None else x,
        prenormed_ss,
        eps,
        act,
        config,
        has_res=residual is not None,
        pre_normed=prenormed_ss is not None,
        weight_scale=weight_scale,
    )
    return y, new_res


def launch_skinny(
    x,
    weight,
    bias,
    y,
    r,
    nw,
    nr,
    ss,
    eps: float,
    act: str | None,
    config: dict,
    *,
    has_res: bool = False,
    epi_norm: bool = False,
    pre_normed: bool = False,
    weight_scale: torch.Tensor | None = None,
) -> None:
    """One ``_skinny_kernel`` launch into ``y`` (tiles from ``config``). ``epi_norm``: ``r``
    is the residual to add and ``nw`` the next norm's weight, ``nr`` gets the new residual
    and ``ss [M, grid]`` the sum-of-squares partials; ``pre_normed``: ``ss [M, P]`` holds a
    producer's partials. Otherwise ``nw`` (may be None) is the fused prologue's norm.
    ``weight_scale [N]`` float32: ``weight`` is FP8 e4m3 (16-bit weights only otherwise)."""
    m, k = x.shape
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    n = weight.shape[0]
    _check_weight_scale(weight, weight_scale, epi_norm or pre_normed)
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
        x,
        r,
        nw if nw is not None else x,
        weight,
        bias if bias is not None else weight,
        weight_scale if weight_scale is not None else weight,
        y,
        nr,
        ss if ss is not None else y,
        m,
        n_out,
        k,
        n_out,
        float(eps),
        n_parts,
        x.stride(0),
        r.stride(0),
        weight.stride(0),
        y.stride(0),
        nr.stride(0),
        HAS_NORM=nw is not None and not epi_norm,
        HAS_RES=has_res,
        HAS_BIAS=bias is not None,
        ACT=ACT_CODES[act],
        USE_DOT=use_dot,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=k % block_k == 0,
        IEEE=x.dtype == torch.float32,
        UPCAST=(not x.is_cuda) and x.dtype == torch.bfloat16,
        PREFETCH=bool(cfg.get("prefetch")) and not use_dot,
        PRELOAD=_preload(cfg, use_dot, launch["USE_PDL"]),
        EPI_NORM=epi_norm,
        PRE_NORMED=pre_normed,
        BLOCK_P=min(1024, triton.next_power_of_2(n_parts)) if pre_normed else 1,
        HAS_WSCALE=weight_scale is not None,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        **launch,
    )


def _check_weight_scale(weight: torch.Tensor, weight_scale: torch.Tensor | None, handoff: bool) -> None:
    """An FP8 (e4m3) weight comes with its float32 ``[N]`` row scales, any other without;
    the norm handoff (producer and consumer) is 16-bit only."""
    fp8 = weight.dtype == torch.float8_e4m3fn
    if weight_scale is None:
        if fp8:
            raise ValueError("skinny GEMM: an FP8 weight needs its weight_scale")
        return
    if not fp8 or handoff:
        raise ValueError(f"skinny GEMM: weight_scale goes with an FP8 weight (not the handoff), got {weight.dtype}")
    if weight_scale.dtype != torch.float32 or weight_scale.shape != (weight.shape[0],):
        raise ValueError(
            f"skinny GEMM: weight_scale must be float32 [{weight.shape[0]}], "
            f"got {weight_scale.dtype} {tuple(weight_scale.shape)}"
        )
    if not weight_scale.is_contiguous():
        raise ValueError("skinny GEMM: weight_scale must be contiguous")


def row_tiles(m: int, n: int, config: dict, act: str | None = None) -> tuple[int, int]:
    """``(BLOCK_N, programs)`` of a launch over ``weight [n, K]`` at ``M = m`` (the
    programs: a handoff producer's count of sum-of-squares partials)."""
    block_n = dict(fallback_config(m), **config)["block_n"]
    pairs = act == "silu_and_mul_pairs"
    if pairs:
        block_n = max(2, block_n)
    return block_n, triton.cdiv(n if pairs else (n // 2 if act is not None else n), block_n)


def linear_handoff_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    config: dict,
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
    launch_skinny(
        x if x.stride(-1) == 1 else x.contiguous(),
        weight,
        None,
        sg,
        residual,
        norm_weight,
        new_res,
        ss,
        eps,
        None,
        config,
        epi_norm=True,
    )
    return PreNormed(sg, ss, float(eps)), new_res
