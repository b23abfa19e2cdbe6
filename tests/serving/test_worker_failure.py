"""Killing a worker mid-generation fails the in-flight requests fast, names the rank, and the
engine serves new requests after restarting its workers."""

import os
import signal
import threading
import time

import pytest
import ray

from cluster import LLM, SamplingParams
from cluster.executor import EngineDeadError
from metadata.wire import StepPlan

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = {"prompt_token_ids": [5, 9, 17, 33, 60, 7]}


def test_killed_worker_fails_requests_then_engine_restarts(ray_local, ckpt_dir):
    # TP=2 with two steps queued (async scheduling): the survivor is blocked in a collective
    llm = LLM(
        model=str(ckpt_dir("llama")), tensor_parallel_size=2, block_size=8, max_model_len=256, async_scheduling=True
    )
    try:
        eng = llm.engine
        expected = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        for i in range(3):
            eng.add_request(
                f"long-{i}",
                {"prompt_token_ids": [4 + i] * 20},
                SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
            )
        got = 0
        while got < 6:  # mid-generation: tokens are flowing
            got += sum(len(d.token_ids) for d in eng.step())
        victim = eng.executor.workers[1]
        pid = ray.get(victim.ping.remote(), timeout=10)["pid"]
        os.kill(pid, signal.SIGKILL)  # rank 0 is left blocked in a collective with a dead peer
        t0 = time.monotonic()
        failed: dict[str, str] = {}
        while len(failed) < 3:
            assert time.monotonic() - t0 < 10, "in-flight requests did not fail within 10 s"
            for d in eng.step():
                if d.finish_reason == "error":
                    failed[d.request_id] = d.error
        assert time.monotonic() - t0 < 10
        assert set(failed) == {"long-0", "long-1", "long-2"}
        msg = failed["long-0"]
        assert "rank 1" in msg and "died" in msg and f"pid {pid}" in msg and "exited" in msg, msg
        assert eng.dead == msg
        with pytest.raises(EngineDeadError, match="rank 1"):
            eng.executor.submit(StepPlan(step_id=10**6))  # the executor knows its workers are gone
        for i in range(3):
            eng.release(f"long-{i}")

        # a new request restarts the workers (engine -> executor.restart()) and is served
        out = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == expected and out.outputs[0].finish_reason == "length"
        assert eng.dead is None and eng.executor.num_restarts == 1
        pids = {p["pid"] for p in ray.get([w.ping.remote() for w in eng.executor.workers], timeout=10)}
        assert pid not in pids and len(pids) == 2
    finally:
        llm.shutdown()


def _drop_step_connection(actor) -> None:
    """(On the worker.) Break the driver's step connection as a network fault would."""
    import socket

    actor.channel._conn.shutdown(socket.SHUT_RDWR)


def test_a_lost_step_connection_fails_requests_with_its_cause_then_restarts(ray_local, ckpt_dir):
    """Steps travel over a channel of their own, not Ray calls: when it breaks with the worker
    alive, the in-flight requests fail with that cause (not a hang), and a new request is
    served by restarted workers."""
    llm = LLM(model=str(ckpt_dir("llama")), block_size=8, max_model_len=256, async_scheduling=True)
    try:
        eng = llm.engine
        expected = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        eng.add_request("long", {"prompt_token_ids": [4] * 20}, SamplingParams(max_tokens=200, ignore_eos=True))
        got = 0
        while got < 4:
            got += sum(len(d.token_ids) for d in eng.step())
        ray.get(eng.executor.workers[0].__ray_call__.remote(_drop_step_connection), timeout=10)
        t0 = time.monotonic()
        errors = []
        while not errors:
            assert time.monotonic() - t0 < 20, "the request did not fail within 20 s"
            errors = [d.error for d in eng.step() if d.finish_reason == "error"]
        # the worker is alive, so the message says what broke, and does not call it dead
        msg = errors[0]
        assert "rank 0" in msg and "lost its step channel" in msg and "still answers" in msg, msg
        assert "died" not in msg, msg
        eng.release("long")
        out = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == expected and eng.executor.num_restarts == 1
    finally:
        llm.shutdown()


class _SilentChannel:
    """A step channel whose network went silent: plans leave, nothing ever comes back and no
    connection closes (a vanished host), so only Ray can tell that the worker is gone."""

    closed = None

    def send(self, data, step_id):
        import concurrent.futures

        return concurrent.futures.Future()

    def close(self):
        pass


def test_a_worker_lost_without_its_connection_closing_is_noticed_through_ray(ray_local, ckpt_dir):
    llm = LLM(model=str(ckpt_dir("llama")), block_size=8, max_model_len=256, async_scheduling=True)
    try:
        eng = llm.engine
        llm.generate([PROMPT], GREEDY, use_tqdm=False)
        real = eng.executor.channels[0]
        eng.executor.channels[0] = _SilentChannel()
        real.close()
        pid = ray.get(eng.executor.workers[0].ping.remote(), timeout=10)["pid"]
        eng.add_request("r", PROMPT, GREEDY)
        os.kill(pid, signal.SIGKILL)
        errors = []

        def pump():  # (a thread: a step that waits forever must fail the test, not hang it)
            while not errors:
                errors.extend(d.error for d in eng.step() if d.finish_reason == "error")

        t = threading.Thread(target=pump, daemon=True)
        t.start()
        t.join(timeout=30)
        assert errors, "a worker Ray knows is dead was waited on for 30 s"
        assert "rank 0" in errors[0] and "died" in errors[0] and f"pid {pid}" in errors[0], errors
    finally:
        llm.shutdown()
