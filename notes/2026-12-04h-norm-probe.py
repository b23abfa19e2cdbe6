"""Timing probes (numerics deliberately wrong) of the batch-1 decode step. Runs
benchmarks.decode_roofline in-process with one op patched, chosen by PROBE:
  nonorm  the fused norm+QKV and norm+gate|up GEMVs at M = 1 take their tuned config WITHOUT
          the RMSNorm prologue (the plain streaming loop), the residual passes through: the
          gap to the unpatched run bounds what moving the norm into the producer GEMV's
          epilogue (o_proj / down) could gain;
  noattn  one-token attention (with its rope + KV write) is skipped (q is returned): what
          the attention launches cost the step.
Usage: PROBE=nonorm|noattn python THIS <decode_roofline args>."""
import os
import sys

from kernels import ops, skinny_gemm

_orig = ops.linear


def _no_norm(x, weight, bias=None, *, residual=None, norm_weight=None, eps=1e-6, act=None,
             out_dtype=None):
    if norm_weight is None or x.shape[0] != 1 or not x.is_cuda:
        return _orig(x, weight, bias, residual=residual, norm_weight=norm_weight, eps=eps,
                     act=act, out_dtype=out_dtype)
    kind = skinny_gemm.kind_of(True, act, out_dtype is not None)
    cfg = skinny_gemm.select_config(1, weight.shape[0], weight.shape[1], kind)
    if cfg is None or cfg.get("kernel") == "gemv":
        return _orig(x, weight, bias, residual=residual, norm_weight=norm_weight, eps=eps,
                     act=act, out_dtype=out_dtype)
    y, _ = skinny_gemm.skinny_linear_triton(x, weight, bias, act=act, out_dtype=out_dtype,
                                            config=cfg)
    return y, (residual if residual is not None else x)


_orig_attn = ops.rope_and_attention


def _no_attn(positions, q, *args, **kw):
    if q.is_cuda and args[10] == 1:  # max_query_len
        return q
    return _orig_attn(positions, q, *args, **kw)


probe = os.environ.get("PROBE", "")
if probe == "nonorm":
    ops.linear = _no_norm
elif probe == "noattn":
    ops.rope_and_attention = _no_attn
elif probe:
    raise SystemExit(f"PROBE must be nonorm or noattn, got {probe!r}")
from benchmarks import decode_roofline  # noqa: E402

decode_roofline.main(sys.argv[1:])
