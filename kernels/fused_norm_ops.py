"""Dispatch of the GEMMs that also do the next RMSNorm, and the MLP block built from them.

Two ways save the norm's own launch: the *handoff* (``kernels.norm_handoff``, batch 1 at
tensor parallelism 1: the producing skinny GEMM does the norm's elementwise part, its
consumer applies ``rstd``) and the tile GEMM's split sum + add + norm (mid-sized batches,
where its tuning table has an ``add_norm`` entry). Everything else is ``kernels.ops.linear``.
"""

from __future__ import annotations


import torch

from kernels import ops
from kernels.norm_handoff import Normed, PreNormed
from kernels.settings import TRITON_INTERPRETED, current


def mlp_block(
    attn, wo, residual, norm_weight, eps: float, w_gate_up, w_down, act: str = "silu_and_mul", handoff_to=None
):
    """``down(act(gate_up(norm(attn @ wo^T + residual))))`` -> ``(h, new_residual)``
    (tensor parallelism 1, no biases; ``act`` names the gate|up layout): the three ``linear``
    calls, where ``kernels.norm_handoff`` applies with the norm done by the producing GEMV
    (o_proj; and down when ``handoff_to = (next norm weight, eps, next consumer weight)``
    names the next layer's input norm and QKV: ``h`` is then a ``PreNormed`` and
    ``new_residual`` already includes ``h``)."""
    handed = linear_handoff(attn, wo, residual, norm_weight, eps, w_gate_up, act)
    if handed is not None:
        h, new_res = linear_prenormed(handed[0], w_gate_up, act=act), handed[1]
    elif (normed := linear_add_norm(attn, wo, residual, norm_weight, eps)) is not None:
        h, new_res = ops.linear(normed[0], w_gate_up, act=act)[0], normed[1]
    else:
        o, _ = ops.linear(attn, wo)
        h, new_res = ops.linear(o, w_gate_up, residual=residual, norm_weight=norm_weight, eps=eps, act=act)
    if handoff_to is not None:
        handed = linear_handoff(h, w_down, new_res, *handoff_to)
        if handed is not None:
            return handed
        normed = linear_add_norm(h, w_down, new_res, *handoff_to[:2])
        if normed is not None:
            return Normed(normed[0]), normed[1]
    return ops.linear(h, w_down)[0], new_res


def linear_add_norm(x, weight, residual, norm_weight, eps: float):
    """``rms_norm(x @ weight^T, norm_weight, eps, residual)`` -> ``(normed, new_residual)``
    as the tile GEMM's split sum + add + norm (two launches, the norm's own launch saved)
    where its tuning table has an ``add_norm`` entry for this mid-sized batch; else None."""
    if residual is None or not ops.tile_ready(x, weight):
        return None
    from kernels.tile_gemm import select_config, tile_linear_add_norm_triton

    cfg = select_config(x.shape[0], weight.shape[0], weight.shape[1], "add_norm", current().tile_table)
    if cfg is None or residual.stride(-1) != 1 or residual.dtype != x.dtype:
        return None
    return tile_linear_add_norm_triton(x, weight, cfg, residual, norm_weight, eps)


def _streams(cfg: dict | None) -> bool:
    """Whether a skinny config is the batch-1 FMA streaming loop that carries the norm
    handoff (not unfused, not the persistent GEMV, not tensor cores)."""
    return cfg is not None and cfg.get("kernel") != "gemv" and not cfg.get("use_dot")


def _handoff_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.is_cuda
        and x.dim() == 2
        and x.shape[0] == 1
        and ops.SKINNY_MAX_M >= 1
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and not TRITON_INTERPRETED
        and current().norm_handoff
    )


def linear_handoff(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    consumer: torch.Tensor,
    consumer_act: str | None = None,
) -> tuple[PreNormed, torch.Tensor] | None:
    """``x @ weight^T`` handed to the next RMSNorm by its producer (``kernels.norm_handoff``;
    ``consumer`` is the weight that will read the result with ``consumer_act``, and it needs
    a skinny M = 1 config of its own) where that applies, else None: the caller runs
    ``linear`` and fuses the norm into the consumer."""
    if residual is None or not _handoff_applies(x, weight):
        return None
    from kernels.skinny_gemm import linear_handoff_triton, select_config

    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    cfg = select_config(m, n, k, "plain", current().skinny_table)
    if not _streams(cfg) or prenormed_config(consumer, m, consumer_act) is None:
        return None
    return linear_handoff_triton(x, weight, residual, norm_weight, eps, cfg)


def prenormed_config(weight: torch.Tensor, m: int = 1, act: str | None = None) -> dict | None:
    """The handoff consumer's skinny config: its fused-norm entry (same tiles, no prologue),
    or None where that shape runs unfused, on tensor cores or as the persistent GEMV."""
    from kernels.skinny_gemm import kind_of, select_config

    cfg = select_config(m, weight.shape[0], weight.shape[1], kind_of(True, act, False), current().skinny_table)
    return cfg if _streams(cfg) else None


def linear_prenormed(
    pn: PreNormed, weight: torch.Tensor, bias: torch.Tensor | None = None, act: str | None = None
) -> torch.Tensor:
    """``act(norm(s) @ weight^T + bias)`` from a handed-over ``pn``: one skinny launch that
    streams ``s * g`` and applies ``rstd`` at the end; elsewhere the norm is materialised."""
    cfg = prenormed_config(weight, pn.sg.shape[0], act) if pn.sg.is_cuda else None
    if cfg is None:
        return ops.linear(pn.materialise(), weight, bias, act=act)[0]
    from kernels.skinny_gemm import skinny_linear_triton

    return skinny_linear_triton(pn.sg, weight, bias, act=act, eps=pn.eps, config=cfg, prenormed_ss=pn.ss)[0]
