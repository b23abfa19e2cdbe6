"""Programmatic dependent launch (PDL, Hopper and newer) for the decode-path kernels.

A decode step at small batch is a chain of ~200-300 short kernels; each pays a
launch and a ramp (CTA scheduling, the first DRAM round trip) before it streams.
With PDL a kernel launched with ``launch_pdl=True`` may start while the kernel
before it in the stream is still running, and waits in ``gdc_wait`` (PTX
``griddepcontrol.wait``) until that kernel has completed and its writes are
visible. The protocol every kernel here follows:

1. before ``gdc_wait``: index math, loads of data that the kernel just before
   cannot have written (weights, norm weights, the rotary table; the step's
   lengths, positions and block table, written before its first layer), and
   cache hints (an L2 prefetch never returns stale data: L2 is the coherence
   point). The skinny GEMM peels its first K chunk here; the fused-rope decode
   attention loads a one-tile split's K/V tile into registers (those keys are from
   earlier steps);
2. ``gdc_wait()``, then ``gdc_launch_dependents()`` (let the next kernel launch);
3. everything else: activations, the KV cache's loads, every store.

Triggering only *after* our own wait makes the chain transitive: when kernel
N+1 starts, kernel N has passed its wait, so kernel N-1 and everything before
it have completed. Nothing is stored before the wait, so there is no
write-after-read hazard either. Kernels launched without the attribute
(cuBLAS, torch ops, copies) neither trigger early nor start early, so mixing
is safe. Inside a CUDA graph capture the dependency is recorded as a
programmatic edge (CUDA 12.3+).

The ``pdl`` option (``KernelSettings.pdl``): ``auto`` (the default) uses PDL only inside
declared forward passes of one token (batch-1 decode; ``pdl_max_tokens`` moves that limit),
``on`` in every pass of at most ``pdl_max_tokens`` tokens (0: any) and in the sampler, ``off``
nowhere. Why auto: PDL makes every batch-1 decode step faster (2-9 %, both model shapes,
both contexts) but batch-8 steps slower (4-8 % at Qwen3-0.6B); a chain of tiny kernels
costs 0.70 us a kernel with PDL against 0.99 us without (docs/decisions.md). The skinny
GEMM peels its first K chunk before the wait: without it the 8B batch-1 step was 2.6 %
slower with PDL on; peeling two chunks was 1 % slower. PDL never
applies to CPU tensors, the Triton interpreter, GPUs below compute capability 9,
or a Triton without ``gdc_wait``.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch
import triton
import triton.language as tl

from kernels.settings import TRITON_INTERPRETED, current

try:  # triton >= 3.3 exposes grid dependency control
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401

    HAVE_GDC = True
except ImportError:  # pragma: no cover - depends on the installed triton
    HAVE_GDC = False

AUTO_MAX_TOKENS = 1  # auto mode: passes of at most this many tokens (batch-1 decode)


@functools.lru_cache(maxsize=None)
def _capable(device_index: int) -> bool:
    major, _ = torch.cuda.get_device_capability(device_index)
    return major >= 9


_scope = threading.local()


@contextlib.contextmanager
def step_tokens(n: int):
    """Declares the token count of the forward pass being launched (a CPU int): PDL
    applies only to passes of at most ``pdl_max_tokens`` tokens (under ``auto``: one token
    unless set), where the kernels are short enough for the overlap to pay. Kernels launched
    outside a declared pass (the sampler's) use PDL only under ``pdl = 'on'``."""
    prev = getattr(_scope, "tokens", None)
    _scope.tokens = n
    try:
        yield
    finally:
        _scope.tokens = prev


def _token_limit_allows(pdl_mode: str, limit: int) -> bool:
    """Whether the declared pass is short enough for PDL under ``pdl_mode``."""
    tokens = getattr(_scope, "tokens", None)
    if pdl_mode == "auto":  # only inside a declared pass, of at most the limit (default 1)
        return tokens is not None and tokens <= (limit if limit > 0 else AUTO_MAX_TOKENS)
    return limit <= 0 or tokens is None or tokens <= limit


def enabled(t: torch.Tensor) -> bool:
    """Whether kernels launched on ``t``'s device use PDL."""
    if not (HAVE_GDC and t.is_cuda):
        return False
    settings = current()
    if settings.pdl == "off" or not _token_limit_allows(settings.pdl, settings.pdl_max_tokens):
        return False
    if TRITON_INTERPRETED:
        return False
    idx = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return _capable(idx)


def launch_kwargs(t: torch.Tensor) -> dict:
    """Extra launch arguments: the ``USE_PDL`` constexpr and, when on, ``launch_pdl``."""
    if enabled(t):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


@triton.jit
def prefetch_lines_l2(ptrs, mask):
    """Step 1's gathered form: every element of ``ptrs`` where ``mask`` holds names a
    cache line to fetch into L2 (PTX ``prefetch.global.L2``, one per element, spread over
    the program's threads). For scattered rows (paged K/V) that no bulk copy covers."""
    tl.inline_asm_elementwise(
        "{ .reg .pred pf; setp.ne.b32 pf, $2, 0; @pf prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r",
        [ptrs, mask.to(tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached): grid sizing of resident or
    SM-proportional launches."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


if HAVE_GDC:

    @triton.jit
    def wait_and_release(USE_PDL: tl.constexpr):
        """Step 2 of the protocol: wait for the previous kernel, then let the next launch."""
        if USE_PDL:
            gdc_wait()
            gdc_launch_dependents()

    @triton.jit
    def wait_only(USE_PDL: tl.constexpr):
        """Step 2 split in two: the wait ..."""
        if USE_PDL:
            gdc_wait()

    @triton.jit
    def release_only(USE_PDL: tl.constexpr):
        """... and, later (after the wait, so the chain stays transitive), the release."""
        if USE_PDL:
            gdc_launch_dependents()
else:  # pragma: no cover

    @triton.jit
    def wait_and_release(USE_PDL: tl.constexpr):
        pass

    @triton.jit
    def wait_only(USE_PDL: tl.constexpr):
        pass

    @triton.jit
    def release_only(USE_PDL: tl.constexpr):
        pass
