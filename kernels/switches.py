"""The kernel switches a user sets in the driver's environment, and their trip to the workers.

Kernels read these when they launch (or a CUDA graph is captured), inside the worker actor's
process. An actor started on a running Ray cluster does not inherit the driver's
environment, so the executor forwards every switch that is set through the actor's
``runtime_env``: a switch set for ``python -m cluster.serve`` is never silently ignored.
"""

from __future__ import annotations

import os

KERNEL_SWITCHES = (
    "SYNCLESS_PDL",             # programmatic dependent launch (kernels.pdl)
    "SYNCLESS_PDL_MAX_TOKENS",  # ... only for passes of at most N tokens
    "SYNCLESS_L2_PREFETCH",     # skinny GEMM bulk L2 prefetch bytes
    "SYNCLESS_FUSED_MLP",       # one-launch batch-1 MLP block (kernels.ops.mlp_block)
    "SYNCLESS_ROPE_IN_ATTENTION",  # decode: rope + KV write inside attention (kernels.ops)
    "SYNCLESS_SKINNY_TUNING",   # another decode-GEMM tuning table (kernels.skinny_gemm)
    "SYNCLESS_TILE_GEMM",       # 0: cuBLAS for mid-sized batches too (kernels.tile_gemm)
    "SYNCLESS_TILE_GEMM_TUNING",  # another mid-batch GEMM tuning table (kernels.tile_gemm)
    "SYNCLESS_TP_ALLREDUCE",    # nccl | symm: small TP all-reduces (workers.symm_all_reduce)
    "SYNCLESS_TP_SYMM_MAX_BYTES",  # ... the symmetric buffer's size
    "SYNCLESS_NORM_HANDOFF",    # batch 1: RMSNorm done by the producing GEMV (kernels.norm_handoff)
    "SYNCLESS_ATTN_RELEASE",    # A/B: decode attention releases the next kernel early | late
    "SYNCLESS_DECODE_ATTN_STAGES",  # A/B: one-token decode attention pipelining depth
    "SYNCLESS_ATTN_PRELOAD",    # A/B: ... its one tile loaded before the PDL wait (kernels.pdl)
    "SYNCLESS_ATTN_MERGE",      # A/B: one-pass merge of the decode attention splits (kernels.pdl)
    "SYNCLESS_DECODE_LAYER",    # batch 1: a whole decoder layer in one launch (kernels.decode_layer)
    "SYNCLESS_DECODE_LAYER_CONFIG",  # A/B: that kernel's config (kernels.decode_layer)
)


def kernel_env_vars() -> dict[str, str]:
    """The switches set in this process's environment: for a worker's ``runtime_env`` on
    the driver, and what a worker sees (``WorkerActor.describe``). A malformed PDL,
    norm-handoff, decode-layer or TP all-reduce switch raises ``ValueError`` here, at
    start-up, rather than at a kernel launch mid-serving."""
    from kernels import decode_layer, norm_handoff, ops, pdl, tile_gemm
    from workers import symm_all_reduce

    pdl.validate_switches()
    norm_handoff.enabled()
    ops.decode_layer_enabled()
    tile_gemm.validate_switches()
    decode_layer.config_from_env()
    symm_all_reduce.validate_switches()
    return {name: os.environ[name] for name in KERNEL_SWITCHES if name in os.environ}
