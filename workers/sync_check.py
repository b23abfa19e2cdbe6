"""The sync check: turns implicit host<->device synchronizations inside a step into errors.

PyTorch's CUDA sync-debug mode reports every synchronizing call (``.item()``,
``.cpu()``, ``.tolist()``, ``nonzero``, boolean-mask indexing, blocking copies)
as a warning raised in the calling thread. While the check is armed the process
runs in that mode and a hook on ``warnings.showwarning`` decides per thread: in
the armed thread (the one executing a step) the warning becomes ``SyncError``
("error") or a logged report ("warn") naming the call site; other threads are
untouched. The mode comes from the engine config through the actor's
constructor, never from the environment, so it cannot miss an import.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import traceback
import warnings

logger = logging.getLogger(__name__)

_local = threading.local()
_SYNC_MARKER = "synchronizing CUDA operation"


class SyncError(RuntimeError):
    """An implicit host<->device synchronization happened inside a step."""


def _call_site() -> str:
    frames = [
        f for f in traceback.extract_stack()[:-3]
        if "warnings" not in f.filename and "sync_check" not in f.filename
    ]
    if not frames:
        return "<unknown>"
    f = frames[-1]
    return f"{f.filename}:{f.lineno} in {f.name}: {f.line}"


class SyncCheck:
    """Per-worker sync check; ``mode`` is 'off', 'warn' or 'error'."""

    _installed = False
    _install_lock = threading.Lock()

    def __init__(self, mode: str):
        if mode not in ("off", "warn", "error"):
            raise ValueError(f"sync_check must be 'off', 'warn' or 'error', got {mode!r}")
        self.mode = mode
        self.reports: list[str] = []

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
                    site = _call_site()
                    if check.mode == "error":
                        raise SyncError(f"implicit host<->device sync inside a step at {site}")
                    check.reports.append(site)
                    logger.warning("implicit host<->device sync inside a step at %s", site)
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
        prev = getattr(_local, "armed", None)
        _local.armed = self
        try:
            yield
        finally:
            _local.armed = prev


@contextlib.contextmanager
def allow_sync(reason: str):
    """Disarm around a deliberate, documented wait (``reason`` says why it is allowed)."""
    _local.allowed = getattr(_local, "allowed", 0) + 1
    try:
        yield
    finally:
        _local.allowed -= 1
