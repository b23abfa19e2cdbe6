"""Triton ``silu(gate) * up`` over a fused gate|up projection (same rounding as the reference).

``x`` is ``[T, 2 * I]`` (gate in the first half of each row, up in the second),
the output ``[T, I]``; with ``pairs=True`` gate and up of column ``j`` sit at
``2j`` and ``2j + 1`` (the row-interleaved gate|up weight layout). ``silu`` is computed in float32 and rounded to the
input dtype, then multiplied by ``up`` in float32 and rounded once more:
exactly what ``F.silu(g) * u`` does on 16-bit tensors, in one launch instead of
two and without the ``silu`` temporary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.pdl import wait_and_release


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    inter,
    stride_x,
    stride_o,
    BLOCK: tl.constexpr,
    PAIRS: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
):
    t = tl.program_id(0).to(tl.int64)
    wait_and_release(USE_PDL)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    if PAIRS:  # one contiguous [BLOCK, 2] load (not two stride-2 ones), split in registers
        pair = 2 * cols[:, None] + tl.arange(0, 2)[None, :]
        gu = tl.load(x_ptr + t * stride_x + pair, mask=mask[:, None], other=0.0).to(tl.float32)
        g, u = tl.split(gu)
    else:
        g = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + t * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * stride_o + cols, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor, pairs: bool = False) -> torch.Tensor:
    """``[T, 2I] -> [T, I]``; ``x`` may be row-strided (its last dim contiguous)."""
    assert x.shape[-1] % 2 == 0
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    inter = x2.shape[1] // 2
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    if x2.shape[0] == 0:
        return out
    block = min(2048, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
        x2,
        out,
        inter,
        x2.stride(0),
        inter,
        BLOCK=block,
        PAIRS=pairs,
        num_warps=max(1, min(8, block // 256)),
        **pdl.launch_kwargs(x2),
    )
    return out
