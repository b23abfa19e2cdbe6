"""The two FP8 (e4m3) weight paths of ``kernels.ops.linear`` (which picks one by batch size).

* ``weight_only_linear`` (decode-sized batches): the 16-bit activations, not quantized, times
  the FP8 weight widened in registers, in one ``kernels.skinny_gemm`` launch with the RMSNorm
  prologue and SiLU*mul epilogue fused and the per-row weight scales applied in its epilogue
  (``kernels.reference.skinny_linear_reference`` on the CPU).
* ``w8a8_linear``: the (normed) activations quantized per row, or with a static scale
  (``kernels.fp8_quant``), then the scaled FP8 GEMM: ``kernels.fp8_gemm`` up to 128 rows,
  cuBLASLt's rowwise-scaled FP8 GEMM (``torch._scaled_mm``) above on sm_90+, where it measured
  1.04-1.5x faster (docs/decisions.md); the references of ``kernels.fp8_reference`` on the CPU.
"""

from __future__ import annotations

import functools

import torch

from kernels import reference

CUBLAS_MIN_ROWS = 129  # from here cuBLASLt's FP8 GEMM beat kernels.fp8_gemm (H100)


@functools.lru_cache(maxsize=16)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def use_cublas(m: int, n: int, k: int, capability: tuple[int, int]) -> bool:
    """Whether a ``[m, k] x [n, k]^T`` FP8 GEMM goes to ``torch._scaled_mm`` (CPU ints only):
    more than 128 rows, Hopper or newer (rowwise scales), dimensions cuBLASLt takes."""
    return m >= CUBLAS_MIN_ROWS and capability >= (9, 0) and n % 16 == 0 and k % 16 == 0


def weight_only_linear(x, weight, weight_scale, bias, config: dict | None, **kw):
    """``(y, new_residual)`` of ``act(norm(x [+ residual]) @ (weight * weight_scale)^T + bias)``
    (``kw``: ``residual``, ``norm_weight``, ``eps``, ``act``, ``out_dtype``); ``config``: the
    skinny tiles on CUDA (ignored on the CPU)."""
    if x.is_cuda:
        from kernels.skinny_gemm import skinny_linear_triton

        return skinny_linear_triton(x, weight, bias, weight_scale=weight_scale, config=config, **kw)
    return reference.skinny_linear_reference(x, weight, bias, weight_scale=weight_scale, **kw)


def w8a8_linear(x, weight, weight_scale, input_scale, bias) -> torch.Tensor:
    """``x @ weight^T`` (+ bias) in ``x``'s dtype: per-row (or static ``input_scale``) FP8
    quantization of ``x``, then the GEMM with both scales in its epilogue."""
    if x.is_cuda:
        from kernels.fp8_gemm import fp8_gemm_triton
        from kernels.fp8_quant import quantize_rows_triton

        xq, x_scale = quantize_rows_triton(x, input_scale)
        m, k = x.shape
        if hasattr(torch, "_scaled_mm") and use_cublas(m, weight.shape[0], k, _capability(x.device.index or 0)):
            # a bias is added in float32 before the one rounding, as the Triton epilogue does
            out_dtype = x.dtype if bias is None else torch.float32
            y = torch._scaled_mm(
                xq, weight.t(), scale_a=x_scale[:, None], scale_b=weight_scale[None, :], out_dtype=out_dtype
            )
            return y if bias is None else (y + bias.float()).to(x.dtype)
        return fp8_gemm_triton(xq, x_scale, weight, weight_scale, bias, out_dtype=x.dtype)
    from kernels.fp8_reference import fp8_linear_reference, quantize_rows_reference

    xq, x_scale = quantize_rows_reference(x, input_scale)
    return fp8_linear_reference(xq, x_scale, weight, weight_scale, bias, out_dtype=x.dtype)


def precompile(projections, dtype: torch.dtype, max_rows: int) -> int:
    """Compile (or load, or let cuBLASLt pick its algorithm) now every variant serving can
    launch above the weight-only sizes for these FP8 projections (``(weight, weight_scale,
    bias, input_scale)`` each): the activation quantization and the GEMM of each batch class
    at sizes up to ``max_rows``, on zeros. Returns the launches made."""
    seen, launches = set(), 0
    for w, w_scale, bias, in_scale in projections:
        key = (tuple(w.shape), bias is not None, in_scale is not None)
        if key in seen:
            continue
        seen.add(key)
        for m in (17, 128, 129, 256, 257):
            if m > max_rows:
                break
            x = torch.zeros(m, w.shape[1], dtype=dtype, device=w.device)
            w8a8_linear(x, w, w_scale, in_scale, bias)
            launches += 1
    return launches
