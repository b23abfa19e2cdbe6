"""The sync check: turns implicit host<->device synchronizations inside a step into errors.

PyTorch's CUDA sync-debug mode reports every synchronizing call (``.item()``,
``.cpu()``, ``.tolist()``, ``nonzero``, boolean-mask indexing, blocking copies)
as a warning raised in the calling thread. While the check is armed the process
runs in that mode and a hook on ``warnings.showwarning`` decides per thread: in
the armed thread (the one executing a step) the warning becomes ``SyncError``
("error") or a logged report ("warn") naming the call site; other threads are
untouched. The mode comes from the engine config through the actor's
constructor, never from the environment, so it cannot miss an import.

Sync-debug mode does not see the caching allocator: when an allocation does not fit,
the allocator frees its cached blocks (``cudaFree`` waits for the whole device) and
retries. The armed check compares the allocator's retry count before and after the
step and treats a retry like any other implicit sync; growth of the pool
(``cudaMalloc``, a new segment) is counted (the worker's ``stats()["allocator_growths"]``),
not refused: a step of a new size may grow it once.

Nor does it see a full launch queue or a pageable host-to-device copy: with ``device_type``
given (the worker's, on CUDA), the armed step also runs under ``workers.launch_audit``, which
reports those copies at their call site and a step that enqueues more than ``launch_budget``
device operations outside its CUDA graphs (None: no budget, for workers whose forwards run
eagerly by design).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import traceback
import warnings

from workers import launch_audit

logger = logging.getLogger(__name__)

_local = threading.local()
_SYNC_MARKER = "synchronizing CUDA operation"


class SyncError(RuntimeError):
    """An implicit host<->device synchronization happened inside a step."""


def _call_site() -> str:
    frames = [
        f for f in traceback.extract_stack()[:-3] if "warnings" not in f.filename and "sync_check" not in f.filename
    ]
    if not frames:
        return "<unknown>"
    f = frames[-1]
    return f"{f.filename}:{f.lineno} in {f.name}: {f.line}"


class SyncCheck:
    """Per-worker sync check; ``mode`` is 'off', 'warn' or 'error'."""

    _installed = False
    _install_lock = threading.Lock()

    def __init__(
        self, mode: str, device_type: str | None = None, launch_budget: int | None = launch_audit.LAUNCH_BUDGET
    ):
        if mode not in ("off", "warn", "error"):
            raise ValueError(f"sync_check must be 'off', 'warn' or 'error', got {mode!r}")
        self.mode = mode
        self.device_type, self.launch_budget = device_type, launch_budget
        self.reports: list[str] = []
        self.allocator_growths = 0  # steps that added a segment to the CUDA caching allocator

    def _install(self) -> None:
        with SyncCheck._install_lock:
            if SyncCheck._installed:
                return
            import torch

            original = warnings.showwarning

            def hook(message, category, filename, lineno, file=None, line=None):
                check: SyncCheck | None = getattr(_local, "armed", None)
                if check is not None and _SYNC_MARKER in str(message):
                    if getattr(_local, "allowed", 0):
                        return
                    check._report(f"implicit host<->device sync inside a step at {_call_site()}")
                    return
                if _SYNC_MARKER in str(message):
                    return  # another thread: the check does not apply there
                original(message, category, filename, lineno, file, line)

            warnings.showwarning = hook
            warnings.filterwarnings("always", message=f".*{_SYNC_MARKER}.*")
            if torch.cuda.is_available():  # a CPU-only torch has no sync-debug mode (nothing to sync)
                torch.cuda.set_sync_debug_mode("warn")
            SyncCheck._installed = True

    @contextlib.contextmanager
    def armed(self):
        """Arm for the current thread for the duration of one step."""
        if self.mode == "off":
            yield
            return
        self._install()
        before = _allocator_counts()
        prev = getattr(_local, "armed", None)
        _local.armed = self
        audit = launch_audit.LaunchAudit(self.device_type, self._report) if self.device_type else None
        try:
            with audit if audit is not None else contextlib.nullcontext():
                yield
        finally:
            _local.armed = prev
        if audit is not None and self.launch_budget is not None and audit.launches > self.launch_budget:
            self._report(
                f"a step enqueued {audit.launches} device operations outside its CUDA graphs (budget "
                f"{self.launch_budget}; the device queues about 1,000 before a launch waits for it): "
                f"{audit.top_ops()}"
            )
        if before is not None:
            self._check_allocator(before, _allocator_counts())

    def _report(self, msg: str) -> None:
        if self.mode == "error":
            raise SyncError(msg)
        self.reports.append(msg)
        logger.warning(msg)

    def _check_allocator(self, before: tuple[int, int], after: tuple[int, int]) -> None:
        if after[0] > before[0]:
            msg = (
                "the CUDA caching allocator ran out of cached memory inside a step, freed its "
                "cache and retried (cudaFree waits for the device); lower gpu_memory_utilization "
                "or max_num_batched_tokens"
            )
            self._report(msg)
        if after[1] > before[1]:
            self.allocator_growths += 1


def _allocator_counts() -> tuple[int, int] | None:
    """(allocation retries, segments) of the current CUDA device, or None without CUDA."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    stats = torch.cuda.memory_stats()
    return stats.get("num_alloc_retries", 0), stats.get("segment.all.current", 0)


@contextlib.contextmanager
def allow_sync(reason: str):
    """Disarm around a deliberate, documented wait (``reason`` says why it is allowed)."""
    _local.allowed = getattr(_local, "allowed", 0) + 1
    launch_audit.deliberate(+1)
    try:
        yield
    finally:
        _local.allowed -= 1
        launch_audit.deliberate(-1)
