"""The two FP8 (e4m3) weight paths of ``kernels.ops.linear`` (which picks one by batch size).

* ``weight_only_linear`` (decode-sized batches): the 16-bit activations, not quantized, times
  the FP8 weight widened in registers, in one ``kernels.skinny_gemm`` launch with the RMSNorm
  prologue and SiLU*mul epilogue fused and the per-row weight scales applied in its epilogue
  (``kernels.reference.skinny_linear_reference`` on the CPU).
* ``w8a8_linear``: the (normed) activations quantized per row, or with a static scale
  (``kernels.fp8_quant``), then the scaled FP8 GEMM (``kernels.fp8_gemm``); the references of
  ``kernels.fp8_reference`` on the CPU.
"""

from __future__ import annotations

import torch

from kernels import reference


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
        return fp8_gemm_triton(xq, x_scale, weight, weight_scale, bias, out_dtype=x.dtype)
    from kernels.fp8_reference import fp8_linear_reference, quantize_rows_reference

    xq, x_scale = quantize_rows_reference(x, input_scale)
    return fp8_linear_reference(xq, x_scale, weight, weight_scale, bias, out_dtype=x.dtype)
