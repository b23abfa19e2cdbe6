"""Output processing leaves the path from a result to the next plan (async scheduling).

The real ``EngineCore`` over the simulated worker of ``tests/sim_worker.py``; an
ordering log records when plans are submitted, results collected and outputs built.
Under async scheduling the next plan goes out between a result's collection and its
outputs; a request that hits a stop string may have that one extra step scheduled,
and still ends with exactly the reference output and no blocks held.
"""

from __future__ import annotations

import pytest

from cluster import SamplingParams
from tests import sim_worker
from tests.sim_worker import reference

fake_model_dir = sim_worker.fake_model_dir  # the simulated worker's fixtures
make_engine = sim_worker.make_engine


def _log_events(engine) -> list[tuple]:
    """Wrap submit / collect / output building; returns the (growing) event log."""
    log: list[tuple] = []
    ex, outputs = engine.executor, engine.outputs
    submit, collect, process = ex.submit, ex.collect, outputs.process

    def logged_submit(plan):
        log.append(
            (
                "submit",
                plan.step_id,
                [r.handle for r in plan.rows],
                list(plan.finished_handles),
                [n.handle for n in plan.new_requests],
            )
        )
        return submit(plan)

    def logged_collect(refs):
        res = collect(refs)
        log.append(("collect", res.step_id))
        return res

    def logged_process(update, scheduler):
        deltas = process(update, scheduler)
        log.append(("outputs", deltas))
        return deltas

    ex.submit, ex.collect, outputs.process = logged_submit, logged_collect, logged_process
    return log


def _windows(log):
    """(collected step id, submits between the collection and its outputs, the deltas)."""
    out = []
    for i, ev in enumerate(log):
        if ev[0] == "collect":
            j = next(k for k in range(i + 1, len(log)) if log[k][0] == "outputs")
            out.append((ev[1], [e for e in log[i + 1 : j] if e[0] == "submit"], log[j][1]))
    return out


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_next_plan_is_sent_before_outputs_are_built(make_engine, async_scheduling):
    engine = make_engine(
        async_scheduling=async_scheduling,
        block_size=4,
        num_kv_blocks=64,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        max_model_len=64,
    )
    log = _log_events(engine)
    for i in range(3):
        engine.add_request(
            f"r{i}", {"prompt_token_ids": [5 + i, 6, 7]}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        )
    while engine.has_unfinished():
        engine.step()
    windows = _windows(log)
    assert len(windows) >= 8
    if not async_scheduling:
        assert all(not subs for _, subs, _ in windows), "sync: the next plan needs this result's outputs"
        return
    # every result but the last few (nothing left to schedule) sends the plan three steps ahead
    # before its own outputs are built
    sent = [(n, [s[1] for s in subs]) for n, subs, _ in windows]
    assert all(ids == [n + 3] for n, ids in sent[:5]), sent
    assert all(e[0] != "submit" or e[1] <= 3 for e in log[: log.index(("collect", 1))])


def test_a_stop_string_under_async_scheduling_ends_the_request_exactly(make_engine):
    cfg = {"block_size": 4, "num_kv_blocks": 64, "max_num_batched_tokens": 32, "max_num_seqs": 8, "max_model_len": 64}
    engine = make_engine(async_scheduling=True, **cfg)
    probe = make_engine(async_scheduling=False, **cfg)  # to pick a stop string that occurs
    probe.add_request(
        "p", {"prompt_token_ids": [9, 10, 11]}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )
    while probe.has_unfinished():
        probe.step()
    words = probe.output("p").outputs[0].text.split()
    stop = words[3]  # the 4th token's text (or an earlier occurrence of it)
    log = _log_events(engine)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])
    engine.add_request("s", {"prompt_token_ids": [9, 10, 11]}, params)
    engine.add_request(
        "t", {"prompt_token_ids": [12, 13]}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )
    req = engine.groups["s"][0]
    handle = req.handle if req.handle > 0 else None
    streamed = ""
    while engine.has_unfinished():
        for d in engine.step():
            if d.request_id == "s":
                streamed += d.text
    out = engine.output("s").outputs[0]
    blocks = engine.scheduler.blocks
    exp_ids, exp_text, exp_reason, exp_stop = reference(
        engine.tokenizer, req, engine.max_model_len, blocks.num_blocks * blocks.block_size
    )
    assert exp_reason == "stop" and exp_stop == stop and len(exp_ids) < 12
    assert (out.token_ids, out.text, out.finish_reason, out.stop_reason) == (exp_ids, exp_text, "stop", stop)
    assert streamed == out.text
    blocks.check_all_free()
    assert not engine.scheduler.by_handle and not engine.in_flight
    # the result whose outputs found the stop string: the plan sent before them still ran it,
    # and a later plan released its row
    ((n, subs, _),) = [w for w in _windows(log) if any(d.request_id == "s" and d.stop_reason == stop for d in w[2])]
    handle = handle or next(e[4][0] for e in log if e[0] == "submit" and e[4])
    assert subs and handle in subs[0][2]
    assert any(e[0] == "submit" and handle in e[3] for e in log[log.index(("collect", n)) :])


def test_requests_arriving_mid_step_join_the_plan_sent_before_outputs(make_engine):
    engine = make_engine(
        async_scheduling=True,
        block_size=4,
        num_kv_blocks=64,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        max_model_len=64,
    )
    log = _log_events(engine)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, greedy)
    engine.step()  # plans 1-3 out, result 1 in, plan 4 out
    arrived = []

    def intake():
        if not arrived:
            engine.add_request("late", {"prompt_token_ids": [8, 9]}, greedy)
            arrived.append(len(log))

    engine.intake = intake
    engine.step()
    new = [e for e in log if e[0] == "submit" and e[4]]
    assert len(new) == 2 and log.index(new[1]) < next(
        i for i, e in enumerate(log) if e[0] == "outputs" and i > arrived[0]
    )
    engine.intake = None
    while engine.has_unfinished():
        engine.step()
    assert len(engine.output("late").outputs[0].token_ids) == 6
    engine.scheduler.blocks.check_all_free()


def test_the_server_loop_takes_only_leading_additions_mid_step(make_engine):
    """``AsyncEngine._intake`` (the serving loop's ``core.intake``): additions at the head of
    the command queue join the next plan; the first other command and all after it wait, in
    order, for the loop."""
    import asyncio

    from cluster.async_engine import AsyncEngine

    engine = make_engine(
        async_scheduling=True,
        block_size=4,
        num_kv_blocks=64,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        max_model_len=64,
    )
    server = AsyncEngine(engine.cfg)
    server.loop = asyncio.new_event_loop()
    try:
        greedy = SamplingParams(temperature=0, max_tokens=2)
        cmds = [
            ("add", "a", {"prompt_token_ids": [5, 6]}, greedy, None, server.loop.create_future()),
            ("abort", "a"),
            ("add", "b", {"prompt_token_ids": [7, 8]}, greedy, None, server.loop.create_future()),
        ]
        for c in cmds:
            server._cmds.put(c)
        server._intake(engine)
        assert "a" in engine.groups and "b" not in engine.groups
        assert server._held == [cmds[1]] and server._cmds.get_nowait() is cmds[2]
        server._intake(engine)  # a held command blocks further intake until the loop ran it
        assert server._held == [cmds[1]]
    finally:
        server.loop.close()


# ------------------------------------------------------------- OutputProcessor alone
def _byte_tokenizer(tmp_path):
    """Byte-level BPE without merges: multi-byte characters span tokens (partial UTF-8)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet(), key=ord))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_shared_single_token_texts_decode_as_without_them(tmp_path):
    from cluster.detokenizer import IncrementalDetokenizer, TokenTexts

    tok = _byte_tokenizer(tmp_path)
    shared = TokenTexts(tok, True)
    for text in ("plain ascii", "héllo wörld — 中文 🙂🚀", "a€b£c𝄞e"):
        prompt, out = tok.encode("prompt ü: "), tok.encode(text)
        a, b = IncrementalDetokenizer(tok, prompt, True), IncrementalDetokenizer(tok, prompt, True, shared)
        for i, t in enumerate(out):
            final = i == len(out) - 1
            assert a.add(t, final) == b.add(t, final)
        assert a.text == b.text == text
    assert shared.single or shared._after  # steady decoding went through the shared texts


def test_a_stop_string_inside_accepted_drafts_truncates_the_request(fake_model_dir):
    """Drafts accepted past a stop string are appended by the scheduler, then dropped by the
    stop string the output processor finds (tokens, text, finish, blocks)."""
    from transformers import AutoTokenizer

    from cluster.input_processor import InputProcessor
    from cluster.output_processor import OutputProcessor
    from cluster.scheduler import Scheduler
    from metadata.config import EngineConfig
    from metadata.wire import SampledRow, StepResult

    tok = AutoTokenizer.from_pretrained(fake_model_dir)
    cfg = EngineConfig.from_options(
        block_size=4,
        num_kv_blocks=32,
        max_num_batched_tokens=64,
        max_num_seqs=4,
        max_model_len=64,
        speculative_method="ngram",
        num_speculative_tokens=3,
        enable_prefix_caching=True,
    )
    sched, outputs = Scheduler(cfg, 32, 64), OutputProcessor(tok)
    (req,) = InputProcessor(tok, (1,), 64, 64, 64, True, 0).make_requests(
        "a", {"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(temperature=0, max_tokens=20, stop=["w31 w32"]), 1 << 20
    )
    outputs.add(req)
    sched.add(req)
    step = sched.schedule()
    update = sched.update_from_result(step, StepResult(step_id=1, outputs=[SampledRow(req.handle, [9])]))
    assert outputs.process(update, sched)[0].text == ""  # "w9" is held back: it could start a stop
    step = sched.schedule()
    assert step.plan.rows[0].num_draft_tokens == 3
    update = sched.update_from_result(step, StepResult(step_id=2, outputs=[SampledRow(req.handle, [30, 31, 32, 33])]))
    assert req.output_token_ids == [9, 30, 31, 32, 33] and not req.finished
    (delta,) = outputs.process(update, sched)
    assert delta.token_ids == [30, 31, 32] and (delta.finish_reason, delta.stop_reason) == ("stop", "w31 w32")
    assert req.output_token_ids == [9, 30, 31, 32] and req.finished and update.num_new_tokens == 3
    out = outputs.request_output("a", [req]).outputs[0]
    assert out.text == " w9 w30 " and out.token_ids == [9, 30, 31, 32]
    sched.has_unfinished()  # frees what the finish deferred past the commit
    sched.blocks.check_all_free()
