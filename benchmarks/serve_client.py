"""Streaming clients for ``benchmarks.serve``: OpenAI-compatible HTTP and syncless gRPC.

Each ``send`` returns a ``RequestFuncOutput`` with the timings ``vllm bench serve``
records: time to the first chunk (TTFT), the gaps between later chunks (ITL) and
the whole request (E2E latency), plus the token counts the server reported.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks.datasets import SampleRequest


@dataclass
class RequestFuncOutput:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds between chunks after the first
    latency: float = 0.0  # seconds, send to last byte
    start_time: float = 0.0  # perf_counter at send
    generated_text: str = ""
    error: str = ""


class HttpClient:
    """``POST /v1/completions`` with ``stream=true`` (server-sent events)."""

    def __init__(self, base_url: str, model: str | None, timeout_s: float, prompt_format: str, tokenizer=None):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.timeout_s = timeout_s
        self.prompt_format = prompt_format
        self.tokenizer = tokenizer
        self.session = None

    async def __aenter__(self) -> "HttpClient":
        import aiohttp

        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            connector=aiohttp.TCPConnector(limit=0, force_close=False),
        )
        return self

    async def __aexit__(self, *exc) -> None:
        await self.session.close()

    async def wait_ready(self, deadline_s: float) -> dict[str, Any]:
        """Poll ``/v1/models`` until the server answers; returns the model list."""
        import asyncio

        import aiohttp

        end = time.monotonic() + deadline_s
        last = ""
        while time.monotonic() < end:
            try:
                async with self.session.get(f"{self.base_url}/v1/models") as r:
                    if r.status == 200:
                        data = await r.json()
                        if self.model is None and data.get("data"):
                            self.model = data["data"][0]["id"]
                        return data
                    last = f"HTTP {r.status}"
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(0.5)
        raise SystemExit(f"server at {self.base_url} not ready after {deadline_s:.0f} s ({last})")

    def _prompt(self, req: SampleRequest):
        if req.token_ids is None:
            return req.prompt
        if self.prompt_format == "text":
            if self.tokenizer is None:
                raise SystemExit("--prompt-format text needs a tokenizer (--shape, --model or --tokenizer)")
            return self.tokenizer.decode(req.token_ids)
        return req.token_ids

    async def send(self, req: SampleRequest, temperature: float, seed: int) -> RequestFuncOutput:
        body = {
            "model": self.model,
            "prompt": self._prompt(req),
            "max_tokens": req.expected_output_len,
            "temperature": temperature,
            "ignore_eos": True,
            "stream": True,
            "seed": seed,
            "stream_options": {"include_usage": True},
        }
        out = RequestFuncOutput(prompt_len=req.prompt_len)
        st = time.perf_counter()
        out.start_time = st
        recent = st
        n_chunks = 0
        try:
            async with self.session.post(f"{self.base_url}/v1/completions", json=body) as resp:
                if resp.status != 200:
                    out.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                    return out
                buf = b""
                async for piece in resp.content.iter_any():
                    buf += piece
                    while b"\n" in buf:
                        line, buf = buf.split(b"\n", 1)
                        line = line.strip()
                        if not line.startswith(b"data:"):
                            continue
                        payload = line[5:].strip()
                        if payload == b"[DONE]":
                            continue
                        data = json.loads(payload)
                        if "error" in data:
                            out.error = str(data["error"])[:500]
                            return out
                        now = time.perf_counter()
                        choices = data.get("choices") or []
                        if choices:
                            if n_chunks == 0:
                                out.ttft = now - st
                            else:
                                out.itl.append(now - recent)
                            recent = now
                            n_chunks += 1
                            out.generated_text += choices[0].get("text") or ""
                        usage = data.get("usage")
                        if usage:
                            out.output_tokens = int(usage.get("completion_tokens") or 0)
                            out.prompt_len = int(usage.get("prompt_tokens") or out.prompt_len)
            out.latency = time.perf_counter() - st
            if not out.output_tokens:
                out.output_tokens = n_chunks
            out.success = n_chunks > 0
            if not out.success:
                out.error = "the stream carried no tokens"
        except Exception as exc:  # connection reset, timeout, bad JSON: a failed request
            out.error = f"{type(exc).__name__}: {exc}"
        return out


class GrpcClient:
    """``syncless.v1.Generation/Generate`` (server streaming), stubs from ``cluster.proto``."""

    def __init__(self, target: str, model: str | None, timeout_s: float):
        self.target = target
        self.model = model or ""
        self.timeout_s = timeout_s
        self.channel = self.stub = None

    async def __aenter__(self) -> "GrpcClient":
        import grpc

        from cluster.proto import pb2, pb2_grpc

        self.pb2 = pb2
        self.channel = grpc.aio.insecure_channel(self.target, options=[("grpc.max_receive_message_length", 64 << 20)])
        self.stub = pb2_grpc.GenerationStub(self.channel)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.channel.close()

    async def wait_ready(self, deadline_s: float) -> dict[str, Any]:
        import asyncio

        import grpc
        from google.protobuf.json_format import MessageToDict

        end = time.monotonic() + deadline_s
        last = ""
        while time.monotonic() < end:
            try:
                info = await self.stub.GetModelInfo(self.pb2.GetModelInfoRequest(), timeout=5)
                return MessageToDict(info, preserving_proto_field_name=True)
            except grpc.aio.AioRpcError as exc:
                last = f"{exc.code().name}: {exc.details()}"
            await asyncio.sleep(0.5)
        raise SystemExit(f"gRPC server at {self.target} not ready after {deadline_s:.0f} s ({last})")

    async def send(self, req: SampleRequest, temperature: float, seed: int) -> RequestFuncOutput:
        pb2 = self.pb2
        sp = pb2.SamplingParams(max_tokens=req.expected_output_len, temperature=temperature, ignore_eos=True, seed=seed)
        if req.token_ids is not None:
            msg = pb2.GenerateRequest(token_ids=pb2.TokenIds(ids=req.token_ids), sampling=sp, model=self.model)
        else:
            msg = pb2.GenerateRequest(text=req.prompt, sampling=sp, model=self.model)
        out = RequestFuncOutput(prompt_len=req.prompt_len)
        st = time.perf_counter()
        out.start_time = st
        recent = st
        n_tok = n_chunks = 0
        try:
            async for resp in self.stub.Generate(msg, timeout=self.timeout_s):
                now = time.perf_counter()
                if resp.token_ids:
                    if n_chunks == 0:
                        out.ttft = now - st
                    else:
                        out.itl.append(now - recent)
                    recent = now
                    n_chunks += 1
                    n_tok += len(resp.token_ids)
                    out.generated_text += resp.text
                if resp.HasField("usage"):
                    out.output_tokens = int(resp.usage.completion_tokens)
                    out.prompt_len = int(resp.usage.prompt_tokens) or out.prompt_len
                if resp.finish_reason in ("abort", "error"):
                    out.error = f"finish_reason {resp.finish_reason}"
            out.latency = time.perf_counter() - st
            out.output_tokens = out.output_tokens or n_tok
            out.success = n_chunks > 0 and not out.error
        except Exception as exc:
            out.error = f"{type(exc).__name__}: {exc}"
        return out


@contextlib.contextmanager
def launch_server(
    model_dir: str, load_format: str, engine_options: dict[str, Any], log_path: str | None, ready_timeout_s: float
):
    """``python -m cluster.serve`` with ``engine_options`` as its flags, on free loopback ports;
    yields (http port, grpc port) once it serves, then stops it (SIGINT, then SIGKILL). It joins
    the Ray cluster of ``$RAY_ADDRESS`` (a Ray job's), else starts a local Ray instance."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import tempfile

    from benchmarks.child_process import spawn_session

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    http, grpc_port = free_port(), free_port()
    cmd = [
        sys.executable,
        "-m",
        "cluster.serve",
        "--model",
        model_dir,
        "--load-format",
        load_format,
        "--http-port",
        str(http),
        "--grpc-port",
        str(grpc_port),
    ]
    for k, v in engine_options.items():
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            cmd.append(flag if v else "--no-" + k.replace("_", "-"))
        else:
            cmd += [flag, v if isinstance(v, str) else json.dumps(v)]
    log = open(log_path or tempfile.mkstemp(prefix="serve-", suffix=".log")[1], "w+")  # noqa: SIM115
    print(f"launching: {' '.join(cmd)} (log: {log.name})", flush=True)
    proc = spawn_session(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            log.seek(0)
            if "SERVING http=" in log.read():
                break
            if proc.poll() is not None:
                log.seek(0)
                raise SystemExit(f"the server exited with {proc.returncode}:\n{log.read()[-3000:]}")
            if time.monotonic() > deadline:
                raise SystemExit(f"the server did not serve within {ready_timeout_s:.0f} s (log: {log.name})")
            time.sleep(0.5)
        yield http, grpc_port
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        log.close()
