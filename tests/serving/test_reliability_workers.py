"""Worker death is detected and healed without traffic (issue 35), and a client that leaves while
its request is validated leaves nothing behind.

One server of this module's own (the tiny checkpoint, joined to the tests' Ray instance): its
worker is SIGKILLed while idle and while busy. In-flight requests get an error within 2 s, and
with no request sent the server restarts its worker and reports healthy (HTTP 200, gRPC
SERVING) within 15 s, then serves the same tokens as before.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc


REF = {"prompt": [5, 9, 17, 33], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
LONG = {"prompt": [7, 8, 9], "max_tokens": 240, "temperature": 0, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def victim(ray_local, serve_model, tmp_path_factory):
    from tests.serve_helpers import ServerProcess, ray_address

    args = [
        "--model",
        str(serve_model),
        "--max-model-len",
        "256",
        "--num-kv-blocks",
        "64",
        "--block-size",
        "16",
        "--disable-log-requests",
        "--disable-log-stats",
        "--log-stats-interval",
        "0.5",
    ]
    proc = ServerProcess(args, tmp_path_factory.mktemp("victim") / "server.log", ray_addr=ray_address())
    try:
        yield proc.wait_ready()
    finally:
        proc.kill()


def _reference(server) -> str:
    r = httpx.post(server.url + "/v1/completions", json=REF, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _kill_worker(server) -> int:
    (pid,) = server.debug_state()["worker_pids"]
    os.kill(pid, signal.SIGKILL)
    return pid


def _grpc_status(server):
    with grpc.insecure_channel(server.grpc_target) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def _watch_health(server, timeout: float) -> tuple[bool, float]:
    """Poll /health (never a generation request) until it is 200 after having been 503.
    Returns (saw 503, seconds until 200 again)."""
    t0 = time.monotonic()
    saw_down = False
    while time.monotonic() - t0 < timeout:
        code = httpx.get(server.url + "/health", timeout=5).status_code
        if code == 503:
            saw_down = True
        elif code == 200 and saw_down:
            return True, time.monotonic() - t0
        time.sleep(0.05)
    return saw_down, float("inf")


def test_worker_killed_while_idle_is_restarted_without_traffic(victim):
    expected = _reference(victim)
    pid = _kill_worker(victim)
    saw_down, back_after = _watch_health(victim, 15)
    assert saw_down, "the death of an idle worker went unnoticed"
    assert back_after < 15, f"not serving again within 15 s:\n{victim.log()[-3000:]}"
    assert _grpc_status(victim) == health_pb2.HealthCheckResponse.SERVING
    new = victim.debug_state()["worker_pids"]
    assert pid not in new and len(new) == 1
    assert _reference(victim) == expected
    log = victim.log()
    assert "engine failed while idle" in log and "workers restarted" in log
    assert "finished request" not in log and "Avg generation throughput" not in log  # both turned off


def test_worker_killed_while_busy_fails_requests_fast_then_heals(victim):
    expected = _reference(victim)
    errors: dict[int, float] = {}
    started = threading.Barrier(4)

    def stream(i: int) -> None:
        with httpx.stream("POST", victim.url + "/v1/completions", json=LONG, timeout=60) as r:
            got_first = False
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    errors[i] = time.monotonic()
                    return
                if not got_first:
                    got_first = True
                    started.wait(30)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    started.wait(30)  # all three are streaming tokens
    killed_at = time.monotonic()
    _kill_worker(victim)
    for t in threads:
        t.join(30)
    assert sorted(errors) == [0, 1, 2], "every in-flight request gets an error event"
    assert max(errors.values()) - killed_at < 2.0, f"errors after {max(errors.values()) - killed_at:.2f} s"
    saw_down, back_after = _watch_health(victim, 15)
    assert back_after < 15, f"not serving again within 15 s:\n{victim.log()[-3000:]}"
    assert _reference(victim) == expected
    victim.wait_kv_free()


def test_disconnect_during_validation_leaves_nothing_behind(victim):
    """Clients that leave while the engine thread validates a request it then refuses (a token
    outside the vocabulary): no in-flight entry is left, and their request ids are free again."""
    ids = [f"leaver-{i}" for i in range(40)]
    bad = {"prompt": [5, 9999], "max_tokens": 2}

    async def leave(client: httpx.AsyncClient, rid: str, delay: float) -> None:
        task = asyncio.ensure_future(client.post(victim.url + "/v1/completions", json={**bad, "request_id": rid}))
        await asyncio.sleep(delay)
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, httpx.HTTPError):
            pass

    async def main() -> None:
        load = [
            asyncio.ensure_future(
                httpx.AsyncClient(timeout=60).post(
                    victim.url + "/v1/completions", json={**LONG, "stream": False, "max_tokens": 120}
                )
            )
            for _ in range(2)
        ]  # keep the engine thread stepping, so validation waits its turn
        async with httpx.AsyncClient(timeout=60) as client:
            await asyncio.gather(*(leave(client, rid, 0.001 * (i % 20)) for i, rid in enumerate(ids)))
        await asyncio.gather(*load)

    asyncio.run(main())
    deadline = time.monotonic() + 10
    while victim.debug_state()["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert victim.debug_state()["in_flight"] == 0, "a refused request stayed in flight"
    for rid in ids[:10]:
        r = httpx.post(victim.url + "/v1/completions", json={**REF, "request_id": rid}, timeout=60)
        assert r.status_code == 200, r.text  # the id is not "already in use"
    victim.wait_kv_free()


def test_cancelled_while_validating_is_forgotten(ray_local, serve_model):
    """In process, with validation made slow so the cancellation surely lands inside it: a refused
    request leaves no stream behind, an accepted one is aborted, and both ids are free again."""
    from cluster.async_engine import AsyncEngine
    from metadata.config import EngineConfig
    from metadata.sampling_params import SamplingParams

    cfg = EngineConfig.from_options(model=str(serve_model), max_model_len=128, num_kv_blocks=16, block_size=16)

    async def main() -> None:
        eng = AsyncEngine(cfg)
        await eng.start()
        try:
            inputs = eng.core.inputs
            real = inputs.make_requests

            def slow(*a, **k):
                time.sleep(0.3)  # the engine thread is busy validating (e.g. a long prompt)
                return real(*a, **k)

            inputs.make_requests = slow
            for rid, prompt in (("refused", [5, 9999]), ("accepted", [5, 9])):
                task = asyncio.ensure_future(
                    eng.add_request(rid, {"prompt_token_ids": prompt}, SamplingParams(max_tokens=50, ignore_eos=True))
                )
                await asyncio.sleep(0.1)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            deadline = time.monotonic() + 5
            while eng.num_in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert eng.num_in_flight == 0
            state = await eng.debug_state()
            assert state["groups"] == 0 and state["num_free_blocks"] == state["num_blocks"]
            inputs.make_requests = real
            for rid in ("refused", "accepted"):
                out = await (
                    await eng.add_request(rid, {"prompt_token_ids": [5, 9]}, SamplingParams(max_tokens=3))
                ).result()
                assert len(out.outputs[0].token_ids) == 3
        finally:
            await eng.shutdown(1)

    asyncio.run(main())


def test_failed_restarts_back_off_then_heal(ray_local, serve_model):
    """In process: the idle engine notices its killed worker by itself, restarts that fail are
    retried after 1 s, then 2 s, and the next that succeeds makes the engine healthy again."""
    import cluster.async_engine as ae
    from cluster.executor import EngineDeadError
    from metadata.config import EngineConfig
    from metadata.sampling_params import SamplingParams

    cfg = EngineConfig.from_options(model=str(serve_model), max_model_len=128, num_kv_blocks=16, block_size=16)

    async def main() -> None:
        eng = ae.AsyncEngine(cfg)
        await eng.start()
        try:
            ex = eng.core.executor
            real, tries = ex.restart, []

            def flaky_restart():
                tries.append(time.monotonic())
                if len(tries) <= 2:
                    ex.shutdown()
                    raise EngineDeadError("no resources for the workers (injected)")
                real()

            ex.restart = flaky_restart
            (pid,) = [p["pid"] for p in ray_local.get([w.ping.remote() for w in ex.workers], timeout=30)]
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while (len(tries) < 3 or not eng.healthy) and time.monotonic() < deadline:
                assert len(tries) >= 3 or not eng.healthy or not tries, "healthy while restarts fail"
                await asyncio.sleep(0.05)
            assert len(tries) == 3 and eng.healthy
            gaps = [b - a for a, b in zip(tries, tries[1:])]
            assert 0.9 <= gaps[0] < 1.8 and 1.9 <= gaps[1] < 3.0, gaps
            out = await (
                await eng.add_request("after", {"prompt_token_ids": [5, 9]}, SamplingParams(max_tokens=3))
            ).result()
            assert len(out.outputs[0].token_ids) == 3
        finally:
            await eng.shutdown(1)

    asyncio.run(main())
