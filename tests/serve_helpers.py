"""Helpers and fixtures for the serving tests: a real ``python -m cluster.serve``
subprocess on loopback, and the offline engine to compare its outputs with.

Test modules load this as a plugin (``pytest_plugins = ["tests.serve_helpers"]``)
so that the session-scoped servers are shared by all of them.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from benchmarks.child_process import spawn_session

ROOT = Path(__file__).resolve().parent.parent
API_KEY = "test-key-123"
MAX_MODEL_LEN = 512
# Engine options shared by the main server and the offline engine it is compared with.
ENGINE_OPTS = {"max_model_len": MAX_MODEL_LEN, "block_size": 16, "num_kv_blocks": 512, "max_num_seqs": 256}


_HANDED_OUT: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 65535  # Linux's default and macOS's (49152-65535) together


def free_port() -> int:
    """A port that is free now, outside the kernel's ephemeral range and Ray's worker ports.

    A port picked by binding port 0 comes from the ephemeral range, so a Ray worker or a
    gRPC channel opened before the server binds it can take it (CI saw exactly that).
    Picking outside those ranges, and never twice in one process, leaves only a process
    that binds that very port by number in between. Where no such port exists (an
    ephemeral range over nearly all ports), the kernel picks one.
    """
    lo, hi = _ephemeral_range()
    ray_workers = range(10002, 20000)  # Ray's default min/max worker ports
    choices = [p for p in range(10000, 65000) if not lo <= p <= hi and p not in ray_workers and p not in _HANDED_OUT]
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for port in rng.sample(choices, min(len(choices), 500)):
        try:
            with socket.socket() as s:
                s.bind(("0.0.0.0", port))
        except OSError:
            continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_address() -> str:
    import ray

    return ray.get_runtime_context().gcs_address


class ServerProcess:
    """``python -m cluster.serve`` in its own process group, logging to a file."""

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        ray_addr: str | None = None,
        api_key: str | None = None,
    ):
        self.api_key = api_key
        self.http_port = free_port()
        self.grpc_port = free_port()
        self.log_path = log_path
        self.cmd = [
            sys.executable,
            "-m",
            "cluster.serve",
            "--http-port",
            str(self.http_port),
            "--grpc-port",
            str(self.grpc_port),
            *args,
        ]
        full_env = dict(os.environ)
        full_env.pop("RAY_ADDRESS", None)
        full_env.pop("SYNCLESS_API_KEY", None)
        full_env.update(
            {
                "PYTHONPATH": str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", ""),
                "RAY_DEDUP_LOGS": "0",
                "TOKENIZERS_PARALLELISM": "false",
                "SYNCLESS_RAY_NUM_CPUS": "4",
                "PYTHONUNBUFFERED": "1",
            }
        )
        if ray_addr:
            full_env["RAY_ADDRESS"] = ray_addr
        full_env.update(env or {})
        self._log = open(log_path, "wb")
        self.proc = spawn_session(self.cmd, cwd=ROOT, env=full_env, stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def wait_ready(self, timeout: float = 240.0) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.kill()
        raise RuntimeError(f"server not ready after {timeout:.0f} s:\n{self.log()[-4000:]}")

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self._log.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(30)
        self._log.close()

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout``; the exit code of the first."""
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        finally:
            self.kill()

    def debug_state(self) -> dict:
        api_key = self.api_key
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        r = httpx.get(self.url + "/v1/debug/kv", headers=headers, timeout=30)
        r.raise_for_status()
        return r.json()

    def wait_kv_free(self, timeout: float = 30.0) -> dict:
        """Poll until no request holds KV blocks (aborts are asynchronous)."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.debug_state()
            if (
                st["num_free_blocks"] == st["num_blocks"]
                and st["running"] == 0
                and st["waiting"] == 0
                and st["groups"] == 0
                and st["in_flight"] == 0
            ):
                return st
            if time.monotonic() > deadline:
                raise AssertionError(f"KV blocks still held: {st}")
            time.sleep(0.1)


# ------------------------------------------------------------------ fixtures
@pytest.fixture(scope="session")
def serve_model(ckpt_dir):
    return ckpt_dir("llama")


@pytest.fixture(scope="session")
def _server_proc(ray_local, serve_model, tmp_path_factory):
    """The main server's process, started (not yet ready): the tiny llama checkpoint, joined to
    the tests' Ray instance, with async scheduling (the offline engine it is compared with
    schedules synchronously). The offline engine loads while it starts."""
    args = ["--model", str(serve_model), "--api-key", API_KEY, "--async-scheduling", "--log-stats-interval", "1"]
    for k, v in ENGINE_OPTS.items():
        args += ["--" + k.replace("_", "-"), str(v)]
    proc = ServerProcess(args, tmp_path_factory.mktemp("serve") / "server.log", ray_addr=ray_address(), api_key=API_KEY)
    try:
        yield proc
    finally:
        rc = proc.stop()
        assert rc == 0, f"server exit code {rc}:\n{proc.log()[-3000:]}"


@pytest.fixture(scope="session")
def server(_server_proc):
    return _server_proc.wait_ready()


@pytest.fixture(scope="session")
def offline(ray_local, serve_model, _server_proc):
    """The offline API on the same checkpoint and options, in the test process."""
    from cluster import LLM

    llm = LLM(model=str(serve_model), **ENGINE_OPTS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="session")
def model_name(serve_model) -> str:
    return str(serve_model)


@pytest.fixture()
def openai_client(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    yield client
    client.close()
