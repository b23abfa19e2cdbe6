"""RMSNorm handed from the GEMV that produces its input to the GEMV that consumes it.

A pre-norm decoder at batch 1 runs ``o_proj -> RMSNorm(+ residual) -> gate|up`` and
``down -> RMSNorm(+ residual) -> QKV``. The skinny GEMM fuses each norm into the
*consumer's* prologue: every consumer program re-reads ``x``, the residual and the norm
weight each K chunk and accumulates ``sum(s^2)`` beside its weight stream: a probe that
dropped those prologues bounds the cost at ~3 % of the Llama-3.1-8B batch-1 step
(docs/decisions.md).

Here the *producer* does the norm's elementwise part in its epilogue, on the columns it
owns anyway: ``s = y + residual`` (the new residual), ``s * g`` (the output, rounded where
the fused prologue rounds) and its share of ``sum(s^2)`` (one fp32 per program). The
consumer then streams ``s * g`` like a plain GEMV and scales by
``rstd = rsqrt(sum(partials) / K + eps)`` at the end, as the fused prologue does. The sum
runs in another order than the prologue's, so results agree within 16-bit tolerance, not
bit for bit; they are deterministic (no atomics).

Only where both sides are skinny-GEMM launches at ``M = 1`` on CUDA (16-bit) and tensor
parallelism is 1 (an all-reduce would sit between producer and norm); the ``norm_handoff``
option turns it off. Everywhere else ``kernels.fused_norm_ops.linear_handoff`` returns None
and the caller takes the fused-prologue path. The two device functions here are the skinny
GEMM's ``EPI_NORM`` and ``PRE_NORMED`` code (``kernels.skinny_gemm_kernel``); the dispatch is
in ``kernels.fused_norm_ops``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class PreNormed(NamedTuple):
    """A hidden state handed over as ``s * g`` (``sg [M, K]``, the norm weight applied,
    ``rstd`` not yet) with ``sum(s^2)`` split into per-program partials ``ss [M, P]``."""

    sg: torch.Tensor
    ss: torch.Tensor
    eps: float

    def materialise(self) -> torch.Tensor:
        """The normalised hidden state itself (for a consumer without the rstd epilogue)."""
        k = self.sg.shape[-1]
        rstd = torch.rsqrt(self.ss.sum(-1, keepdim=True) / k + self.eps)
        return (self.sg.float() * rstd).to(self.sg.dtype)


class Normed(NamedTuple):
    """A hidden state handed over already normalised (``x``, the next RMSNorm applied; its
    residual add already in the caller's residual): the producer's split-K sum did the norm
    (``kernels.tile_gemm.tile_linear_add_norm_triton``, mid-sized batches)."""

    x: torch.Tensor


@triton.jit
def handoff_norm(
    y, offs_m, offs_n, m_ok, n_ok, r_ptr, nw_ptr, nr_ptr, ss_ptr, stride_rm, stride_nrm, n_parts, pid, DT: tl.constexpr
):
    """Producer epilogue (``EPI_NORM``): ``s = y + residual`` (stored as the new residual),
    this program's share of ``sum(s^2)`` (stored at ``ss[m, pid]``) and ``s * g`` in place
    of ``y``: everything of the next RMSNorm except its ``rstd`` (rounded as the fused
    prologue rounds)."""
    ok = m_ok[:, None] & n_ok[None, :]
    r = tl.load(r_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=ok, other=0.0)
    s = (y.to(DT).to(tl.float32) + r.to(tl.float32)).to(DT)
    tl.store(nr_ptr + offs_m[:, None] * stride_nrm + offs_n[None, :], s, mask=ok)
    sf = tl.where(ok, s.to(tl.float32), 0.0)
    tl.store(ss_ptr + offs_m * n_parts + pid, tl.sum(sf * sf, 1), mask=m_ok)
    g = tl.load(nw_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    return (sf * g[None, :]).to(DT)


@triton.jit
def handoff_rstd(ss_ptr, offs_m, m_ok, n_parts, K, eps, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr):
    """Consumer side (``PRE_NORMED``): ``rstd`` from the producer's per-program partials."""
    offs_p = tl.arange(0, BLOCK_P)
    tot = tl.zeros([BLOCK_M, BLOCK_P], dtype=tl.float32)
    for p0 in range(0, n_parts, BLOCK_P):
        tot += tl.load(
            ss_ptr + offs_m[:, None] * n_parts + (p0 + offs_p)[None, :],
            mask=m_ok[:, None] & ((p0 + offs_p) < n_parts)[None, :],
            other=0.0,
        )
    return tl.rsqrt(tl.sum(tot, 1) / K + eps)
