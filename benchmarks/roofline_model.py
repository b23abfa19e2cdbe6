"""The decode roofline's arithmetic: the device's copy bandwidth (measured), the weight bytes
a decode step reads, the phase-by-phase floor, and what a profiled step is made of.
Shared by ``benchmarks.decode_roofline`` and ``benchmarks.throughput``."""

from __future__ import annotations

import time
from typing import Any


def measure_bandwidth(device, nbytes: int, iters: int) -> dict[str, Any]:
    """Best of 3 runs of ``iters`` copies of an ``nbytes`` buffer; counts read + write."""
    import torch

    n = nbytes // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(3):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            for _ in range(iters):
                dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000.0 / iters)
        else:
            t = time.perf_counter()
            for _ in range(iters):
                dst.copy_(src)
            times.append((time.perf_counter() - t) / iters)
    best = min(times)
    del src, dst
    return {
        "bytes_per_copy": 2 * n * 4,
        "buffer_bytes": n * 4,
        "iters": iters,
        "seconds_per_copy": best,
        "bandwidth_bytes_per_s": 2 * n * 4 / best,
        "method": "torch copy_, read + write bytes",
    }


def weight_bytes_per_step(model, batch: int, count_params: bool = False) -> int:
    """Bytes of weights one decode step reads: every matrix once; of an untied
    embedding table only the ``batch`` looked-up rows. ``count_params``: the number of
    weights instead (FP8 projections take one byte each, the rest two)."""
    seen, total = set(), 0
    emb = getattr(model, "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    tied = emb is not None and head is not None and head.weight is emb.weight
    for name, prm in model.named_parameters():
        if id(prm) in seen:
            continue
        seen.add(id(prm))
        size = 1 if count_params else prm.element_size()
        nbytes = prm.numel() * size
        if emb is not None and prm is emb.weight and not tied:
            nbytes = batch * prm.shape[-1] * size
        total += nbytes
    return total


def phase_floor_s(
    weight_bytes: int, kv_bytes: int, dtype_bytes: int, batch: int, bandwidth: float, matmul_flops: float
) -> float:
    """A step's floor phase by phase: the GEMMs at the larger of their weight read and
    their FLOPs (2 x weights x rows) over the measured matmul rate, then attention at its
    KV read. Above the memory roofline once the GEMMs turn compute-bound (8B at b256)."""
    gemm_s = max(weight_bytes / bandwidth, 2 * batch * weight_bytes / dtype_bytes / matmul_flops)
    return gemm_s + kv_bytes / bandwidth


def device_split(kernel_us: float, step_ms: float, roofline_ms: float) -> dict[str, float]:
    """What a profiled cell's step is made of: ``kernel_ratio`` = kernel time per step over
    the roofline (the ratio with a host that never made the device wait) and
    ``device_idle_fraction`` = the share of the (pipelined) step the device spent waiting.
    Empty without device kernels (a CPU run), where the split means nothing."""
    if kernel_us <= 0 or step_ms <= 0 or roofline_ms <= 0:
        return {}
    return {
        "kernel_ratio": kernel_us / 1e3 / roofline_ms,
        "device_idle_fraction": max(0.0, 1.0 - kernel_us / 1e3 / step_ms),
    }
