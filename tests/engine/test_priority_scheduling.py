"""``scheduling_policy='priority'`` against the simulated worker (``tests/sim_worker.py``):
requests are admitted by priority (lower first), then arrival; the running request of the
lowest priority is preempted first; random workloads with random priorities still equal each
request's reference computed alone; an FCFS engine refuses a priority."""

from __future__ import annotations

import random

import msgspec
import pytest

from cluster import SamplingParams
from cluster.input_processor import InvalidRequestError
from tests import sim_worker
from tests.sim_worker import CONFIGS, check, random_workload, run

fake_model_dir = sim_worker.fake_model_dir  # the simulated worker's fixtures
make_engine = sim_worker.make_engine


def _finish_order(engine) -> list[str]:
    order = []
    while engine.has_unfinished():
        order += [d.request_id for d in engine.step() if d.finish_reason]
    return order


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_admission_follows_priority_then_arrival(make_engine, async_scheduling):
    engine = make_engine(
        scheduling_policy="priority", async_scheduling=async_scheduling, **dict(CONFIGS[3], max_num_seqs=1)
    )
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for rid, prio in [("a", 3), ("b", 1), ("c", 2), ("d", 1), ("e", -4)]:
        engine.add_request(rid, [5, 6, 7], msgspec.structs.replace(sp, priority=prio))
    assert _finish_order(engine) == ["e", "b", "d", "c", "a"]
    fcfs = make_engine(async_scheduling=async_scheduling, **dict(CONFIGS[3], max_num_seqs=1))
    for rid in "abc":
        fcfs.add_request(rid, [5, 6, 7], sp)
    assert _finish_order(fcfs) == ["a", "b", "c"]


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_the_lowest_priority_is_preempted_first(make_engine, policy):
    """Two requests grow until the cache (6 blocks of 4 tokens) holds one: under 'priority' the
    earlier, less urgent one gives way; under FCFS the later one does."""
    engine = make_engine(scheduling_policy=policy, **dict(CONFIGS[3], num_kv_blocks=6, max_model_len=32))
    long = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    engine.add_request("low", [5] * 4, msgspec.structs.replace(long, priority=5 if policy == "priority" else 0))
    engine.step()
    engine.add_request("high", [6] * 4, long)
    _finish_order(engine)
    low, high = engine.output("low"), engine.output("high")
    assert low.metrics.num_preemptions + high.metrics.num_preemptions > 0
    victim = "low" if policy == "priority" else "high"
    assert engine.output(victim).metrics.num_preemptions > 0
    assert engine.output({"low": "high", "high": "low"}[victim]).metrics.num_preemptions == 0
    assert low.outputs[0].finish_reason == high.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("ci", [0, 2])
def test_random_workloads_with_priorities_match_reference(make_engine, ci, async_scheduling):
    cfg = dict(CONFIGS[ci])
    engine = make_engine(scheduling_policy="priority", async_scheduling=async_scheduling, **cfg)
    max_prompt = min(30, cfg["max_model_len"] - 1, cfg["num_kv_blocks"] * cfg["block_size"] - 1)
    for trial in range(3):
        rng = random.Random(77 * ci + trial)
        reqs = [
            (f"t{trial}-{rid}", p, msgspec.structs.replace(sp, priority=rng.randrange(-2, 3)))
            for rid, p, sp in random_workload(rng, 14, max_prompt)
        ]
        outs, streamed, toks, aborted = run(engine, reqs, rng, abort_p=0.04 if trial % 2 else 0.0)
        check(engine, reqs, outs, streamed, toks, aborted)
        for rid, _, _ in reqs:
            engine.release(rid)
    assert engine.scheduler.num_preemptions > 0, "this configuration should preempt"


def test_fcfs_refuses_a_priority(make_engine):
    engine = make_engine(**CONFIGS[3])
    with pytest.raises(InvalidRequestError, match="priority 2: .*--scheduling-policy priority"):
        engine.add_request("x", [5, 6], SamplingParams(priority=2))
    with pytest.raises(ValueError, match="priority"):
        SamplingParams(priority=1.5).validate()
