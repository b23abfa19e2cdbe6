"""No client input can hurt the server (issue 35): a table-driven fuzz of every request field and
of malformed bodies, over HTTP and gRPC, against the shared test server.

Every hostile request must get a 4xx JSON error (gRPC: INVALID_ARGUMENT, or NOT_FOUND for an
unknown model) that names the field, with no traceback or file path, and the server must stay
healthy: /health 200 after each case, and at the end the reference request gives the same
tokens as before the fuzz and no KV block is held.
"""

from __future__ import annotations

import gzip
import json
import typing

import grpc
import httpx
import msgspec
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.openai_protocol import ChatCompletionRequest, CompletionRequest
from cluster.proto import pb2, pb2_grpc


CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "w5 w6"}]
BASE = {CMPL: {"prompt": "w5 w6", "max_tokens": 2}, CHAT: {"messages": MSG, "max_tokens": 2}}
REF = {"prompt": [5, 9, 17, 33], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
BIG = 1 << 63  # the number that used to kill the worker (top_k) and every int64 edge around it
DEEP = 10_000


def _deep(n: int = DEEP) -> typing.Any:
    v: typing.Any = 1
    for _ in range(n):
        v = [v]
    return v


def _strip_optional(t):
    args = [a for a in typing.get_args(t) if a is not type(None)]
    return (
        args[0]
        if typing.get_origin(t) in (typing.Union, getattr(__import__("types"), "UnionType", None)) and len(args) == 1
        else t
    )


def _hostile_values(typ) -> list:
    """Values that no field of this type accepts (wrong JSON type, int64 edges, huge magnitudes)."""
    t = _strip_optional(typ)
    wrong_type = {"a": {"b": [1]}}
    if t is bool:
        return ["yes", 2, wrong_type]
    if t is int:
        return [BIG, -BIG - 1, 1 << 64, 10**30, "x", 1.5, wrong_type]
    if t is float:
        return [1e308, -1e308, "hot", [1.0], wrong_type]
    if t is str:
        return [5, ["x"], wrong_type]
    if t is typing.Any:
        return [_deep(), wrong_type]
    return [5, True, _deep()]  # lists, dicts, unions


# Field-specific hostile values on top of the generic ones (valid JSON types, invalid values).
SPECIFIC = {
    "model": ["m" * 1_000_000],
    "request_id": ["a\u0001", "x" * 300, "", "\u00e9t\u00e9"],
    "cache_salt": ["s" * 2000, ""],
    "stop": [["x"] * 100, [""], [1]],
    "stop_token_ids": [[BIG], [-1], [999], list(range(2000))],
    "logit_bias": [{"x": 1.0}, {"5": 101}, {"999": 1.0}, {"9" * 5000: 1.0}, {str(i): 1 for i in range(2000)}],
    "suffix": ["tail"],
    "best_of": [3],
    "n": [0, 129],
    "top_k": [-2, 1 << 31],
    "min_tokens": [1 << 31, -1],
    "max_tokens": [0, 1 << 31, 600],
    "max_completion_tokens": [0, 1 << 31],
    "temperature": [-0.1, 1e-30, 1e5],
    "repetition_penalty": [0.0, 1e-9, 1e9],
    "stream_options": [{"include_usage": True}, {"include_usage": "x"}, {"other": 1}],
    "logprobs": [21, -1],
    "top_logprobs": [21, -1],
    "chat_template_kwargs": [{"chat_template": "{{ 'a' * 30000000 }}"}, {"x": _deep()}],
    "chat_template": ["{{ 'a' * 30000000 }}"],
    "tools": [[{"type": "function"}]],
    "response_format": [
        {"type": "xml"},
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"schema": 5}},
    ],
    "structured_outputs": [{"regex": "[0-9"}, {"choice": []}, {"regex": "a", "choice": ["b"]}, {"json": {"type": "x"}}],
    "tool_choice": [_deep()],
    "prompt": ["", [], [5, 999], [[5], []], "w5 " * 20_000],
    "messages": [
        [],
        [{"role": "", "content": "x"}],
        [{"role": "user", "content": [{"type": "image_url"}]}],
        [{"role": "user", "content": "w5 " * 20_000}],
        [{"role": "user", "content": _deep()}],
    ],
    "echo": [],
    "stream": [],
    "user": [],
    "add_generation_prompt": [],
}
# Fields whose valid JSON types make every generic value wrong except these (None: no generic values).
NO_GENERIC = {"prompt", "tool_choice"}


def _cases():
    cases = []
    for path, typ in ((CMPL, CompletionRequest), (CHAT, ChatCompletionRequest)):
        for f in msgspec.structs.fields(typ):
            values = [] if f.name in NO_GENERIC else _hostile_values(f.type)
            values += SPECIFIC.get(f.name, [])
            if f.name == "logprobs" and path == CHAT:
                values = ["yes", 2]
            for i, v in enumerate(values):
                body = dict(BASE[path])
                body[f.name] = v
                if f.name == "stream_options" and isinstance(v, dict) and v == {"include_usage": True}:
                    body["stream"] = False  # OpenAI: stream_options needs stream=true
                if f.name == "top_logprobs" and path == CHAT:
                    body["logprobs"] = True
                cases.append(pytest.param(path, f.name, body, id=f"{'chat' if path == CHAT else 'cmpl'}-{f.name}-{i}"))
    return cases


def _assert_clean_error(resp: httpx.Response, field: str | None) -> dict:
    assert 400 <= resp.status_code < 500, (resp.status_code, resp.text[:500])
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    text = resp.text
    assert "Traceback" not in text and ".py" not in text and "/work/" not in text, text[:500]
    assert len(err["message"]) <= 1200, "the error message echoes the input"
    if field is not None:
        assert err["param"] == field or field in err["message"], err
    return err


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {server.api_key}"}) as c:
        yield c


@pytest.fixture(scope="module")
def reference(server, client):
    r = client.post(server.url + CMPL, json=REF)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _healthy(server, client) -> None:
    assert client.get(server.url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("path,field,body", _cases())
def test_every_field(server, client, reference, path, field, body):
    resp = client.post(server.url + path, content=_dumps_deep(body), headers={"Content-Type": "application/json"})
    deep = _is_deep(body[field])
    expect_field = None if field in ("messages", "chat_template") or deep else field
    guided = field.startswith("guided_") and not deep  # (vLLM's older names: compile errors name the current one)
    err = _assert_clean_error(resp, None if guided else expect_field)  # (messages errors name the part)
    if guided:
        assert err["param"] in (field, "structured_outputs"), err
    if deep:
        assert "nested too deeply" in err["message"] or field in err["message"] or err["param"] == field, err
    if field == "model" and resp.status_code == 404:
        assert err["param"] == "model"
    _healthy(server, client)


def _dumps_deep(obj) -> bytes:
    """json.dumps without Python's own recursion limit (for the 10,000-deep values)."""
    if isinstance(obj, list) and obj and isinstance(obj[0], list) and _depth(obj) > 100:
        d = _depth(obj)
        return b"[" * (d - 1) + b"1" + b"]" * (d - 1)
    if isinstance(obj, dict):
        return b"{" + b",".join(json.dumps(k).encode() + b":" + _dumps_deep(v) for k, v in obj.items()) + b"}"
    if isinstance(obj, list):
        return b"[" + b",".join(_dumps_deep(v) for v in obj) + b"]"
    return json.dumps(obj).encode()


def _is_deep(obj) -> bool:
    if isinstance(obj, dict):
        return any(_is_deep(v) for v in obj.values())
    if isinstance(obj, list):
        return _depth(obj) > 100 or any(_is_deep(v) for v in obj[:3])
    return False


def _depth(obj) -> int:
    d = 1
    while isinstance(obj, list) and obj:
        obj, d = obj[0], d + 1
    return d


MALFORMED = [
    (CMPL, b"", {}, "empty"),
    (CMPL, b"{not json", {}, "not valid JSON"),
    (CMPL, b'{"prompt": "w5"', {}, "not valid JSON"),
    (CMPL, b"[1, 2]", {}, "object"),
    (CMPL, b'"just a string"', {}, "object"),
    (CMPL, b'{"prompt": "\xff\xfe"}', {}, None),
    (CMPL, b'{"prompt": "w5", "temperature": 1e999}', {}, "temperature"),
    (CMPL, b'{"prompt": ' + b"[" * DEEP + b"]" * DEEP + b"}", {}, "nested too deeply"),
    (CHAT, b'{"messages": [], "tool_choice": ' + b"[" * DEEP + b"]" * DEEP + b"}", {}, "nested too deeply"),
    (
        CHAT,
        b'{"messages": [], "chat_template_kwargs": {"a": ' + b"[" * DEEP + b"]" * DEEP + b"}}",
        {},
        "nested too deeply",
    ),
    (CMPL, b"not gzip at all", {"Content-Encoding": "gzip"}, "cannot read the request body"),
    (CMPL, gzip.compress(b'{"prompt": "w5"')[:-4], {"Content-Encoding": "gzip"}, None),
    (CMPL, b'{"prompt": "w5", "stream": true, "request_id": "a\\u0001"}', {}, "request_id"),
    (CMPL, b'{"prompt": "w5", "stream_options": {"include_usage": true}}', {}, "stream_options"),
]


@pytest.mark.parametrize("path,body,headers,text", MALFORMED)
def test_malformed_bodies(server, client, reference, path, body, headers, text):
    resp = client.post(server.url + path, content=body, headers={"Content-Type": "application/json", **headers})
    err = _assert_clean_error(resp, None)
    if text is not None:
        assert text in err["message"], err
    _healthy(server, client)


def test_gzip_body_is_read(server, client, reference):
    resp = client.post(
        server.url + CMPL,
        content=gzip.compress(json.dumps(REF).encode()),
        headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
    )
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == reference


def test_return_tokens_as_token_ids(server, client):
    body = {**REF, "logprobs": 3, "return_tokens_as_token_ids": True}
    lp = client.post(server.url + CMPL, json=body).json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 6 and all(t.startswith("token_id:") for t in lp["tokens"])
    assert [t for t in lp["tokens"]] == [f"token_id:{int(t.split(':')[1])}" for t in lp["tokens"]]
    assert all(len(top) == 3 or len(top) == 4 for top in lp["top_logprobs"])  # ids never collide
    assert all(k.startswith("token_id:") for top in lp["top_logprobs"] for k in top)
    chat = client.post(
        server.url + CHAT,
        json={
            "messages": MSG,
            "max_tokens": 3,
            "logprobs": True,
            "top_logprobs": 2,
            "return_tokens_as_token_ids": True,
        },
    ).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert content and all(c["token"].startswith("token_id:") for c in content)


def test_tokenize_detokenize_version(server, client):
    r = client.post(server.url + "/tokenize", json={"prompt": "w5 w6"}).json()
    assert r["count"] == len(r["tokens"]) >= 2 and r["max_model_len"] == 512
    back = client.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert "w5 w6" in back["prompt"]
    assert client.get(server.url + "/version").json()["version"]
    _assert_clean_error(client.post(server.url + "/detokenize", json={"tokens": [BIG]}), "tokens")
    _assert_clean_error(client.post(server.url + "/tokenize", json={"prompt": "w5 " * 20_000}), "prompt")


def test_50mb_body_is_refused_without_stalling_streams(server, client):
    """A 50 MB prompt (completions) and a 50 MB message (chat) are refused by their size, before
    any tokenizing; meanwhile a streaming request keeps getting tokens and /health answers."""
    import threading
    import time

    arrivals: list[float] = []
    started = threading.Event()

    def stream() -> None:
        body = {"prompt": [5, 9], "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
        with client.stream("POST", server.url + CMPL, json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic())
                    started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60)
    huge = "w5 " * (50_000_000 // 3)
    latencies = {}
    with httpx.Client(timeout=60, headers=client.headers) as other:
        for path, body in ((CMPL, {"prompt": huge}), (CHAT, {"messages": [{"role": "user", "content": huge}]})):
            data = json.dumps(body).encode()
            t0 = time.monotonic()
            r = other.post(server.url + path, content=data, headers={"Content-Type": "application/json"})
            latencies[path] = time.monotonic() - t0
            err = _assert_clean_error(r, "prompt" if path == CMPL else "messages")
            assert "characters" in err["message"], err
            t0 = time.monotonic()
            assert other.get(server.url + "/health").status_code == 200
            latencies["health"] = max(latencies.get("health", 0.0), time.monotonic() - t0)
    t.join(120)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert len(arrivals) >= 300 and max(gaps) < 1.5, f"the stream stalled for {max(gaps):.2f} s"
    assert latencies[CMPL] < 10 and latencies[CHAT] < 10 and latencies["health"] < 1.5, latencies


# ------------------------------------------------------------------ gRPC
INT_FIELDS = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs")
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def _grpc_cases():
    cases = []
    for name in INT_FIELDS:
        for v in ((1 << 63) - 1, -(1 << 63), -1):
            if (name, v) in (("seed", (1 << 63) - 1), ("top_k", -1)):
                continue  # a valid seed; top_k -1 turns top-k off
            cases.append(
                pytest.param(
                    pb2.GenerateRequest(text="w5", sampling=pb2.SamplingParams(**{name: v})), name, id=f"{name}={v}"
                )
            )
    for name in FLOAT_FIELDS:
        for v in (float("nan"), float("inf"), -3.4e38):
            cases.append(
                pytest.param(
                    pb2.GenerateRequest(text="w5", sampling=pb2.SamplingParams(**{name: v})), name, id=f"{name}={v}"
                )
            )
    cases += [
        pytest.param(
            pb2.GenerateRequest(text="w5", sampling=pb2.SamplingParams(stop_token_ids=[(1 << 63) - 1])),
            "stop_token_ids",
            id="stop_token_ids-big",
        ),
        pytest.param(
            pb2.GenerateRequest(text="w5", sampling=pb2.SamplingParams(stop=["x"] * 100)), "stop", id="stop-many"
        ),
        pytest.param(pb2.GenerateRequest(text="w5", request_id="a\u0001"), "request_id", id="request_id-ctrl"),
        pytest.param(pb2.GenerateRequest(text="w5 " * 20_000), "prompt", id="text-huge"),
        pytest.param(
            pb2.GenerateRequest(token_ids=pb2.TokenIds(ids=[(1 << 63) - 1])), "prompt_token_ids", id="token-big"
        ),
        pytest.param(pb2.GenerateRequest(token_ids=pb2.TokenIds(ids=[5] * 100_000)), "prompt", id="tokens-many"),
        pytest.param(pb2.GenerateRequest(text="w5", model="m" * 100_000), "model", id="model-huge"),
    ]
    return cases


@pytest.fixture(scope="module")
def grpc_channel(server):
    ch = grpc.insecure_channel(server.grpc_target)
    grpc.channel_ready_future(ch).result(timeout=30)
    yield ch
    ch.close()


@pytest.mark.parametrize("req,field", _grpc_cases())
def test_grpc_every_field(server, grpc_channel, req, field):
    md = [("authorization", f"Bearer {server.api_key}")]
    with pytest.raises(grpc.RpcError) as e:
        list(pb2_grpc.GenerationStub(grpc_channel).Generate(req, metadata=md, timeout=30))
    code, details = e.value.code(), e.value.details()
    assert code == (grpc.StatusCode.NOT_FOUND if field == "model" else grpc.StatusCode.INVALID_ARGUMENT), details
    assert field in details and "Traceback" not in details and ".py" not in details and len(details) < 1200
    health = health_pb2_grpc.HealthStub(grpc_channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize(
    "method,body",
    [
        ("Generate", b"\xff\xff\xff\xff"),  # not protobuf
        ("Generate", b"\x12\x80\x80\x80\x80\x10"),  # a length past the end
        ("Generate", b"\x1a\x05\x08"),  # token_ids cut short
        ("Abort", b"\x0a\xff"),
        ("GetModelInfo", b"\x08"),
    ],
)
def test_grpc_malformed_bodies(server, grpc_channel, method, body):
    md = [("authorization", f"Bearer {server.api_key}")]
    path = f"/syncless.v1.Generation/{method}"
    ident = lambda b: b  # noqa: E731 - raw bytes both ways
    call = (
        grpc_channel.unary_stream(path, request_serializer=ident, response_deserializer=ident)
        if method == "Generate"
        else grpc_channel.unary_unary(path, request_serializer=ident, response_deserializer=ident)
    )
    with pytest.raises(grpc.RpcError) as e:
        out = call(body, metadata=md, timeout=30)
        list(out) if method == "Generate" else out
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert "not a valid syncless.v1." in e.value.details()
    health = health_pb2_grpc.HealthStub(grpc_channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_still_serving_after_the_fuzz(server, client, reference):
    """Runs last in this module: the engine was not disturbed by anything above."""
    r = client.post(server.url + CMPL, json=REF)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference
    server.wait_kv_free()
    assert "internal error" not in server.log(), "a request hit an unexpected error (500)"
    log = server.log()
    assert "finished request" in log and "Avg generation throughput" in log, "no request or stats log lines"
