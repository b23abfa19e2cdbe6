"""Shared timing helpers of the kernel microbenchmarks.

Every timing is a CUDA-graph replay of many back-to-back calls (launch gaps as inside the
engine's decode graphs), rotating over enough copies of the operands to exceed L2, median of
5 replays.
"""

from __future__ import annotations

import statistics

import torch

from kernels.settings import overridden

L2_BYTES = 60 << 20


def rotation_copies(nbytes: int, cap: int = 32) -> int:
    """How many copies of an ``nbytes`` operand a timing loop rotates through so that
    together they exceed L2 four times over (every call reads from HBM), at most ``cap``."""
    return max(1, min(cap, -(-4 * L2_BYTES // nbytes)))


def graph_time_us(fns, target_ms: float = 2.0) -> float:
    """Median per-call time of a graph of calls cycling through ``fns``."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    start, end = (
        torch.cuda.Event(enable_timing=True),
        torch.cuda.Event(enable_timing=True),
    )
    start.record()
    for f in fns:
        f()
    end.record()
    end.synchronize()
    est_ms = max(start.elapsed_time(end) / len(fns), 1e-3)
    reps = max(len(fns), min(2000, int(target_ms / est_ms)))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(g, stream=side):
        for i in range(reps):
            fns[i % len(fns)]()
    torch.cuda.current_stream().wait_stream(side)
    times = []
    for _ in range(5):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    del g
    return statistics.median(times)


GEMM_SHAPES = {  # name -> (N, K, variant), Llama-3.1-8B and Qwen3-0.6B decode projections
    "8b_qkv": (6144, 4096, "norm"),
    "8b_o": (4096, 4096, "plain"),
    "8b_gate_up": (28672, 4096, "norm_act_pairs"),
    "8b_down": (4096, 14336, "plain"),
    "8b_lm_head": (128256, 4096, "logits"),
    "06b_qkv": (4096, 1024, "norm"),
    "06b_o": (1024, 2048, "plain"),
    "06b_gate_up": (6144, 1024, "norm_act_pairs"),
    "06b_down": (1024, 3072, "plain"),
    "06b_lm_head": (151936, 1024, "logits"),
}
# gate|up is measured in the layout the model loads (row pairs: workers/models/llama.py)
KIND = {
    "plain": "plain",
    "norm": "norm",
    "norm_act": "norm_act",
    "norm_act_pairs": "norm_act_pairs",
    "logits": "plain_f32",
}


def gemm_args(parser, ms: str, shapes: str) -> tuple[list[int], list[str]]:
    """A GEMM benchmark's ``--ms`` and ``--shapes`` values, checked (``parser.error`` names
    the known shapes)."""
    rows, names = [int(v) for v in ms.split(",")], shapes.split(",")
    bad = [s for s in names if s not in GEMM_SHAPES]
    if bad or any(m < 1 for m in rows):
        parser.error(f"unknown shapes {bad} (known: {sorted(GEMM_SHAPES)}) or a batch below 1")
    return rows, names


def gemm_call_kwargs(variant, m, k, dtype, dev):
    kw = {}
    if variant in ("norm", "norm_act", "norm_act_pairs"):
        kw["norm_weight"] = torch.ones(k, device=dev, dtype=dtype)
        kw["residual"] = torch.randn(m, k, device=dev, dtype=dtype)
    if variant in ("norm_act", "norm_act_pairs"):
        kw["act"] = "silu_and_mul_pairs" if variant == "norm_act_pairs" else "silu_and_mul"
    if variant == "logits":
        kw["out_dtype"] = torch.float32
    return kw


def attention_caches(b, ctx, hkv, bound, d, bs, dev, dt):
    """Paged K/V caches and block tables for ``b`` rows of ``bound`` tokens, enough copies
    to rotate through more than L2; returns (KV bytes one call reads, the copies)."""
    per = -(-bound // bs)
    kv_bytes = b * ctx * hkv * d * 2 * 2
    copies = rotation_copies(kv_bytes, cap=64)
    return kv_bytes, [
        (
            torch.randn(b * per, bs, hkv, d, device=dev, dtype=dt),
            torch.randn(b * per, bs, hkv, d, device=dev, dtype=dt),
            torch.randperm(b * per, device=dev, dtype=torch.int32).view(b, per),
        )
        for _ in range(copies)
    ]


def with_pdl(on: bool, fn):
    """``fn()`` with PDL on (in every pass) or off, the other kernel settings as installed."""
    with overridden(pdl="on" if on else "off"):
        return fn()
