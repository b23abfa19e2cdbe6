"""Data-parallel replicas on a simulated three-node Ray cluster (``ray.cluster_utils.Cluster``):
greedy output equal to one worker's, prefix-affinity routing, and a replica that loses a
worker (or its whole actor) while the other keeps serving, then comes back by itself."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest
import ray

from cluster import LLM, SamplingParams
from cluster.request_stream import EngineUnavailable
from cluster.input_processor import InvalidRequestError
from tests.checkpoints import hf_greedy

OPTS = {"block_size": 8, "max_model_len": 256, "num_kv_blocks": 64}
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def three_nodes():
    """Three Ray nodes of 2 CPUs each (one worker actor per CPU); the session's local Ray
    instance, if any, is restored afterwards."""
    from ray.cluster_utils import Cluster

    was_local = ray.is_initialized()
    if was_local:
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    for _ in range(2):
        cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()
    if was_local:
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)


BASE = [7, 8, 9, 10, 11, 12, 13, 14] * 3  # a shared 3-block prefix
PROMPTS = [
    [5, 9, 17],
    [33, 60, 7, 2, 90],
    BASE + [40],
    BASE + [41, 42],
    [100 + i for i in range(20)],
    [3] * 11,
    BASE[:10],
]


def _one_worker_tokens(model: str, prompts: list[dict]) -> list[list[int]]:
    """Greedy tokens of one plain worker: what every parallel layout must reproduce."""
    one = LLM(model=model, **OPTS)
    try:
        return [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        one.shutdown()


def test_offline_dp3_equals_one_worker(three_nodes, ckpt_dir):
    model = str(ckpt_dir("llama"))
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    expected = _one_worker_tokens(model, prompts)
    for size in (3,):  # DP=2: the online tests below (same replicas, same prompts)
        llm = LLM(model=model, data_parallel_size=size, **OPTS)
        try:
            outs = llm.generate(prompts, GREEDY, use_tqdm=False)
            assert [o.request_id for o in outs] == sorted(
                (o.request_id for o in outs), key=lambda r: int(r.rsplit("-", 1)[1])
            )
            assert [o.outputs[0].token_ids for o in outs] == expected, f"data_parallel_size={size}"
            loads = llm.data_parallel.stats()
            assert all(x.generation_tokens > 0 for x in loads), "every replica took part of the batch"
            assert sum(x.generation_tokens for x in loads) == len(prompts) * GREEDY.max_tokens
            # each replica is an actor process of its own (not the driver), with its own worker
            pids = {i["pid"] for i in llm.data_parallel.info}
            assert len(pids) == size and os.getpid() not in pids
            assert len({p for w in llm.data_parallel.worker_pids() for p in w} - pids) == size
            # a bad prompt fails the whole call with the single engine's error, and nothing runs
            with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
                llm.generate([prompts[0], {"prompt_token_ids": [5, 10**6]}], GREEDY, use_tqdm=False)
            again = llm.generate(prompts[:2], GREEDY, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in again] == expected[:2]
        finally:
            llm.shutdown()
    with pytest.raises(Exception, match="data_parallel_size must be in"):
        LLM(model=model, data_parallel_size=0)


class _Loop:
    """An event loop in a thread, so that one async engine serves several tests."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 180):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def test_offline_dp2_x_pp2_equals_one_worker(three_nodes, ckpt_dir):
    """Composition: two replicas, each a two-stage pipeline (four workers on three nodes)."""
    model = str(ckpt_dir("llama", layers=4))
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    expected = _one_worker_tokens(model, prompts)
    llm = LLM(model=model, data_parallel_size=2, pipeline_parallel_size=2, async_scheduling=True, **OPTS)
    try:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert all(len(w) == 2 for w in llm.data_parallel.worker_pids())  # a worker per stage
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def dp2(three_nodes, ckpt_dir):
    """The online front end (what ``cluster.serve`` runs) over two replicas."""
    from cluster.dp_engine import DataParallelEngine
    from cluster.metrics import ServerMetrics
    from metadata.config import EngineConfig

    cfg = EngineConfig.from_options(model=str(ckpt_dir("llama")), data_parallel_size=2, **OPTS)
    metrics = ServerMetrics("dp-test")
    engine = DataParallelEngine(cfg, metrics=metrics)
    loop = _Loop()
    loop.run(engine.start())
    metrics.bind(engine)
    yield engine, loop, metrics
    loop.run(engine.shutdown(2.0))
    loop.close()


async def _collect(stream):
    toks = []
    async for d in stream:
        toks.extend(d.token_ids)
    return toks


def test_online_dp2_equals_transformers(dp2, ckpt_dir):
    engine, loop, _ = dp2
    expected = hf_greedy(ckpt_dir("llama"), PROMPTS, GREEDY.max_tokens)  # = one worker's (test_engine_correctness)

    async def all_at_once():
        # added in one event-loop turn: one add call per replica carries its share of the batch
        streams = await asyncio.gather(
            *(engine.add_request(f"eq-{i}", {"prompt_token_ids": p}, GREEDY) for i, p in enumerate(PROMPTS))
        )
        return [s.replica for s in streams], await asyncio.gather(*(_collect(s) for s in streams))

    where, got = loop.run(all_at_once())
    assert got == expected
    assert set(where) == {0, 1}, "the batch was spread over both replicas"


def test_http_api_over_replicas(dp2):
    """The OpenAI server runs unchanged over the data-parallel front end."""
    from aiohttp.test_utils import TestClient, TestServer

    from cluster.http_api import OpenAIServer

    engine, loop, metrics = dp2

    async def calls():
        app = OpenAIServer(engine, "dp-test", None, metrics).app()
        async with TestClient(TestServer(app)) as c:
            health = (await c.get("/health")).status
            r = await c.post(
                "/v1/completions", json={"prompt": "w5 w6 w7 w8", "max_tokens": 4, "temperature": 0, "stream": True}
            )
            chunks = [line for line in (await r.text()).splitlines() if line.startswith("data: {")]
            kv = await (await c.get("/v1/debug/kv")).json()
            text = await (await c.get("/metrics")).text()
            return health, r.status, chunks, kv, text

    health, status, chunks, kv, text = loop.run(calls())
    assert health == 200 and status == 200 and len(chunks) == 4
    assert [x["replica"] for x in kv["replicas"]] == [0, 1] and kv["num_free_blocks"] == kv["num_blocks"]
    for i in (0, 1):
        assert f'syncless:replica_up{{model_name="dp-test",replica="{i}"}} 1.0' in text


def test_repeated_long_prefix_goes_to_the_replica_that_cached_it(dp2):
    engine, loop, _ = dp2
    prefix = [20 + (i % 50) for i in range(48)]  # six full blocks

    async def scenario():
        # a long request occupies replica 0, so the first prefix request lands on replica 1
        filler = await engine.add_request(
            "filler", {"prompt_token_ids": [4, 5, 6]}, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        )
        first = await engine.add_request("first", {"prompt_token_ids": prefix + [1, 2]}, GREEDY)
        await asyncio.gather(_collect(filler), _collect(first))
        hits_before = engine.replicas[first.replica].load.prefix_cache.get("hits", 0)
        # both replicas idle now: by load alone the next request would go to replica 0
        again = await engine.add_request("again", {"prompt_token_ids": prefix + [3]}, GREEDY)
        await _collect(again)
        other = await engine.add_request("other", {"prompt_token_ids": [9] * 40}, GREEDY)
        await _collect(other)
        return filler.replica, first.replica, again.replica, other.replica, hits_before

    f, first, again, other, hits_before = loop.run(scenario())
    assert (f, first) == (0, 1)
    assert again == first, "the repeated prefix went to the replica that cached it"
    assert other == 0, "a request without a cached prefix goes to the least loaded replica"
    hits = engine.replicas[first].load.prefix_cache["hits"]
    assert hits - hits_before >= 48, "the replica served the prefix from its cache"


def _wait(cond, timeout: float, what: str):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_worker_killed_mid_stream_other_replica_serves_then_restart(dp2, ckpt_dir):
    engine, loop, metrics = dp2
    long = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    p0, p1 = [11, 12, 13, 14, 15], [21, 22, 23]
    expected0 = hf_greedy(ckpt_dir("llama"), [p0], 120)[0]
    transitions = []
    engine.on_state_change(lambda: transitions.append([r.up for r in engine.replicas]))
    victim_pid = None

    async def scenario():
        nonlocal victim_pid
        s0 = await engine.add_request("keep", {"prompt_token_ids": p0}, long)
        s1 = await engine.add_request("doomed", {"prompt_token_ids": p1}, long)
        assert (s0.replica, s1.replica) == (0, 1)
        got0, got1 = [], []
        it0, it1 = s0.__aiter__(), s1.__aiter__()
        while len(got1) < 3:  # mid-stream on both replicas
            got1.extend((await it1.__anext__()).token_ids)
        victim_pid = engine.replicas[1].info["worker_pids"][0]
        os.kill(victim_pid, signal.SIGKILL)
        with pytest.raises(EngineUnavailable) as err:
            while True:
                got1.extend((await it1.__anext__()).token_ids)
        async for d in it0:
            got0.extend(d.token_ids)
        return got0, s0.output, str(err.value)

    got0, out0, err = loop.run(scenario())
    assert engine.healthy and engine.dead is None, "/health stays 200 while one replica serves"
    assert "replica 1" in err and "died" in err and str(victim_pid) in err, err
    assert got0 == expected0 and out0.outputs[0].finish_reason == "length", "replica 0 kept serving"
    # no request is sent: replica 1 restarts its workers by itself
    _wait(lambda: engine.replicas[1].up and engine.replicas[1].load.num_restarts == 1, 120, "replica 1 back")
    assert [True, False] in transitions, "the front end saw replica 1 down while it restarted"
    new_pids = ray.get(engine.replicas[1].actor.worker_pids.remote(), timeout=30)
    assert victim_pid not in new_pids and len(new_pids) == 1
    body = metrics.render().decode()
    assert 'syncless:replica_up{model_name="dp-test",replica="1"} 1.0' in body
    assert 'syncless:replica_restarts_total{model_name="dp-test",replica="1"} 1.0' in body

    async def both():
        a = await engine.add_request("after-a", {"prompt_token_ids": p0}, GREEDY)
        b = await engine.add_request("after-b", {"prompt_token_ids": p0}, GREEDY)
        ta, tb = await asyncio.gather(_collect(a), _collect(b))
        return {a.replica, b.replica}, ta, tb

    replicas, ta, tb = loop.run(both())
    assert replicas == {0, 1} and ta == tb == expected0[:8], "the restarted replica serves again"


def test_replica_actor_killed_other_serves_then_supervisor_restarts_it(dp2, ckpt_dir):
    engine, loop, metrics = dp2
    expected = hf_greedy(ckpt_dir("llama"), [[30, 31, 32]], 8)[0]
    pid = engine.replicas[0].info["pid"]
    os.kill(pid, signal.SIGKILL)

    async def during():
        # sent at once: replica 0 is dead (noticed or not yet), the request is served elsewhere
        s = await engine.add_request("while-down", {"prompt_token_ids": [30, 31, 32]}, GREEDY)
        return s.replica, await _collect(s)

    where, toks = loop.run(during())
    assert where == 1 and toks == expected
    _wait(lambda: not engine.replicas[0].up or engine.replicas[0].actor_restarts == 1, 30, "replica 0 down")
    assert engine.dead is None and engine.healthy, "one replica serving keeps the server healthy"
    # no request is sent: the supervisor starts a new replica actor, with its own new worker
    _wait(lambda: engine.replicas[0].up and engine.replicas[0].actor_restarts == 1, 120, "replica 0 back")
    assert engine.replicas[0].info["pid"] != pid
    body = metrics.render().decode()
    assert 'syncless:replica_up{model_name="dp-test",replica="0"} 1.0' in body
