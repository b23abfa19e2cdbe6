"""Plain-torch references of the FP8 (e4m3) weight path: the CPU path and the kernels' oracle.

Weights are quantized once, at load, with one scale per output row; activations per row
(per token) at run time, or with one static scale. A product of two e4m3 values is exact in
float32, so the GEMM is ``xq @ wq^T`` accumulated in float32, then scaled per row and column:

    y[m, n] = (sum_k xq[m, k] * wq[n, k]) * x_scale[m] * w_scale[n] (+ bias[n])

Scales are float32: ``max(amax(|row|), 1e-12) / 448``, so a row's largest magnitude maps
to 448 (e4m3's largest finite value); values are divided by the scale, clamped to +-448 and
rounded to nearest even (torch's cast), as ``kernels.fp8_quant`` does on the device.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_FLOOR = 1e-12  # an all-zero row: a tiny scale instead of a division by zero


def _quantize_with(xf: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (xf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_rows_reference(
    x: torch.Tensor, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (bf16/fp16/fp32) -> ``(xq [M, K] e4m3, scale [M] float32)``: per-row
    dynamic scales, or with ``static_scale`` (one float32 value, shape ``[]`` or ``[1]``)
    that scale for every row (returned expanded to ``[M]``)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_rows: expected a 2-D tensor, got shape {tuple(x.shape)}")
    xf = x.float()
    if static_scale is None:
        # a tensor divisor: CUDA torch turns division by a Python scalar into a multiplication
        # by its reciprocal, one ulp off the kernel's (and the CPU's) true division
        scale = xf.abs().amax(dim=1).clamp_min(SCALE_FLOOR) / xf.new_full((), FP8_MAX)
    else:
        if static_scale.numel() != 1:
            raise ValueError(f"quantize_rows: static_scale must hold one value, got {tuple(static_scale.shape)}")
        scale = static_scale.to(device=x.device, dtype=torch.float32).reshape(()).expand(x.shape[0]).contiguous()
    return _quantize_with(xf, scale), scale


def quantize_weight_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> ``(wq [N, K] e4m3, scale [N] float32)``, one scale per output row
    (``w ~= wq.float() * scale[:, None]``)."""
    return quantize_rows_reference(w)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q.float() * scale[:, None]`` in ``dtype`` (a quantized weight or activation back)."""
    return (q.float() * scale.float()[:, None]).to(dtype)


def fp8_linear_reference(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``y [M, N] = (xq @ wq^T) * x_scale[:, None] * w_scale[None, :] (+ bias)`` in float32,
    rounded once to ``out_dtype``."""
    if xq.shape[1] != wq.shape[1]:
        raise ValueError(f"fp8 linear: K mismatch {tuple(xq.shape)} vs {tuple(wq.shape)}")
    y = (xq.float() @ wq.float().T) * x_scale.float()[:, None] * w_scale.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)
