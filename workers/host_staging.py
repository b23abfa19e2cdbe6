"""Pinned staging buffers for the hot path's host->device copies.

Every step copies a few small packed tensors to the device (a step's inputs, new requests,
new sampling options). ``tensor.pin_memory().to(device, non_blocking=True)`` took about
100 us of host time each on an H200 with the device busy (13 us with it idle): the caching
host allocator cannot reuse a block until the copy that read it has run, so it kept creating
pinned blocks. Here a few pinned buffers are kept and reused in turn; each remembers the
copy that last read it by a CUDA event, and is reused only once that event has completed
(``cudaEventQuery``: never a wait). When every buffer is still being read, another is made.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

MIN_BUFFER_BYTES = 64 << 10
MAX_BUFFERS = 64  # past this many copies in flight, torch's own pinned allocator takes over
MAX_STAGED_BYTES = 4 << 20  # larger copies (rare: many long prompts) too: buffers never shrink


class PinnedStaging:
    """Host->device copies of one device through reused pinned buffers (thread-safe)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._slots: list[tuple[torch.Tensor, np.ndarray, torch.cuda.Event]] = []
        self._next = 0
        self._lock = threading.Lock()
        self.buffers_made = 0  # (diagnostics)

    def _slot(self, nbytes: int):
        """A buffer of at least ``nbytes`` whose last copy has completed, or None (too many in flight)."""
        n = len(self._slots)
        for i in range(n):
            j = (self._next + i) % n
            slot = self._slots[j]
            if slot[1].size >= nbytes and slot[2].query():
                self._next = (j + 1) % n
                return slot
        if n >= MAX_BUFFERS:
            return None
        size = max(MIN_BUFFER_BYTES, 1 << (nbytes - 1).bit_length())
        buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        slot = (buf, buf.numpy(), torch.cuda.Event())
        self._slots.append(slot)
        self.buffers_made += 1
        return slot

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (a CPU tensor) on the device; the copy is enqueued on the current stream."""
        t = t.contiguous()
        out = torch.empty(t.shape, dtype=t.dtype, device=self.device)
        if out.numel() == 0:
            return out
        if torch.cuda.is_current_stream_capturing():  # a graph would replay the buffer's later contents
            raise RuntimeError("PinnedStaging.copy inside a CUDA graph capture")
        self._stage(t, out)
        return out

    def copy_into(self, t: torch.Tensor, dst: torch.Tensor) -> None:
        """``t`` (a CPU tensor) copied into ``dst`` (contiguous, on the device, of its dtype and
        size): a fixed buffer, which only stream order protects (``workers.input_graphs``)."""
        if dst.dtype != t.dtype or dst.numel() != t.numel() or not dst.is_contiguous():
            raise ValueError("PinnedStaging.copy_into: the destination must match the source")
        self._stage(t.contiguous(), dst)

    def _stage(self, t: torch.Tensor, dst: torch.Tensor) -> None:
        """Contiguous ``t`` into contiguous ``dst`` of its size, through a free pinned buffer (or
        torch's pinned allocator where none is free or ``t`` is large)."""
        nbytes = t.numel() * t.element_size()
        with self._lock:
            slot = self._slot(nbytes) if nbytes <= MAX_STAGED_BYTES else None
            if slot is None:
                dst.copy_(t.pin_memory(), non_blocking=True)
                return
            buf, arr, event = slot
            arr[:nbytes] = t.view(-1).view(torch.uint8).numpy()
            dst.view(-1).view(torch.uint8).copy_(buf[:nbytes], non_blocking=True)
            event.record(torch.cuda.current_stream(self.device))  # (the copy's stream: the device's)


_staging: dict[torch.device, PinnedStaging] = {}
_staging_lock = threading.Lock()


def staging_for(device: torch.device) -> PinnedStaging:
    """The process's staging buffers for ``device`` (made on first use)."""
    s = _staging.get(device)
    if s is None:
        with _staging_lock:
            s = _staging.setdefault(device, PinnedStaging(device))
    return s
