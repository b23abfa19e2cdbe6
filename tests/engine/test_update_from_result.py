"""``Scheduler.update_from_result``: the one owner of a step's post-step state.

A real ``Scheduler`` (and its real block manager) schedules plans; the tests hand it
the ``StepResult`` a worker would send and check what it did: tokens appended,
placeholders and rejected drafts taken back, EOS / stop-token / length finishes,
blocks freed or committed, in-flight tokens of finished requests dropped, the plan
chain. No engine, no Ray.
"""

from __future__ import annotations

import pytest

from cluster.input_processor import InputProcessor
from cluster.scheduler import Scheduler
from metadata.config import EngineConfig
from metadata.sampling_params import SamplingParams
from metadata.wire import SampledRow, StepResult, StepStats, TokenLogprobs

EOS = 1
MAX_LEN = 64


def _scheduler(**options) -> Scheduler:
    opts = {
        "block_size": 4,
        "num_kv_blocks": 32,
        "max_num_batched_tokens": 64,
        "max_num_seqs": 8,
        "max_model_len": MAX_LEN,
        "enable_prefix_caching": False,
    }
    opts.update(options)
    cfg = EngineConfig.from_options(**opts)
    return Scheduler(cfg, cfg.cache.num_kv_blocks, MAX_LEN)


def _add(sched: Scheduler, rid: str, prompt: list[int], **params):
    inputs = InputProcessor(None, (EOS,), 100, MAX_LEN, 64, True, 0)
    (req,) = inputs.make_requests(rid, {"prompt_token_ids": prompt}, SamplingParams(temperature=0, **params), 1 << 20)
    sched.add(req)
    return req


def _result(step, tokens: dict[int, list[int]], **kw) -> StepResult:
    return StepResult(
        step_id=step.plan.step_id, outputs=[SampledRow(handle=h, token_ids=t, **kw) for h, t in tokens.items()]
    )


def test_tokens_are_appended_and_placeholders_taken_back():
    sched = _scheduler()
    req = _add(sched, "a", [5, 6, 7], max_tokens=4)
    step = sched.schedule()
    assert req.num_placeholders == 1 and step.sampled == {req.handle: req}
    update = sched.update_from_result(step, _result(step, {req.handle: [9]}))
    assert req.output_token_ids == [9] and req.num_placeholders == 0
    (seq,) = update.sequences
    assert (seq.req, seq.start, seq.token_ids, seq.finish_reason) == (req, 0, [9], None)
    assert update.num_new_tokens == 1 and req.first_token_time is not None
    step = sched.schedule()  # the decode step: one new token, at the end of the known ones
    assert [r.num_scheduled_tokens for r in step.plan.rows] == [1]
    update = sched.update_from_result(step, _result(step, {req.handle: [11]}))
    assert req.output_token_ids == [9, 11] and update.sequences[0].start == 1


def test_eos_finishes_and_frees_and_the_next_plan_releases_the_row():
    sched = _scheduler()
    free = sched.blocks.num_free
    req = _add(sched, "a", [5, 6, 7, 8, 9], max_tokens=10)
    step = sched.schedule()
    handle = req.handle
    assert sched.blocks.num_free < free
    update = sched.update_from_result(step, _result(step, {handle: [EOS]}))
    assert req.finished and (req.finish_reason, req.stop_reason) == ("stop", None)
    assert update.sequences[0].finish_reason == "stop"
    assert sched.blocks.num_free == free and not sched.running and handle not in sched.by_handle
    nxt = sched.schedule()
    assert nxt.plan.finished_handles == [handle] and not nxt.plan.rows


@pytest.mark.parametrize(
    "params, tokens, reason, stop_reason",
    [
        ({"max_tokens": 2}, [9, 10], "length", None),
        ({"max_tokens": 5, "stop_token_ids": [10]}, [9, 10], "stop", 10),
        ({"max_tokens": 5, "min_tokens": 2}, [EOS, EOS], "stop", None),  # EOS ignored below min_tokens
        ({"max_tokens": 5, "ignore_eos": True}, [EOS, 12, 13, 14, 15], "length", None),
    ],
)
def test_token_level_finishes(params, tokens, reason, stop_reason):
    sched = _scheduler()
    req = _add(sched, "a", [5, 6, 7], **params)
    for i, tok in enumerate(tokens):
        step = sched.schedule()
        update = sched.update_from_result(step, _result(step, {req.handle: [tok]}))
        assert req.finished == (i == len(tokens) - 1)
    assert req.output_token_ids == tokens
    assert (req.finish_reason, req.stop_reason) == (reason, stop_reason)
    assert (update.sequences[0].finish_reason, update.sequences[0].stop_reason) == (reason, stop_reason)
    sched.blocks.check_all_free()


def test_in_flight_tokens_of_a_finished_request_are_dropped():
    """Async scheduling: step 2 samples for the request before step 1's result arrives."""
    sched = _scheduler()
    req = _add(sched, "a", [5, 6, 7], max_tokens=8)
    s1, s2 = sched.schedule(), sched.schedule()
    assert req.num_placeholders == 2 and s2.plan.prev_step_id == s1.plan.step_id
    sched.update_from_result(s1, _result(s1, {req.handle: [EOS]}))
    assert req.finished
    update = sched.update_from_result(s2, _result(s2, {s2.plan.rows[0].handle: [21]}))
    assert not update.sequences and req.output_token_ids == [EOS]
    sched.blocks.check_all_free()


def test_rejected_drafts_are_rolled_back():
    sched = _scheduler(speculative_method="ngram", num_speculative_tokens=3)
    req = _add(sched, "a", [5, 6, 7, 8], max_tokens=20)
    step = sched.schedule()  # prefill
    sched.update_from_result(step, _result(step, {req.handle: [9]}))
    step = sched.schedule()  # decode with 3 drafts, counted as if all were accepted
    (row,) = step.plan.rows
    assert row.num_draft_tokens == 3 and req.num_placeholders == 4
    assert req.num_computed_tokens == 4 + 1 + 3
    update = sched.update_from_result(step, _result(step, {req.handle: [30, 31]}))  # 1 accepted + bonus
    assert req.output_token_ids == [9, 30, 31] and req.num_placeholders == 0
    assert req.num_computed_tokens == 4 + 1 + 1  # the KV of the 2 rejected drafts is not held
    assert (update.num_draft_tokens, update.num_accepted_tokens, update.num_new_tokens) == (3, 1, 2)


def test_a_stop_inside_accepted_drafts_drops_the_rest():
    sched = _scheduler(speculative_method="ngram", num_speculative_tokens=3)
    req = _add(sched, "a", [5, 6, 7, 8], max_tokens=20)
    step = sched.schedule()
    sched.update_from_result(step, _result(step, {req.handle: [9]}))
    step = sched.schedule()
    update = sched.update_from_result(step, _result(step, {req.handle: [30, EOS, 31, 32]}))
    assert req.output_token_ids == [9, 30, EOS] and req.finish_reason == "stop"
    assert update.sequences[0].token_ids == [30, EOS] and update.num_new_tokens == 2
    sched.blocks.check_all_free()


def test_finish_at_stop_string_truncates_and_overrides_a_later_finish():
    sched = _scheduler()
    req = _add(sched, "a", [5, 6, 7], max_tokens=3, logprobs=0)
    lp = [TokenLogprobs(-0.5, 1, [], [])]
    for tok in (9, 10, 11):
        step = sched.schedule()
        sched.update_from_result(step, _result(step, {req.handle: [tok]}, logprobs=lp))
    assert req.finish_reason == "length" and req.cumulative_logprob == pytest.approx(-1.5)
    assert sched.finish_at_stop_string(req, 2, "w10") == 1
    assert req.output_token_ids == [9, 10] and len(req.logprobs) == 2
    assert (req.finish_reason, req.stop_reason) == ("stop", "w10")
    assert req.cumulative_logprob == pytest.approx(-1.0)
    other = _add(sched, "b", [5, 6], max_tokens=8)
    step = sched.schedule()
    sched.update_from_result(step, _result(step, {other.handle: [12]}))
    handle = other.handle
    assert sched.finish_at_stop_string(other, 1, "x") == 0
    assert other.finished and sched.schedule().plan.finished_handles == [handle]
    sched.blocks.check_all_free()


def test_the_scheduler_owns_the_plan_chain():
    sched = _scheduler()
    a = _add(sched, "a", [5, 6, 7], max_tokens=1)
    s1 = sched.schedule()
    assert (s1.plan.step_id, s1.plan.prev_step_id) == (1, 0)
    sched.update_from_result(s1, _result(s1, {a.handle: [9]}))
    s2 = sched.schedule()  # releases the finished row: a plan with content
    assert (s2.plan.step_id, s2.plan.prev_step_id) == (2, 1) and s2.plan.finished_handles
    empty = sched.schedule()
    assert empty.empty and empty.plan.step_id == 3
    _add(sched, "b", [5, 6], max_tokens=1)
    s3 = sched.schedule()  # the empty plan used up no id
    assert (s3.plan.step_id, s3.plan.prev_step_id) == (3, 2)


def test_prefix_cache_commits_confirmed_blocks_only():
    sched = _scheduler(enable_prefix_caching=True)
    req = _add(sched, "a", list(range(10, 19)), max_tokens=4)  # 9 prompt tokens: 2 full blocks
    step = sched.schedule()
    assert req.num_committed_blocks == 0  # nothing is confirmed before the result
    sched.update_from_result(step, _result(step, {req.handle: [40]}))
    assert req.num_committed_blocks == 2
    step = sched.schedule()  # token 10 (the sampled 40) completes no block yet: KV of 9 + 1
    sched.update_from_result(step, _result(step, {req.handle: [41]}))
    assert req.num_confirmed_kv == 10 and req.num_committed_blocks == 2


def test_timing_rides_beside_the_result():
    assert "stats" in StepResult.__struct_fields__
    assert not {"worker_time_s", "host_launch_s", "device_step_s"} & set(StepResult.__struct_fields__)
    assert StepResult(step_id=1).stats == StepStats()
