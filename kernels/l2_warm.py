"""Warming the next kernels' weights into L2 while a latency-bound launch runs.

At decode batch 1-8 a layer's attention reads ~2 MB of K/V through a chain of dependent
round trips (~10 us on an H200) while most SMs sit idle and HBM is nearly silent. The
launches after it (o_proj, norm + gate|up, down) stream weights that no kernel of the step
writes. Extra programs of the attention launch (``WARM_SPLITS`` past its real splits,
scheduled after them) spend that idle time asking the copy engine to stream those weights
into L2 (``cp.async.bulk.prefetch.L2``: fire and forget, no registers, no result), so the
projections start on L2 hits instead of a DRAM ramp.

A prefetch is only a hint: it can never return stale data (L2 is the coherence point), so
the output is bit-identical with warming on or off; only timing changes. The warmed bytes
are capped by a budget (``SYNCLESS_L2_WARM_MB``) below the L2 size, so the warm set does not
evict itself before it is read. CUDA sm_90+ only (the bulk prefetch), never interpreted.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.pdl import prefetch_l2

MAX_RANGES = 3
CHUNK_BYTES = 16 * 1024  # one bulk prefetch; a multiple of 16
# Default budget, MB. Placeholder until the H200 A/B (notes/2026-12-04e-*) picks one.
DEFAULT_BUDGET_MB = 24


@dataclass(frozen=True)
class WarmSet:
    """Up to ``MAX_RANGES`` byte ranges to warm, as offsets from ``base`` (a uint8 view of
    the first tensor): kernel arguments fixed at capture, valid while the weights live."""

    base: torch.Tensor
    ranges: tuple[tuple[int, int], ...]  # (byte offset from base, byte count), counts % 16 == 0

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.ranges)

    def kernel_args(self) -> tuple:
        """``(base, off0, n0, off1, n1, off2, n2)``; unused ranges are ``(0, 0)``."""
        flat: list[int] = []
        for off, n in self.ranges + ((0, 0),) * (MAX_RANGES - len(self.ranges)):
            flat += [off, n]
        return (self.base, *flat)


def budget_bytes() -> int:
    """``SYNCLESS_L2_WARM_MB`` (a non-negative integer, MB; 0 turns warming off)."""
    raw = os.environ.get("SYNCLESS_L2_WARM_MB", "").strip()
    if not raw:
        return DEFAULT_BUDGET_MB << 20
    if not raw.isdigit():
        raise ValueError(f"SYNCLESS_L2_WARM_MB must be a non-negative integer (MB), got {raw!r}")
    return int(raw) << 20


def warm_set(tensors, budget: int) -> WarmSet | None:
    """The first ``budget`` bytes of ``tensors`` in the order given (the order the launches
    after the warming one read them); the last range may be cut short. None when nothing
    fits or a tensor is not contiguous (its bytes would not be one range)."""
    tensors = list(tensors)
    if not tensors or budget < 16 or not all(t.is_contiguous() for t in tensors):
        return None
    base = tensors[0].reshape(-1).view(torch.uint8)
    ranges, left = [], budget
    for t in tensors[:MAX_RANGES]:
        n = min(t.numel() * t.element_size(), left) // 16 * 16
        if n == 0 or (t.data_ptr() % 16):
            break
        ranges.append((t.data_ptr() - base.data_ptr(), n))
        left -= n
    return WarmSet(base, tuple(ranges)) if ranges else None


def warm_programs(busy_ctas: int, groups: int, num_sms: int) -> int:
    """Warm programs per (query block, KV head) group: together about one per SM the real
    programs leave free (at least one SM's worth when they fill the GPU)."""
    free = max(num_sms - busy_ctas, num_sms // 8)
    return max(1, triton.cdiv(free, max(groups, 1)))


def usable(t: torch.Tensor) -> bool:
    """Whether a launch on ``t``'s device may carry warm programs (sm_90+, not interpreted)."""
    return pdl.bulk_prefetch_ok(t)


@triton.jit
def _warm_range(base, off, n, w, W, CHUNK: tl.constexpr):
    for c in range(w, tl.cdiv(n, CHUNK), W):
        start = c.to(tl.int64) * CHUNK
        prefetch_l2(base + off + start, tl.minimum(n - start, CHUNK).to(tl.int32))


@triton.jit
def warm_l2(base_ptr, off0, n0, off1, n1, off2, n2, w, W,
            RANGES: tl.constexpr, CHUNK: tl.constexpr):
    """Program ``w`` of ``W``: bulk-prefetch its round-robin share of ``CHUNK``-byte pieces
    of each range into L2."""
    _warm_range(base_ptr, off0, n0, w, W, CHUNK)
    if RANGES > 1:
        _warm_range(base_ptr, off1, n1, w, W, CHUNK)
    if RANGES > 2:
        _warm_range(base_ptr, off2, n2, w, W, CHUNK)
