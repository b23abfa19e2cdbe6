"""Overload (429 / RESOURCE_EXHAUSTED) and SIGINT shutdown: in-flight requests finish within
--shutdown-timeout, the rest are aborted, new ones are refused, the process exits 0."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import grpc
import httpx
import pytest

from cluster.proto import pb2, pb2_grpc


@pytest.fixture(scope="module")
def small(ray_local, ckpt_dir, tmp_path_factory):
    """Two running sequences at most, one waiting at most, a 4 s shutdown grace."""
    from tests.serve_helpers import ServerProcess, ray_address

    model = ckpt_dir("llama", max_pos=4096)
    args = [
        "--model",
        str(model),
        "--served-model-name",
        "small",
        "--max-num-seqs",
        "2",
        "--max-waiting-requests",
        "1",
        "--shutdown-timeout",
        "4",
        "--num-kv-blocks",
        "1024",
    ]
    proc = ServerProcess(args, tmp_path_factory.mktemp("small") / "server.log", ray_addr=ray_address())
    try:
        yield proc.wait_ready()
    finally:
        proc.kill()


LONG = {"model": "small", "prompt": "w5 w6", "max_tokens": 4000, "ignore_eos": True, "stream": True}


async def _first_chunk(lines) -> dict:
    async for line in lines:
        if line.startswith("data: {"):
            return json.loads(line[6:])
    raise AssertionError("stream ended early")


def test_overload_is_429_and_resource_exhausted(small):
    async def run():
        async with httpx.AsyncClient(timeout=60) as c:
            async with c.stream("POST", small.url + "/v1/completions", json=dict(LONG, n=2)) as a:
                lines = a.aiter_lines()  # keep a reference: a finalized iterator closes the response
                await _first_chunk(lines)  # two sequences running: the batch is full
                async with c.stream("POST", small.url + "/v1/completions", json=LONG) as b:
                    assert b.status_code == 200  # admitted: it waits
                    r = await c.post(small.url + "/v1/completions", json={"prompt": "w5", "max_tokens": 2})
                    assert r.status_code == 429, r.text
                    err = r.json()["error"]
                    assert err["type"] == "rate_limit_error" and "overloaded" in err["message"]
                    ch = grpc.aio.insecure_channel(small.grpc_target)
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        async for _ in pb2_grpc.GenerationStub(ch).Generate(pb2.GenerateRequest(text="w5")):
                            pass
                    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    await ch.close()
                    r = await c.get(small.url + "/health")
                    assert r.status_code == 200  # overload is not ill health
        # both streams were closed: aborted, and the server serves again
        small.wait_kv_free()
        async with httpx.AsyncClient(timeout=60) as c:
            r = await c.post(small.url + "/v1/completions", json={"prompt": "w5", "max_tokens": 2})
            assert r.status_code == 200

    asyncio.run(run())


def test_sigint_finishes_short_aborts_long_refuses_new(small):
    async def stream(c, body, ready: asyncio.Event | None = None):
        chunks = []
        async with c.stream("POST", small.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    if ready is not None:
                        ready.set()
                elif line == "data: [DONE]":
                    chunks.append("[DONE]")
        return chunks

    workers = small.debug_state()["worker_pids"]
    assert workers and all(_alive(p) for p in workers)

    async def run():
        async with httpx.AsyncClient(timeout=60) as c:
            started = asyncio.Event()
            long = asyncio.ensure_future(stream(c, LONG, started))
            await started.wait()
            short = asyncio.ensure_future(stream(c, dict(LONG, max_tokens=10, temperature=0)))
            await asyncio.sleep(0.05)
            small.signal(signal.SIGINT)
            await asyncio.sleep(0.3)
            r = await c.post(small.url + "/v1/completions", json={"prompt": "w5", "max_tokens": 2})
            assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
            assert (await c.get(small.url + "/health")).status_code == 503
            return await long, await short

    long, short = asyncio.run(run())
    assert long[-1] == "[DONE]" and short[-1] == "[DONE]"
    assert long[-2]["choices"][0]["finish_reason"] == "abort"
    assert short[-2]["choices"][0]["finish_reason"] == "length", (len(short), small.log()[-2000:])
    assert len(short) - 1 == 10  # one chunk per token, none lost
    rc = small.wait(60)
    assert rc == 0, small.log()[-3000:]
    assert "shut down cleanly" in small.log()
    deadline = time.monotonic() + 30  # the worker actors were released (killed), though Ray lives on
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in workers)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] not in ("Z", "X")
    except FileNotFoundError:
        return False
