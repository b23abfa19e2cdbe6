"""Triton RMSNorm with fused residual add (same rounding as ``rms_norm_reference``).

With a residual, ``new_residual = (x + residual)`` rounded to ``x.dtype`` and the
norm is applied to that rounded sum; ``normed = (s * rstd).to(x.dtype) * weight``
computed in float32 and rounded once more, exactly the reference's order. Each
program handles ``BLOCK_R`` rows, so the Qwen3 q/k norm on
``[tokens * heads, head_dim]`` (many short rows) is not one tiny program per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.pdl import wait_and_release


# Row counts vary step to step (eager prefill): not specialised, so no mid-serving compiles.
@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    new_res_ptr,
    num_rows,
    hidden,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_nr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_H)
    w = tl.load(w_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)  # weights: pre-wait
    wait_and_release(USE_PDL)
    mask = (rows[:, None] < num_rows) & (cols[None, :] < hidden)
    rows = rows.to(tl.int64)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(new_res_ptr + rows[:, None] * stride_nr + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 1) / hidden + eps)
    normed = (xf * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(
        out_ptr + rows[:, None] * stride_o + cols[None, :],
        (normed * w[None, :]).to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def _rows(t: torch.Tensor, hidden: int) -> torch.Tensor:
    t = t.reshape(-1, hidden)
    return t if t.stride(-1) == 1 else t.contiguous()


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns ``(normed, new_residual)``; ``new_residual`` is None without a residual.

    ``x`` is ``[..., hidden]`` (row-strided 2D views are used as is); outputs are
    new contiguous tensors of ``x``'s shape and dtype.
    """
    shape, hidden = x.shape, x.shape[-1]
    x2 = _rows(x, hidden)
    num_rows = x2.shape[0]
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    new_res = torch.empty(shape, dtype=x.dtype, device=x.device) if residual is not None else None
    if num_rows == 0:
        return out, new_res
    r2 = _rows(residual, hidden) if residual is not None else x2
    nr2 = new_res.view(-1, hidden) if new_res is not None else out.view(-1, hidden)
    block_h = triton.next_power_of_2(hidden)
    block_r = max(1, min(64, 2048 // block_h))  # ~2K elements per program for short rows
    num_warps = max(1, min(16, block_h * block_r // 512))
    _rms_norm_kernel[(triton.cdiv(num_rows, block_r),)](
        x2,
        r2,
        weight,
        out,
        nr2,
        num_rows,
        hidden,
        float(eps),
        x2.stride(0),
        r2.stride(0),
        hidden,
        hidden,
        HAS_RESIDUAL=residual is not None,
        BLOCK_R=block_r,
        BLOCK_H=block_h,
        num_warps=num_warps,
        **pdl.launch_kwargs(x2),
    )
    return out, new_res
