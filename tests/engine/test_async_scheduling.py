"""Async scheduling (one plan ahead of the workers) gives exactly what synchronous scheduling gives.

Two real engines over one tiny checkpoint, ``async_scheduling=True`` and ``False``,
with a KV cache small enough to force preemption and a token budget small
enough to force chunked prefill. Greedy requests are also checked against
transformers; seeded sampling must agree between the modes; no KV block may
stay allocated once every request ended; a finished request's extra in-flight
token must never reach its output or its stream.
"""

from __future__ import annotations

import random

import pytest
import torch

from cluster import LLM, SamplingParams
from cluster.input_processor import InvalidRequestError
from metadata.attention_metadata import AttentionMetadata, ExactLengthUnavailable
from tests.checkpoints import hf_greedy

BLOCK = 8
NUM_BLOCKS = 14  # 112 token slots
MAX_MODEL_LEN = 128
MAX_NEW = 24


def _prompt(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(n)]


PROMPTS = [_prompt(i, n) for i, n in enumerate([3, 17, 30, 9, 41, 5, 22, 12])]


@pytest.fixture(scope="module")
def model(ckpt_dir):
    return ckpt_dir("llama")


@pytest.fixture(scope="module")
def engines(ray_local, model):
    made = {}
    try:
        for mode in (False, True):
            made[mode] = LLM(
                model=str(model),
                block_size=BLOCK,
                num_kv_blocks=NUM_BLOCKS,
                max_num_batched_tokens=32,
                max_num_seqs=6,
                max_model_len=MAX_MODEL_LEN,
                async_scheduling=mode,
            )
        assert made[True].engine.async_scheduling and not made[False].engine.async_scheduling
        yield made
    finally:
        for llm in made.values():
            llm.shutdown()


@pytest.fixture(scope="module")
def greedy_ref(model):
    return hf_greedy(model, PROMPTS, MAX_NEW)


def alive(llm):
    """An engine that died mid-run ends requests with finish_reason 'error'; say why."""
    assert llm.engine.dead is None, f"async={llm.engine.async_scheduling}: the engine died: {llm.engine.dead}"


def cont(tok, prompt, out):
    return tok.decode(prompt + out, skip_special_tokens=True)[len(tok.decode(prompt, skip_special_tokens=True)) :]


def _stop_string(tok, prompt, ids, at):
    """A stop string spanning the end of token ``at`` and the start of token ``at + 1``."""
    a, b = cont(tok, prompt, ids[: at + 1]), cont(tok, prompt, ids[: at + 2])
    return a[-2:] + b[len(a) : len(a) + 2]


def _params(tok, greedy_ref):
    """Mixed: greedy to max_tokens, seeded sampling, stop strings, stop token ids, EOS on."""
    g = greedy_ref
    return [
        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(
            temperature=0, max_tokens=MAX_NEW, ignore_eos=True, stop=[_stop_string(tok, PROMPTS[2], g[2], 5)]
        ),
        SamplingParams(
            temperature=0,
            max_tokens=MAX_NEW,
            ignore_eos=True,
            stop=[_stop_string(tok, PROMPTS[3], g[3], 9)],
            include_stop_str_in_output=True,
        ),
        SamplingParams(temperature=1.0, top_p=0.9, seed=17, max_tokens=MAX_NEW, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, stop_token_ids=[g[5][4]]),
        SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=1.1, seed=3, max_tokens=MAX_NEW, repetition_penalty=1.2, logprobs=2, n=2),
    ]


def _summary(outs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


def _check_against_reference(tok, outs, params, greedy_ref):
    g = greedy_ref
    c = [o.outputs[0] for o in outs]
    assert c[0].token_ids == g[0] and c[0].finish_reason == "length"
    assert c[1].token_ids == g[1][:7] and len(c[1].token_ids) == 7 and c[1].finish_reason == "length"
    for i in (2, 3):
        stop = params[i].stop[0]
        full = cont(tok, PROMPTS[i], g[i])
        n_tok = next(k for k in range(1, MAX_NEW + 1) if stop in cont(tok, PROMPTS[i], g[i][:k]))
        assert c[i].token_ids == g[i][:n_tok], "tokens after the stop string leaked"
        cut = full.find(stop) + (len(stop) if params[i].include_stop_str_in_output else 0)
        assert c[i].text == full[:cut] and c[i].finish_reason == "stop" and c[i].stop_reason == stop
    stop_tok = params[5].stop_token_ids[0]
    assert c[5].token_ids == g[5][: g[5].index(stop_tok) + 1] and c[5].stop_reason == stop_tok
    assert len(c[6].token_ids) == 1
    assert len(c[4].token_ids) == MAX_NEW
    assert c[7].token_ids != outs[7].outputs[1].token_ids


def test_mixed_workload_async_equals_sync(engines, greedy_ref):
    results = {}
    for mode, llm in engines.items():
        tok = llm.get_tokenizer()
        params = _params(tok, greedy_ref)
        before = llm.engine.scheduler.num_preemptions
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        alive(llm)
        assert llm.engine.scheduler.num_preemptions > before, f"async={mode}: the tiny cache should preempt"
        llm.engine.scheduler.blocks.check_all_free()
        assert not llm.engine.has_unfinished()
        _check_against_reference(tok, outs, params, greedy_ref)
        results[mode] = _summary(outs)
        lp = [[c.logprobs for c in o.outputs] for o in outs]
        results[(mode, "lp")] = lp
    assert results[True] == results[False]
    for a, b in zip(results[(True, "lp")], results[(False, "lp")]):
        for x, y in zip(a, b):
            if x is None:
                assert y is None
                continue
            for dx, dy in zip(x, y):
                assert dx.keys() == dy.keys()
                assert all(abs(dx[k] - dy[k]) < 1e-5 for k in dx)


def _drive(engine, todo, abort_at: dict[int, list[str]], max_steps=5000):
    """Add requests, step manually, abort some after given steps; returns outputs and streams."""
    for rid, p, sp in todo:
        engine.add_request(rid, {"prompt_token_ids": p}, sp)
    streamed: dict[str, list] = {rid: [[], ""] for rid, _, _ in todo}
    step = 0
    while engine.has_unfinished():
        step += 1
        assert step < max_steps
        for d in engine.step():
            s = streamed[d.request_id]
            s[0] += d.token_ids
            s[1] += d.text
        for rid in abort_at.get(step, []):
            assert engine.abort(rid)
    assert engine.dead is None, f"async={engine.async_scheduling}: the engine died: {engine.dead}"
    outs = {rid: engine.output(rid) for rid, _, _ in todo}
    for rid in outs:
        engine.release(rid)
    return outs, streamed


def test_aborts_mid_stream(engines, greedy_ref):
    results = {}
    for mode, llm in engines.items():
        tok = llm.get_tokenizer()
        params = _params(tok, greedy_ref)
        todo = [(f"m{i}", PROMPTS[i], params[i]) for i in range(6)]
        # abort a decoding request, one still waiting/prefilling, and one that is preempted or not
        outs, streamed = _drive(llm.engine, todo, {3: ["m4"], 4: ["m0", "m1"], 9: ["m2"]})
        llm.engine.scheduler.blocks.check_all_free()
        full = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:6]], params[:6], use_tqdm=False)
        alive(llm)
        for i, (rid, _, _) in enumerate(todo):
            c = outs[rid].outputs[0]
            ref = full[i].outputs[0]
            assert streamed[rid][0] == c.token_ids, "streamed tokens differ from the output"
            if c.finish_reason == "abort":
                assert c.token_ids == ref.token_ids[: len(c.token_ids)]
                assert len(c.token_ids) <= len(ref.token_ids)
                assert ref.text.startswith(c.text)
            else:
                assert (c.token_ids, c.text, c.finish_reason) == (ref.token_ids, ref.text, ref.finish_reason)
                assert streamed[rid][1] == c.text
        assert outs["m4"].outputs[0].finish_reason == "abort"
        assert outs["m3"].outputs[0].finish_reason == "stop"
        results[mode] = {
            rid: o.outputs[0].token_ids for rid, o in outs.items() if o.outputs[0].finish_reason != "abort"
        }
        llm.engine.scheduler.blocks.check_all_free()
    assert results[True] == results[False]


def test_in_flight_token_never_leaks(engines, greedy_ref):
    """Every request ends exactly where it should, in the output and in the stream."""
    for mode, llm in engines.items():
        tok = llm.get_tokenizer()
        todo = []
        for i, p in enumerate(PROMPTS[:6]):
            g = greedy_ref[i]
            todo.append((f"x{i}", p, SamplingParams(temperature=0, max_tokens=1 + 3 * i, ignore_eos=True)))
            todo.append(
                (
                    f"y{i}",
                    p,
                    SamplingParams(
                        temperature=0, max_tokens=MAX_NEW, ignore_eos=True, stop=[_stop_string(tok, p, g, 2 + i)]
                    ),
                )
            )
        outs, streamed = _drive(llm.engine, todo, {})
        for i, p in enumerate(PROMPTS[:6]):
            g = greedy_ref[i]
            x = outs[f"x{i}"].outputs[0]
            assert len(x.token_ids) == 1 + 3 * i and x.token_ids == g[: 1 + 3 * i], f"async={mode}"
            assert streamed[f"x{i}"] == [x.token_ids, x.text]
            y = outs[f"y{i}"].outputs[0]
            stop = _stop_string(tok, p, g, 2 + i)
            full = cont(tok, p, g)
            n_tok = next(k for k in range(1, MAX_NEW + 1) if stop in cont(tok, p, g[:k]))
            assert y.token_ids == g[:n_tok] and y.text == full[: full.find(stop)], f"async={mode}"
            assert streamed[f"y{i}"] == [y.token_ids, y.text]
        llm.engine.scheduler.blocks.check_all_free()


def test_seeded_sampling_async_equals_sync(engines):
    res = {}
    for mode, llm in engines.items():
        ps = [{"prompt_token_ids": p} for p in PROMPTS[:5]]
        sps = [
            SamplingParams(
                temperature=t,
                top_p=tp,
                top_k=k,
                min_p=mp,
                seed=100 + i,
                max_tokens=MAX_NEW,
                ignore_eos=True,
                presence_penalty=0.3 * (i % 2),
            )
            for i, (t, tp, k, mp) in enumerate(
                [(1.0, 1.0, 0, 0.0), (0.7, 0.9, 0, 0.0), (1.3, 1.0, 10, 0.0), (1.0, 1.0, 0, 0.1), (2.0, 0.8, 50, 0.02)]
            )
        ]
        res[mode] = _tokens = [o.outputs[0].token_ids for o in llm.generate(ps, sps, use_tqdm=False)]
        alive(llm)
        assert all(len(t) == MAX_NEW for t in _tokens)
        # alone, the same seeds give the same tokens
        assert llm.generate([ps[2]], sps[2])[0].outputs[0].token_ids == _tokens[2]
        llm.engine.scheduler.blocks.check_all_free()
    assert res[True] == res[False]


def test_sequence_longer_than_the_cache(engines):
    """The cache holds 112 tokens < max_model_len 128: refuse prompts that cannot fit, end
    sequences at the cache's size with 'length' (it used to loop forever)."""
    for mode, llm in engines.items():
        with pytest.raises(InvalidRequestError, match="KV cache holds only 112 tokens"):
            llm.engine.add_request("huge", [5] * 115, SamplingParams(max_tokens=1))
        outs, _ = _drive(
            llm.engine,
            [("long", [7] * 100, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))],
            {},
            max_steps=300,
        )
        c = outs["long"].outputs[0]
        assert len(c.token_ids) == 12 and c.finish_reason == "length"
        llm.engine.scheduler.blocks.check_all_free()


# ---------------------------------------------------------------- exact lengths
def _meta(exact: bool) -> AttentionMetadata:
    qsl = torch.tensor([0, 3, 4], dtype=torch.int32)
    return AttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.tensor([3, 9], dtype=torch.int32),
        seq_lens_upper_bound=torch.tensor([3, 9], dtype=torch.int32) + (0 if exact else 2),
        block_table=torch.zeros(2, 2, dtype=torch.int32),
        slot_mapping=torch.arange(4),
        positions=torch.tensor([0, 1, 2, 8]),
        num_reqs=2,
        num_actual_tokens=4,
        max_query_len=3,
        max_seq_len_upper_bound=9 if exact else 11,
        bounds_are_exact=exact,
    )


def test_exact_seq_lens_cpu():
    m = _meta(True)
    assert m.exact_seq_lens_cpu("my-kernel").tolist() == [3, 9]
    assert m.query_lens_cpu.tolist() == [3, 1]
    assert m.num_computed_tokens().tolist() == [0, 8]
    m = _meta(False)
    with pytest.raises(ExactLengthUnavailable, match="my-kernel"):
        m.exact_seq_lens_cpu("my-kernel")
    # the unpadded view keeps the flag
    with pytest.raises(ExactLengthUnavailable):
        m.unpadded(3, 1).exact_seq_lens_cpu("x")
    assert _meta(True).unpadded(3, 1).exact_seq_lens_cpu("x").tolist() == [3]
