"""``benchmarks.child_process.spawn_session``: a child in its own session dies with its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_PARENT = """
import subprocess, sys, time
from benchmarks.child_process import spawn_session
cmd = [sys.executable, "-c", "import time; time.sleep(120)"]
child = spawn_session(cmd) if sys.argv[1] == "spawn_session" else subprocess.Popen(cmd, start_new_session=True)
print(child.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z"


def _child_after_parent_killed(how: str, wait_s: float) -> bool:
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, how], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        assert _alive(child)
        parent.kill()  # SIGKILL: no cleanup of the parent's runs
        parent.wait(10)
        deadline = time.monotonic() + wait_s
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        return _alive(child)
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_child_ends_when_its_parent_is_killed():
    assert not _child_after_parent_killed("spawn_session", wait_s=10)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_plain_session_child_outlives_its_parent():
    """The control: without ``spawn_session`` the child is orphaned (what the helper fixes)."""
    assert _child_after_parent_killed("plain", wait_s=1.5)
