"""The official openai client against ``python -m cluster.serve``; outputs equal the offline API's."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest

from metadata.sampling_params import SamplingParams


SEEDED = [
    ("w5 w6 w7", dict(temperature=0.8, top_p=0.9, seed=11, max_tokens=8)),
    ("w20 w21", dict(temperature=1.0, top_k=20, seed=12, max_tokens=6)),
    ("w9", dict(temperature=0.0, max_tokens=10, ignore_eos=True)),
    (
        "w40 w41 w42 w43",
        dict(
            temperature=0.7,
            min_p=0.05,
            seed=13,
            max_tokens=7,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            repetition_penalty=1.2,
        ),
    ),
]


def _extra(kw):
    return {k: kw[k] for k in ("top_k", "min_p", "repetition_penalty", "ignore_eos") if k in kw}


def _std(kw):
    return {
        k: kw[k]
        for k in ("temperature", "top_p", "seed", "max_tokens", "presence_penalty", "frequency_penalty")
        if k in kw
    }


def test_models_health_metrics(server, openai_client, model_name):
    models = openai_client.models.list()
    assert [m.id for m in models.data] == [model_name]
    assert openai_client.models.retrieve(model_name).id == model_name
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    # the checkpoint folder's name is accepted too (no --served-model-name)
    alias = os.path.basename(model_name)
    assert openai_client.completions.create(model=alias, prompt="w5", max_tokens=2).usage.completion_tokens == 2
    text = httpx.get(server.url + "/metrics").text  # open, like /health
    for name in (
        "syncless:num_requests_running",
        "syncless:num_requests_waiting",
        "syncless:kv_cache_usage_perc",
        "syncless:time_to_first_token_seconds",
        "syncless:inter_token_latency_seconds",
        "syncless:generation_tokens_per_second",
    ):
        assert name in text


def _metric(server, name: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} missing from /metrics")


def test_prefix_cache_hits_reach_metrics(server, openai_client, model_name):
    """A repeated long prompt hits the prefix cache, and the live engine's counters reach /metrics."""
    prompt = " ".join(f"w{i}" for i in range(300, 380))
    before = _metric(server, "syncless:prefix_cache_hits_total")
    for _ in range(2):  # sequential: the second is admitted after the first's blocks are confirmed
        openai_client.completions.create(model=model_name, prompt=prompt, max_tokens=2, temperature=0)
    server.wait_kv_free()
    assert _metric(server, "syncless:prefix_cache_hits_total") > before
    assert 0 < _metric(server, "syncless:prefix_cache_hit_rate") <= 1


@pytest.mark.parametrize("prompt,kw", SEEDED, ids=["top_p", "top_k", "greedy", "penalties"])
def test_completion_equals_offline(openai_client, offline, model_name, prompt, kw):
    (ref,) = offline.generate([prompt], SamplingParams(**kw))
    r = openai_client.completions.create(model=model_name, prompt=prompt, extra_body=_extra(kw), **_std(kw))
    assert r.choices[0].text == ref.outputs[0].text
    assert r.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_completion_batch_token_ids_and_n(openai_client, offline, model_name):
    prompts = [[5, 6, 7], [100, 101]]
    params = SamplingParams(temperature=0.9, seed=3, max_tokens=5, n=2)
    refs = offline.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    r = openai_client.completions.create(model=model_name, prompt=prompts, n=2, temperature=0.9, seed=3, max_tokens=5)
    got = {c.index: c.text for c in r.choices}
    want = {i * 2 + o.index: o.text for i, ref in enumerate(refs) for o in ref.outputs}
    assert got == want
    assert r.usage.completion_tokens == sum(len(o.token_ids) for ref in refs for o in ref.outputs)
    texts = ["w5 w6", "w7"]
    refs = offline.generate(texts, SamplingParams(temperature=0.5, seed=9, max_tokens=4), use_tqdm=False)
    r = openai_client.completions.create(
        model=model_name, prompt=texts, temperature=0.5, seed=9, max_tokens=4, echo=True
    )
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [
        t + ref.outputs[0].text for t, ref in zip(texts, refs)
    ]


def test_completion_stream_equals_offline(openai_client, offline, model_name):
    prompt, kw = SEEDED[0]
    (ref,) = offline.generate([prompt], SamplingParams(**kw))
    chunks = list(
        openai_client.completions.create(
            model=model_name, prompt=prompt, stream=True, stream_options={"include_usage": True}, **_std(kw)
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [ref.outputs[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_stop_string_and_logprobs_equal_offline(openai_client, offline, model_name):
    prompt = "w5 w6 w7"
    (free,) = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    stop = free.outputs[0].text.split()[3]  # a word the greedy continuation produces
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=[stop], logprobs=2)
    (ref,) = offline.generate([prompt], params, use_tqdm=False)
    r = openai_client.completions.create(
        model=model_name,
        prompt=prompt,
        temperature=0,
        max_tokens=8,
        stop=[stop],
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    c = r.choices[0]
    assert c.text == ref.outputs[0].text and c.finish_reason == "stop"
    want = [lp[t] for t, lp in zip(ref.outputs[0].token_ids, ref.outputs[0].logprobs)]
    assert c.logprobs.token_logprobs == pytest.approx(want, abs=1e-5)
    assert all(len(top) >= 2 for top in c.logprobs.top_logprobs)


def test_echo_with_logprobs_scores_the_prompt(openai_client, offline, model_name):
    """echo + logprobs (how lm-eval scores a continuation): the prompt's tokens lead the
    logprobs, the first without any, the rest equal to the offline prompt_logprobs; streamed
    alike, in the first chunk."""
    prompt = "w5 w6 w7 w8 w9"
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    (ref,) = offline.generate([prompt], params, use_tqdm=False)
    n_prompt, tok = len(ref.prompt_token_ids), offline.get_tokenizer()
    want = [None] + [lp[t] for t, lp in zip(ref.prompt_token_ids[1:], ref.prompt_logprobs[1:])]
    want += [lp[t] for t, lp in zip(ref.outputs[0].token_ids, ref.outputs[0].logprobs)]
    kw = dict(model=model_name, prompt=prompt, temperature=0, max_tokens=2, logprobs=1, echo=True)
    r = openai_client.completions.create(**kw, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(want[1:], abs=1e-5)
    assert lp.tokens[:n_prompt] == [tok.decode([t]) for t in ref.prompt_token_ids]
    assert all(len(top) >= 1 for top in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and len(lp.tokens) == n_prompt + 2
    assert r.choices[0].text == prompt + ref.outputs[0].text
    chunks = list(openai_client.completions.create(**kw, stream=True, extra_body={"ignore_eos": True}))
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(want[1:], abs=1e-5)
    # max_tokens=0: the prompt alone, scored (the legacy OpenAI way), streamed alike
    kw.update(max_tokens=0, stream_options=None)
    r0 = openai_client.completions.create(**kw)
    assert r0.choices[0].text == prompt and r0.usage.completion_tokens == 0
    assert r0.choices[0].logprobs.token_logprobs[1:] == pytest.approx(want[1:n_prompt], abs=1e-5)
    assert len(r0.choices[0].logprobs.tokens) == n_prompt
    chunks = list(openai_client.completions.create(**{**kw, "stream_options": {"include_usage": True}}, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == prompt
    assert chunks[-1].usage.completion_tokens == 0


def test_logit_bias_equals_offline(openai_client, offline, model_name):
    """OpenAI's logit_bias (string token ids) reaches the sampler as the offline API's does."""
    prompt, bias = "w5 w6 w7", {7: 100.0, 9: -100.0}
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logit_bias=bias)
    (ref,) = offline.generate([prompt], params, use_tqdm=False)
    assert ref.outputs[0].token_ids == [7] * 4
    r = openai_client.completions.create(
        model=model_name,
        prompt=prompt,
        temperature=0,
        max_tokens=4,
        logit_bias={str(t): b for t, b in bias.items()},
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].text == ref.outputs[0].text


def test_allowed_ids_truncation_and_bad_words_equal_offline(openai_client, offline, model_name):
    """vLLM's allowed_token_ids, truncate_prompt_tokens and bad_words extras, on completions (a
    token list longer than the context is served when truncated) and chat, equal the offline API's."""
    long_prompt = list(range(10, 250)) * 3  # 720 tokens, past max_model_len
    params = SamplingParams(
        temperature=0.8, seed=2, max_tokens=6, ignore_eos=True, allowed_token_ids=[7, 9, 11], truncate_prompt_tokens=20
    )
    (ref,) = offline.generate([{"prompt_token_ids": long_prompt}], params, use_tqdm=False)
    assert ref.prompt_token_ids == long_prompt[-20:] and set(ref.outputs[0].token_ids) <= {7, 9, 11}
    extra = {"allowed_token_ids": [7, 9, 11], "truncate_prompt_tokens": 20, "ignore_eos": True}
    r = openai_client.completions.create(
        model=model_name, prompt=long_prompt, temperature=0.8, seed=2, max_tokens=6, extra_body=extra
    )
    assert r.choices[0].text == ref.outputs[0].text and r.usage.prompt_tokens == 20
    c = openai_client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "w5"}],
        max_tokens=4,
        extra_body={"allowed_token_ids": [12], "ignore_eos": True},
    )
    assert c.choices[0].message.content.split() == ["w12"] * 4
    # bad_words: the greedy completion's first word, banned
    free = openai_client.completions.create(model=model_name, prompt="w5 w6", temperature=0, max_tokens=3)
    first = free.choices[0].text.split()[0]
    params = SamplingParams(temperature=0, max_tokens=3, bad_words=[first])
    (ref,) = offline.generate(["w5 w6"], params, use_tqdm=False)
    r = openai_client.completions.create(
        model=model_name, prompt="w5 w6", temperature=0, max_tokens=3, extra_body={"bad_words": [first]}
    )
    assert r.choices[0].text == ref.outputs[0].text and first not in r.choices[0].text.split()


def test_structured_outputs_equal_offline(openai_client, offline, model_name):
    """vLLM's structured_outputs (a choice; this word-level vocabulary can spell nothing else)
    on chat and completions, equal to the offline API's."""
    choice = {"choice": ["w7", "w9", "w11"]}
    params = SamplingParams(temperature=0.9, seed=4, max_tokens=5, structured_outputs=choice)
    (ref,) = offline.generate(["w5 w6"], params, use_tqdm=False)
    assert ref.outputs[0].text.strip() in ("w7", "w9", "w11") and ref.outputs[0].finish_reason == "stop"
    extra = {"structured_outputs": choice}
    r = openai_client.completions.create(
        model=model_name, prompt="w5 w6", temperature=0.9, seed=4, max_tokens=5, extra_body=extra
    )
    assert r.choices[0].text == ref.outputs[0].text
    extra_chat = {"structured_outputs": {**choice, "disable_any_whitespace": True}}  # (vLLM's field; JSON only)
    c = openai_client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "w5"}],
        temperature=0,
        max_tokens=5,
        extra_body=extra_chat,
    )
    assert c.choices[0].message.content.strip() in ("w7", "w9", "w11")
    # vLLM's older field name, the same constraint
    r2 = openai_client.completions.create(
        model=model_name,
        prompt="w5 w6",
        temperature=0.9,
        seed=4,
        max_tokens=5,
        extra_body={"guided_choice": choice["choice"]},
    )
    assert r2.choices[0].text == ref.outputs[0].text


def _chat_ref(offline, messages, params):
    tok = offline.get_tokenizer()
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    (ref,) = offline.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    return ref


def test_chat_equals_offline(openai_client, offline, model_name):
    messages = [{"role": "system", "content": "w10 w11"}, {"role": "user", "content": "w12 w13 w14"}]
    ref = _chat_ref(offline, messages, SamplingParams(temperature=0.8, seed=5, max_tokens=9))
    r = openai_client.chat.completions.create(
        model=model_name, messages=messages, temperature=0.8, seed=5, max_tokens=9
    )
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_chat_stream_and_logprobs(openai_client, offline, model_name):
    messages = [{"role": "user", "content": [{"type": "text", "text": "w30 w31"}]}]
    ref = _chat_ref(
        offline,
        [{"role": "user", "content": "w30 w31"}],
        SamplingParams(temperature=0.6, seed=8, max_tokens=6, logprobs=3, n=2),
    )
    stream = openai_client.chat.completions.create(
        model=model_name,
        messages=messages,
        temperature=0.6,
        seed=8,
        max_completion_tokens=6,
        logprobs=True,
        top_logprobs=3,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, lps, roles = {0: "", 1: ""}, {0: [], 1: []}, set()
    usage = None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.role:
                roles.add(c.index)
            texts[c.index] += c.delta.content or ""
            if c.logprobs and c.logprobs.content:
                lps[c.index] += [e.logprob for e in c.logprobs.content]
                assert all(len(e.top_logprobs) == 3 for e in c.logprobs.content)
    assert roles == {0, 1}
    for o in ref.outputs:
        assert texts[o.index] == o.text
        assert lps[o.index] == pytest.approx([lp[t] for t, lp in zip(o.token_ids, o.logprobs)], abs=1e-5)
    assert usage.completion_tokens == sum(len(o.token_ids) for o in ref.outputs)


def test_continuous_usage_stats(openai_client, model_name):
    """vLLM's ``stream_options.continuous_usage_stats``: every chunk carries the usage so far
    (chat's role chunks included), growing to the final usage chunk's."""
    for chat in (False, True):
        kw = dict(model=model_name, temperature=0, max_tokens=5, n=2, extra_body={"ignore_eos": True}, stream=True)
        kw["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        if chat:
            chunks = list(openai_client.chat.completions.create(messages=[{"role": "user", "content": "w5"}], **kw))
        else:
            chunks = list(openai_client.completions.create(prompt="w5 w6", **kw))
        done = [c.usage.completion_tokens for c in chunks]
        assert all(c.usage is not None and c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks)
        assert done == sorted(done) and done[0] == (0 if chat else 1) and done[-1] == 10 and not chunks[-1].choices
        assert len(set(done)) > 2  # (the count grows chunk by chunk)


def test_disconnect_aborts_and_frees_kv(server, model_name):
    """A streaming client that goes away, and a non-streaming one that is cancelled, free their blocks."""
    headers = {"Authorization": f"Bearer {server.api_key}"}
    body = {"model": model_name, "prompt": "w5 w6", "max_tokens": 500, "ignore_eos": True, "n": 4}
    with httpx.Client(timeout=60, headers=headers) as c:
        before = _aborts(c, server)
        with c.stream("POST", server.url + "/v1/completions", json=dict(body, stream=True)) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(4)]
            assert any(line.startswith("data: ") for line in got)
        # the response was closed mid-stream: the server aborts the request (4 sequences)
        server.wait_kv_free()
        assert _aborts(c, server) == before + 4

    async def cancel_midway():
        async with httpx.AsyncClient(timeout=60, headers=headers) as ac:
            task = asyncio.ensure_future(ac.post(server.url + "/v1/completions", json=body))
            for _ in range(500):
                st = (await ac.get(server.url + "/v1/debug/kv")).json()
                if st["running"] > 0:
                    break
                await asyncio.sleep(0.01)
            assert st["running"] > 0 and not task.done()
            task.cancel()  # the connection closes before the response
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(cancel_midway())
    server.wait_kv_free()
    with httpx.Client(timeout=60, headers=headers) as c:
        assert _aborts(c, server) == before + 8


def _aborts(client: httpx.Client, server) -> float:
    total = 0.0
    for line in client.get(server.url + "/metrics").text.splitlines():
        if line.startswith("syncless:request_success_total") and 'finished_reason="abort"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total
