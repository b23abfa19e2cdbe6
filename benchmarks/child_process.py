"""Child processes that never outlive the process that started them.

A server or Ray head started in its own session (so that one signal ends its whole
group) is orphaned when its parent is killed before its cleanup runs (a test or a
benchmark stopped by a timeout's SIGKILL): it kept serving, holding ports and memory.
``spawn_session`` asks the kernel to send the child SIGTERM when its parent dies
(Linux ``PR_SET_PDEATHSIG``); a server and ``ray start --block`` stop on SIGTERM.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys

_PR_SET_PDEATHSIG = 1


def _terminate_with_parent(parent: int) -> None:
    """In the child, before ``exec``: SIGTERM when the parent exits (Linux; elsewhere a no-op)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def spawn_session(cmd: list[str], **kwargs) -> subprocess.Popen:
    """``subprocess.Popen(cmd, start_new_session=True, **kwargs)`` whose child is sent
    SIGTERM when this process dies, however it dies."""
    parent = os.getpid()
    return subprocess.Popen(cmd, start_new_session=True, preexec_fn=lambda: _terminate_with_parent(parent), **kwargs)
