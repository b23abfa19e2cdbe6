"""One-shot all-reduce over PyTorch symmetric memory, for decode-sized tensors on NVLink GPUs.

A decode step of a TP group all-reduces two small activations a layer (batch x hidden:
8 KB at batch 1 of an 8B model). NCCL spends about 15-20 us on each on two H200s
(notes/2026-12-04g-h200x2-tp-results.md); a one-shot kernel over symmetric memory
(every rank reads every peer's buffer over NVLink and sums) is one launch with no
protocol handshakes. ``one_shot_all_reduce_copy_out`` copies the local input into this
rank's symmetric buffer, meets the peers at a barrier on the buffers' signal pads and
writes the sum to a fresh output: it runs on the current stream, never waits on the
host, and captures into CUDA graphs.

Chosen by the kernel switch ``SYNCLESS_TP_ALLREDUCE``: ``nccl`` (the default) or
``symm`` (experimental: written while no multi-GPU machine was lent, so not yet run on GPUs;
tests/test_gpu_tensor_parallel.py and ``SYMM_AB=1`` in notes/2026-12-04g-device-run.sh
check and time it). ``SYNCLESS_TP_SYMM_MAX_BYTES`` (default 2 MiB) sizes the buffer; larger
tensors (prefill) and the overlapped micro-batches keep using NCCL. Multicast is not
used (the one-shot kernel needs only peer access), so ``TORCH_SYMM_MEM_DISABLE_MULTICAST``
stays set.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

logger = logging.getLogger(__name__)

SWITCH = "SYNCLESS_TP_ALLREDUCE"
MAX_BYTES_SWITCH = "SYNCLESS_TP_SYMM_MAX_BYTES"
DEFAULT_MAX_BYTES = 2 << 20
DTYPES = (torch.bfloat16, torch.float32)  # what the one-shot kernel dispatches on (no fp16)


def backend_choice() -> str:
    """``nccl`` or ``symm``; anything else raises ``ValueError`` (checked at start-up)."""
    raw = os.environ.get(SWITCH, "").strip().lower()
    if raw in ("", "nccl"):
        return "nccl"
    if raw == "symm":
        return "symm"
    raise ValueError(f"{SWITCH} must be nccl or symm, got {raw!r}")


def max_bytes() -> int:
    raw = os.environ.get(MAX_BYTES_SWITCH, "").strip()
    if not raw:
        return DEFAULT_MAX_BYTES
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 4096:
        raise ValueError(f"{MAX_BYTES_SWITCH} must be an integer of at least 4096 bytes, got {raw!r}")
    return n


def validate_switches() -> None:
    backend_choice()
    max_bytes()


class SymmAllReduce:
    """This rank's symmetric buffer and the one-shot all-reduce into a new tensor.

    Built collectively (every rank of ``group`` at once: the rendezvous exchanges the
    buffers' memory handles)."""

    def __init__(self, group: Any, device: torch.device, nbytes: int):
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        pg = group if group is not None else dist.group.WORLD
        self.group_name = pg.group_name
        self.max_bytes = nbytes
        self.buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)
        self.calls = 0  # how many all-reduces took this path (WorkerActor.stats)

    def fits(self, x: torch.Tensor) -> bool:
        """Small, contiguous, a dispatched dtype, and 16-byte aligned like the buffer (the
        kernel checks that the input's alignment matches its symmetric buffer's)."""
        nbytes = x.numel() * x.element_size()
        return (x.is_cuda and x.dtype in DTYPES and x.is_contiguous() and nbytes <= self.max_bytes
                and nbytes % 16 == 0 and (x.storage_offset() * x.element_size()) % 16 == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        staged = self.buffer[: x.numel() * x.element_size()].view(x.dtype).view(x.shape)
        out = torch.empty_like(x)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(staged, x, "sum", self.group_name, out)
        self.calls += 1  # host-side count: in a captured graph, once per capture
        return out


def maybe_create(backend: str, group: Any, device: torch.device) -> SymmAllReduce | None:
    """The symmetric all-reduce when the switch asks for it on NCCL GPUs, else None.
    Asked for where it cannot run (gloo on CPUs), it says so and NCCL/gloo stays."""
    if backend_choice() != "symm":
        return None
    if backend != "nccl" or device.type != "cuda":
        logger.warning("%s=symm needs CUDA GPUs on NCCL; this group runs %s on %s, so its "
                       "all-reduce stays %s", SWITCH, backend, device.type, backend)
        return None
    try:
        return SymmAllReduce(group, device, max_bytes())
    except Exception as exc:  # no peer access, an old torch: name the switch that asked
        raise RuntimeError(f"{SWITCH}=symm: symmetric memory could not be set up on {device} "
                           f"({type(exc).__name__}: {exc}); unset {SWITCH} to use NCCL") from exc
