"""Bad requests of every kind get OpenAI's error JSON with the documented status, and
the server keeps serving other requests while they arrive."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from metadata.sampling_params import SamplingParams


CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "w5 w6"}]

# (path, body (dict or raw bytes), status, param, substring of the message)
CASES = [
    # wrong JSON types
    (CMPL, {"prompt": "w5", "max_tokens": "x"}, 400, "max_tokens", "max_tokens"),
    (CMPL, {"prompt": "w5", "temperature": "hot"}, 400, "temperature", "temperature"),
    (CMPL, {"prompt": "w5", "n": 1.5}, 400, "n", "n: Expected `int`"),
    (CMPL, {"prompt": "w5", "stream": "yes"}, 400, "stream", "stream"),
    (CMPL, {"prompt": "w5", "stop": [1]}, 400, "stop", "stop"),
    (CMPL, {"prompt": "w5", "seed": True}, 400, "seed", "seed"),
    (CMPL, {"prompt": 5}, 400, "prompt", "prompt"),
    (CMPL, {"prompt": [1, "a"]}, 400, "prompt", "prompt"),
    (CMPL, {"prompt": ""}, 400, "prompt", "empty"),
    (CMPL, {"max_tokens": 3}, 400, "prompt", "prompt: a required field is missing"),
    (CMPL, {"prompt": "w5", "foo": 1}, 400, "foo", "unrecognized request argument supplied: foo"),
    (CMPL, b"{not json", 400, None, "not valid JSON"),
    (CMPL, b"", 400, None, "empty"),
    (CMPL, b"[1, 2]", 400, None, "Expected `object`"),
    (CHAT, {"messages": "hi"}, 400, "messages", "messages"),
    (CHAT, {"messages": []}, 400, "messages", "must not be empty"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages", "messages[0].content"),
    (CHAT, {"messages": [{"content": "hi"}]}, 400, "messages", "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages", "text content"),
    # out-of-range sampling parameters
    (CMPL, {"prompt": "w5", "temperature": -1}, 400, "temperature", "temperature must be 0 (greedy) or in"),
    (CMPL, {"prompt": "w5", "top_p": 0}, 400, "top_p", "top_p must be in (0, 1]"),
    (CMPL, {"prompt": "w5", "top_p": 1.5}, 400, "top_p", "top_p"),
    (CMPL, {"prompt": "w5", "top_k": -2}, 400, "top_k", "top_k"),
    (CMPL, {"prompt": "w5", "min_p": 2}, 400, "min_p", "min_p"),
    (CMPL, {"prompt": "w5", "n": 0}, 400, "n", "n must be in [1, 128]"),
    (CMPL, {"prompt": "w5", "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
    (CMPL, {"prompt": "w5", "presence_penalty": 3}, 400, "presence_penalty", "presence_penalty"),
    (CMPL, {"prompt": "w5", "frequency_penalty": -3}, 400, "frequency_penalty", "frequency_penalty"),
    (CMPL, {"prompt": "w5", "repetition_penalty": 0}, 400, "repetition_penalty", "repetition_penalty"),
    (CMPL, {"prompt": "w5", "seed": -1}, 400, "seed", "seed"),
    (CMPL, {"prompt": "w5", "logprobs": 21}, 400, "logprobs", "logprobs"),
    (CMPL, {"prompt": "w5", "min_tokens": 9, "max_tokens": 5}, 400, "min_tokens", "min_tokens"),
    (CMPL, {"prompt": "w5", "stop_token_ids": [-1]}, 400, "stop_token_ids", "stop_token_ids"),
    (CMPL, {"prompt": "w5", "stop_token_ids": [999]}, 400, "stop_token_ids", "outside the vocabulary"),
    (CMPL, {"prompt": "w5", "stop": [""]}, 400, "stop", "stop"),
    (CMPL, {"prompt": "w5", "best_of": 3}, 400, "best_of", "best_of"),
    (CMPL, {"prompt": "w5", "logit_bias": {"w5": 1.0}}, 400, "logit_bias", "keys must be token ids"),
    (CMPL, {"prompt": "w5", "logit_bias": {"5": 101}}, 400, "logit_bias", "in [-100, 100], got 101.0 for 5"),
    (CHAT, {"messages": MSG, "logit_bias": {"999": 1}}, 400, "logit_bias", "999 is outside the vocabulary"),
    (CMPL, {"prompt": "w5", "priority": 2}, 400, "priority", "--scheduling-policy priority"),
    (CHAT, {"messages": MSG, "priority": "high"}, 400, "priority", "priority"),
    (CMPL, {"prompt": "w5", "allowed_token_ids": [5, 999]}, 400, "allowed_token_ids", "999 is outside the vocabulary"),
    (CMPL, {"prompt": "w5", "bad_words": [""]}, 400, "bad_words", "bad_words"),
    (CMPL, {"prompt": "w5", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens", "truncate_prompt_tokens"),
    (CMPL, {"prompt": [5, 999]}, 400, "prompt", "outside the vocabulary"),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs", "requires logprobs"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 30}, 400, "top_logprobs", "top_logprobs"),
    (CHAT, {"messages": MSG, "max_completion_tokens": 0}, 400, "max_completion_tokens", "max_completion_tokens"),
    (CHAT, {"messages": MSG, "temperature": 9, "top_p": -1}, 400, "top_p", "top_p"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools", "tools"),
    (CHAT, {"messages": MSG, "response_format": {"type": "xml"}}, 400, "response_format", "'json_schema'"),
    (CMPL, {"prompt": "w5", "response_format": {"type": "json_schema"}}, 400, "response_format", "schema"),
    (
        CHAT,
        {"messages": MSG, "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "w5"}},
        400,
        "response_format",
        "set one of",
    ),
    (CMPL, {"prompt": "w5", "structured_outputs": {"regex": "[0-9"}}, 400, "structured_outputs", "does not compile"),
    (CMPL, {"prompt": "w5", "structured_outputs": {"json": ""}}, 400, "structured_outputs", "a JSON schema"),
    # (this word-level vocabulary cannot spell JSON)
    (CMPL, {"prompt": "w5", "response_format": {"type": "json_object"}}, 400, "structured_outputs", "can begin"),
    (CMPL, {"prompt": "w5", "guided_regex": "[a-z ]{1,60000}"}, 400, "structured_outputs", "above 4096"),
    (CMPL, {"prompt": "w5", "guided_choice": ["w5"], "min_tokens": 2}, 400, "min_tokens", "0 with structured_outputs"),
    (
        CMPL,
        {"prompt": "w5", "guided_choice": ["w5"], "structured_outputs": {"regex": "w5"}},
        400,
        "response_format",
        "one of",
    ),
    # too-long prompts (max_model_len 512)
    (CMPL, {"prompt": "w5 " * 600}, 400, "prompt", "max_model_len is 512"),
    (CMPL, {"prompt": [5] * 520}, 400, "prompt", "max_model_len is 512"),
    (CHAT, {"messages": [{"role": "user", "content": "w5 " * 600}]}, 400, "messages", "max_model_len is 512"),
    # a set output length past the context (a default one is cut: test_default_length_is_cut)
    (
        CMPL,
        {"prompt": [5] * 500, "max_tokens": 20},
        400,
        "max_tokens",
        "maximum context length is 512 "
        "tokens. However, you requested 520 tokens (500 in the prompt, 20 in the completion)",
    ),
    (CHAT, {"messages": MSG, "max_completion_tokens": 600}, 400, "max_completion_tokens", "context length is 512"),
    (CHAT, {"messages": MSG, "max_tokens": 600}, 400, "max_tokens", "context length is 512"),
    # unknown model / route / method
    (CMPL, {"prompt": "w5", "model": "gpt-4"}, 404, "model", "'gpt-4' does not exist"),
    (CHAT, {"messages": MSG, "model": "gpt-4"}, 404, "model", "does not exist"),
    ("GET /v1/models/gpt-4", None, 404, "model", "does not exist"),
    ("GET /v1/nope", None, 404, None, "no route"),
    ("GET /v1/completions", None, 405, None, "not allowed"),
]


def _send(client: httpx.Client, server, path, body, headers=None):
    method, _, p = path.rpartition(" ")
    url = server.url + p
    if method == "GET":
        return client.get(url, headers=headers)
    if isinstance(body, bytes):
        return client.post(url, content=body, headers={"Content-Type": "application/json", **(headers or {})})
    return client.post(url, json=body, headers=headers)


def _check(resp, status, param, text):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    assert text in err["message"], err
    assert "Traceback" not in resp.text


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {server.api_key}"}) as c:
        yield c


@pytest.mark.parametrize(
    "path,body,status,param,text", CASES, ids=[f"{i}-{c[3] or c[4][:12]}" for i, c in enumerate(CASES)]
)
def test_bad_request(server, client, path, body, status, param, text):
    _check(_send(client, server, path, body), status, param, text)


@pytest.mark.parametrize(
    "path,body",
    [
        (CMPL, {"prompt": [5] * 500, "ignore_eos": True}),  # completions' default max_tokens 16
        (CMPL, {"prompt": [5] * 500, "ignore_eos": True, "max_tokens": 12}),  # exactly the room
        (CHAT, {"messages": MSG, "ignore_eos": True}),  # chat's default: the whole context
    ],
)
def test_default_length_is_cut(server, client, path, body):
    """A length the client did not set (or that fits exactly) ends at the context, as
    'length'; only a set one past it is refused (CASES)."""
    resp = _send(client, server, path, body)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    use = data["usage"]
    assert data["choices"][0]["finish_reason"] == "length"
    assert use["total_tokens"] == 512 and use["completion_tokens"] == 512 - use["prompt_tokens"]


@pytest.mark.parametrize(
    "headers,text",
    [
        ({}, "missing API key"),
        ({"Authorization": "Bearer wrong"}, "invalid API key"),
        ({"Authorization": "Basic dGVzdA=="}, "invalid API key"),
    ],
)
def test_api_key(server, headers, text):
    with httpx.Client(timeout=30) as c:
        for path, body in ((CMPL, {"prompt": "w5"}), (CHAT, {"messages": MSG}), ("GET /v1/models", None)):
            r = _send(c, server, path, body, headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            assert text in r.json()["error"]["message"]
        assert c.get(server.url + "/health").status_code == 200  # health and metrics stay open


def test_openai_client_error_classes(server, model_name):
    good = openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0)
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="temperature must be 0"):
        good.completions.create(model=model_name, prompt="w5", temperature=-1)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        good.chat.completions.create(model="gpt-4", messages=MSG)
    with pytest.raises(openai.AuthenticationError, match="invalid API key"):
        bad.completions.create(model=model_name, prompt="w5")
    good.close()
    bad.close()


def test_keeps_serving_while_bad_requests_arrive(server, offline, model_name):
    """A long stream and good requests complete, unchanged, while every bad request above arrives."""
    headers = {"Authorization": f"Bearer {server.api_key}"}
    long_params = SamplingParams(temperature=0.9, seed=21, max_tokens=200, ignore_eos=True)
    (ref_long,) = offline.generate(["w7 w8"], long_params, use_tqdm=False)
    (ref_short,) = offline.generate(["w9"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)

    async def run():
        async with httpx.AsyncClient(timeout=120, headers=headers) as c:

            async def long_stream():
                text = ""
                body = {
                    "model": model_name,
                    "prompt": "w7 w8",
                    "temperature": 0.9,
                    "seed": 21,
                    "max_tokens": 200,
                    "ignore_eos": True,
                    "stream": True,
                }
                async with c.stream("POST", server.url + CMPL, json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            chunk = json.loads(line[6:])
                            assert "error" not in chunk, chunk
                            text += chunk["choices"][0]["text"]
                return text

            async def bad(path, body, status, param, text):
                method, _, p = path.rpartition(" ")
                if method == "GET":
                    r = await c.get(server.url + p)
                elif isinstance(body, bytes):
                    r = await c.post(server.url + p, content=body, headers={"Content-Type": "application/json"})
                else:
                    r = await c.post(server.url + p, json=body)
                _check(r, status, param, text)

            async def good():
                r = await c.post(
                    server.url + CMPL, json={"model": model_name, "prompt": "w9", "temperature": 0, "max_tokens": 4}
                )
                assert r.status_code == 200
                return r.json()["choices"][0]["text"]

            stream = asyncio.ensure_future(long_stream())
            await asyncio.sleep(0.05)
            results = await asyncio.gather(*(bad(*case) for case in CASES * 2), *(good() for _ in range(5)))
            return await stream, results[len(CASES) * 2 :]

    long_text, goods = asyncio.run(run())
    assert long_text == ref_long.outputs[0].text
    assert goods == [ref_short.outputs[0].text] * 5
    server.wait_kv_free()
