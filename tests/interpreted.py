"""Run a test module's kernel tests in a child pytest under ``TRITON_INTERPRET=1``.

TRITON_INTERPRET must be set before *triton itself* is imported: triton's own
``tl.max``/``tl.cdiv`` helpers are decorated at import time, and an interpreted
kernel calling compiled helpers fails ("Cannot call @triton.jit'd outside of
the scope of a kernel"). Setting it in the pytest process would also make
every kernel imported later interpreted, including those of the GPU tests
collected with ``-m gpu``. So a module using this runs itself in a child pytest
with TRITON_INTERPRET=1 set from the start (once per session, all its tests
together), and each test of the parent process reports its own child outcome.
"""

import functools
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # true in the child


@functools.lru_cache(maxsize=None)
def _child_outcomes(test_file: str) -> dict:
    """Run ``test_file`` under the interpreter once; map test name -> None | failure text."""
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        xml_path = os.path.join(tmp, "junit.xml")
        env = dict(os.environ, TRITON_INTERPRET="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                test_file,
                "-q",
                "-m",
                "not gpu",
                "-p",
                "no:cacheprovider",
                f"--junitxml={xml_path}",
            ],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        if not os.path.exists(xml_path):
            raise RuntimeError(f"interpreted child pytest did not run:\n{proc.stdout}\n{proc.stderr}")
        outcomes = {}
        for case in ET.parse(xml_path).iter("testcase"):
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            outcomes[case.get("name")] = None if bad is None else (bad.text or bad.get("message"))
        return outcomes


def _delegate(fn, test_file: str):
    """Same name, params and marks as ``fn``; asserts the child's outcome for it."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        name = os.environ["PYTEST_CURRENT_TEST"].rsplit(" (", 1)[0].split("::")[-1]
        outcomes = _child_outcomes(test_file)
        if name not in outcomes:
            pytest.fail(f"{name} did not run in the interpreted child", pytrace=False)
        if outcomes[name] is not None:
            pytest.fail(f"under TRITON_INTERPRET=1:\n{outcomes[name]}", pytrace=False)

    return wrapper


def delegate_all(namespace: dict, test_file: str) -> None:
    """In the parent process, replace every ``test_*`` of a module by its child outcome."""
    if INTERPRETED:
        return
    test_file = str(Path(test_file).resolve())
    for name, fn in list(namespace.items()):
        if name.startswith("test_") and callable(fn):
            namespace[name] = _delegate(fn, test_file)
