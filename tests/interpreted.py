"""Run the kernel tests in a child pytest under ``TRITON_INTERPRET=1``.

TRITON_INTERPRET must be set before *triton itself* is imported: triton's own
``tl.max``/``tl.cdiv`` helpers are decorated at import time, and an interpreted
kernel calling compiled helpers fails ("Cannot call @triton.jit'd outside of
the scope of a kernel"). Setting it in the pytest process would also make
every kernel imported later interpreted, including those of the GPU tests
collected with ``-m gpu``. So the modules using this run their tests in a child pytest
with TRITON_INTERPRET=1 set from the start, and each test of the parent process reports its
own child outcome.

One child runs every delegated test the session selected, started in the background as
soon as collection ends (``start_child``, from ``tests/conftest.py``): the interpreter is
single-threaded Python, so it runs beside the parent's tests, and its results are usually
in by the time the parent reaches the first of them. A delegated test the child was not
given (a module run some other way) gets a child of its own module.
"""

import atexit
import functools
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # true in the child
ROOT = Path(__file__).resolve().parents[1]
CHILD_TIMEOUT_S = 1800


class _Child:
    """One child pytest under the interpreter, running ``args`` (node ids or files)."""

    def __init__(self, args: list[str]):
        self.tmp = tempfile.TemporaryDirectory()
        self.xml_path = os.path.join(self.tmp.name, "junit.xml")
        self.log = open(os.path.join(self.tmp.name, "child.log"), "w+")  # noqa: SIM115 - read in outcomes()
        env = dict(os.environ, TRITON_INTERPRET="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        cmd = [sys.executable, "-m", "pytest", *args, "-q", "-m", "not gpu", "-p", "no:cacheprovider"]
        self.proc = subprocess.Popen(
            [*cmd, f"--junitxml={self.xml_path}"], cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT
        )
        self._outcomes = None
        atexit.register(self.stop)

    def outcomes(self) -> dict:
        """``(module, test name) -> None | failure text``, once the child has ended."""
        if self._outcomes is None:
            try:
                self.proc.wait(timeout=CHILD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.stop()
            if not os.path.exists(self.xml_path):
                self.log.seek(0)
                raise RuntimeError(f"interpreted child pytest did not run:\n{self.log.read()[-4000:]}")
            self._outcomes = {}
            for case in ET.parse(self.xml_path).iter("testcase"):
                bad = case.find("failure") if case.find("failure") is not None else case.find("error")
                key = (case.get("classname"), case.get("name"))
                self._outcomes[key] = None if bad is None else (bad.text or bad.get("message"))
        return self._outcomes

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


_children: dict[str, _Child] = {}  # module file -> the child running its tests


def start_child(items) -> None:
    """Start one background child for the delegated tests among ``items`` (the session's
    selected tests); no child when there are none (``-m gpu``) or in the child itself."""
    if INTERPRETED:
        return
    nodeids = [item.nodeid for item in items if getattr(getattr(item, "obj", None), "interpreted_file", None)]
    if nodeids:
        child = _Child(nodeids)
        for item in items:
            file = getattr(getattr(item, "obj", None), "interpreted_file", None)
            if file is not None:
                _children[file] = child


def _module_name(test_file: str) -> str:
    return ".".join(Path(test_file).resolve().relative_to(ROOT).with_suffix("").parts)


def _delegate(fn, test_file: str):
    """Same name, params and marks as ``fn``; asserts the child's outcome for it."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        name = os.environ["PYTEST_CURRENT_TEST"].rsplit(" (", 1)[0].split("::")[-1]
        if test_file not in _children:
            _children[test_file] = _Child([test_file])
        outcomes = _children[test_file].outcomes()
        key = (_module_name(test_file), name)
        if key not in outcomes:
            pytest.fail(f"{name} did not run in the interpreted child", pytrace=False)
        if outcomes[key] is not None:
            pytest.fail(f"under TRITON_INTERPRET=1:\n{outcomes[key]}", pytrace=False)

    wrapper.interpreted_file = test_file
    return wrapper


def delegate_all(namespace: dict, test_file: str) -> None:
    """In the parent process, replace every ``test_*`` of a module by its child outcome."""
    if INTERPRETED:
        return
    test_file = str(Path(test_file).resolve())
    for name, fn in list(namespace.items()):
        if name.startswith("test_") and callable(fn):
            namespace[name] = _delegate(fn, test_file)
