"""A gRPC client against ``python -m cluster.serve``: Generate streams, Abort, health, status codes."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.proto import pb2, pb2_grpc
from metadata.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def channel(server):
    ch = grpc.insecure_channel(server.grpc_target)
    grpc.channel_ready_future(ch).result(timeout=30)
    yield ch
    ch.close()


@pytest.fixture(scope="module")
def stub(channel):
    return pb2_grpc.GenerationStub(channel)


@pytest.fixture(scope="module")
def md(server):
    return [("authorization", f"Bearer {server.api_key}")]


def _collect(responses):
    by_index: dict[int, dict] = {}
    usage = None
    for r in responses:
        d = by_index.setdefault(r.index, {"ids": [], "text": "", "finish": [], "n_msgs": 0})
        d["ids"] += list(r.token_ids)
        d["text"] += r.text
        d["n_msgs"] += 1
        if r.finish_reason:
            d["finish"].append(r.finish_reason)
        if r.HasField("usage"):
            assert usage is None, "usage must come once, on the last response"
            usage = r.usage
    return by_index, usage


def test_generate_stream_equals_offline(stub, md, offline):
    steer = dict(
        temperature=0.9, seed=1, max_tokens=4, allowed_token_ids=[7, 8, 9], truncate_prompt_tokens=9, bad_words=["w9"]
    )
    cases = [
        (
            pb2.GenerateRequest(
                text="w5 w6 w7", sampling=pb2.SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=8)
            ),
            "w5 w6 w7",
            SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=8),
        ),
        (
            pb2.GenerateRequest(
                token_ids=pb2.TokenIds(ids=[7, 8, 9, 10]),
                sampling=pb2.SamplingParams(temperature=1.0, seed=4, n=3, max_tokens=5, top_k=30),
            ),
            {"prompt_token_ids": [7, 8, 9, 10]},
            SamplingParams(temperature=1.0, seed=4, n=3, max_tokens=5, top_k=30),
        ),
        (
            pb2.GenerateRequest(
                text="w50", sampling=pb2.SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)
            ),
            "w50",
            SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True),
        ),
        (  # prompt logprobs and a logit bias
            pb2.GenerateRequest(
                text="w60 w61 w62",
                sampling=pb2.SamplingParams(
                    temperature=0, max_tokens=3, prompt_logprobs=1, logit_bias={7: 100.0}, ignore_eos=True
                ),
            ),
            "w60 w61 w62",
            SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1, logit_bias={7: 100.0}, ignore_eos=True),
        ),
        (  # allowed ids, bad words, and a token list past the context cut to its tail
            pb2.GenerateRequest(
                token_ids=pb2.TokenIds(ids=list(range(10, 250)) * 3), sampling=pb2.SamplingParams(**steer)
            ),
            {"prompt_token_ids": list(range(10, 250)) * 3},
            SamplingParams(**steer),
        ),
        (  # a constrained output
            pb2.GenerateRequest(
                text="w70",
                sampling=pb2.SamplingParams(
                    temperature=0.7,
                    seed=3,
                    max_tokens=4,
                    structured_outputs=pb2.StructuredOutputs(choice=["w8", "w9"], disable_any_whitespace=True),
                ),
            ),
            "w70",
            SamplingParams(
                temperature=0.7,
                seed=3,
                max_tokens=4,
                structured_outputs={"choice": ["w8", "w9"], "disable_any_whitespace": True},
            ),
        ),
    ]
    for req, prompt, params in cases:
        (ref,) = offline.generate([prompt], params, use_tqdm=False)
        responses = list(stub.Generate(req, metadata=md, timeout=60))
        assert list(responses[0].prompt_token_ids) == ref.prompt_token_ids
        got, usage = _collect(responses)
        assert sorted(got) == [o.index for o in ref.outputs]
        for o in ref.outputs:
            assert got[o.index]["ids"] == o.token_ids
            assert got[o.index]["text"] == o.text
            assert got[o.index]["finish"] == [o.finish_reason]
        assert usage.prompt_tokens == len(ref.prompt_token_ids)
        assert usage.completion_tokens == sum(len(o.token_ids) for o in ref.outputs)
        if params.prompt_logprobs is not None:
            scored = responses[0].prompt_logprobs
            assert [e.token_id for e in scored] == ref.prompt_token_ids[1:]
            want = [lp[t] for t, lp in zip(ref.prompt_token_ids[1:], ref.prompt_logprobs[1:])]
            assert [e.logprob for e in scored] == pytest.approx(want, abs=1e-5)
            assert all(not r.prompt_logprobs for r in responses[1:]) and ref.outputs[0].token_ids == [7] * 3
        if params.logprobs is not None:
            lps = [e.logprob for r in responses for e in r.logprobs]
            want = [lp[t] for t, lp in zip(ref.outputs[0].token_ids, ref.outputs[0].logprobs)]
            assert lps == pytest.approx(want, abs=1e-5)


def test_abort_mid_stream(server, stub, md):
    req = pb2.GenerateRequest(
        request_id="grpc-abort-1", text="w5", sampling=pb2.SamplingParams(unlimited_tokens=True, ignore_eos=True)
    )
    seen = []
    for r in stub.Generate(req, metadata=md, timeout=60):
        seen.append(r)
        if len(seen) == 3:
            assert stub.Abort(pb2.AbortRequest(request_id="grpc-abort-1"), metadata=md).aborted
    assert seen[-1].finish_reason == "abort"
    assert seen[-1].usage.completion_tokens == sum(len(r.token_ids) for r in seen)
    assert len(seen) < 100
    assert not stub.Abort(pb2.AbortRequest(request_id="grpc-abort-1"), metadata=md).aborted
    server.wait_kv_free()


def test_cancelled_call_frees_kv(server, stub, md):
    call = stub.Generate(
        pb2.GenerateRequest(text="w5 w6", sampling=pb2.SamplingParams(unlimited_tokens=True, ignore_eos=True, n=2)),
        metadata=md,
        timeout=60,
    )
    for i, _ in enumerate(call):
        if i == 2:
            call.cancel()
            break
    server.wait_kv_free()


def test_health_and_model_info(channel, stub, md, model_name):
    health = health_pb2_grpc.HealthStub(channel)
    for svc in ("", "syncless.v1.Generation"):
        assert health.Check(health_pb2.HealthCheckRequest(service=svc)).status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as e:
        health.Check(health_pb2.HealthCheckRequest(service="nope"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    info = stub.GetModelInfo(pb2.GetModelInfoRequest(), metadata=md)
    assert info.model_name == model_name and info.architecture == "LlamaForCausalLM"
    assert info.vocab_size == 256 and info.max_model_len == 512 and info.num_kv_blocks == 512


@pytest.mark.parametrize(
    "req,code,field",
    [
        (
            pb2.GenerateRequest(text="w5", sampling=pb2.SamplingParams(temperature=-0.5)),
            "INVALID_ARGUMENT",
            "temperature",
        ),
        (pb2.GenerateRequest(text="w5", sampling=pb2.SamplingParams(top_p=1.5)), "INVALID_ARGUMENT", "top_p"),
        (pb2.GenerateRequest(text="w5", sampling=pb2.SamplingParams(n=0)), "INVALID_ARGUMENT", "n"),
        (pb2.GenerateRequest(text="w5", sampling=pb2.SamplingParams(max_tokens=0)), "INVALID_ARGUMENT", "max_tokens"),
        (pb2.GenerateRequest(text="w5", sampling=pb2.SamplingParams(logprobs=50)), "INVALID_ARGUMENT", "logprobs"),
        (pb2.GenerateRequest(text="w5", sampling=pb2.SamplingParams(seed=-1)), "INVALID_ARGUMENT", "seed"),
        (
            pb2.GenerateRequest(text="w5", sampling=pb2.SamplingParams(allowed_token_ids=[5, 100000])),
            "INVALID_ARGUMENT",
            "allowed_token_ids",
        ),
        (
            pb2.GenerateRequest(text="w5", sampling=pb2.SamplingParams(priority=1)),
            "INVALID_ARGUMENT",
            "priority",
        ),
        (
            pb2.GenerateRequest(text="w5", sampling=pb2.SamplingParams(truncate_prompt_tokens=0)),
            "INVALID_ARGUMENT",
            "truncate_prompt_tokens",
        ),
        (
            pb2.GenerateRequest(text="w5", sampling=pb2.SamplingParams(logit_bias={5: 200.0})),
            "INVALID_ARGUMENT",
            "logit_bias",
        ),
        (
            pb2.GenerateRequest(
                text="w5", sampling=pb2.SamplingParams(structured_outputs=pb2.StructuredOutputs(regex="[0-9"))
            ),
            "INVALID_ARGUMENT",
            "structured_outputs",
        ),
        (
            pb2.GenerateRequest(text="w5", sampling=pb2.SamplingParams(prompt_logprobs=21)),
            "INVALID_ARGUMENT",
            "prompt_logprobs",
        ),
        (
            pb2.GenerateRequest(text="w5", sampling=pb2.SamplingParams(stop_token_ids=[999])),
            "INVALID_ARGUMENT",
            "stop_token_ids",
        ),
        (pb2.GenerateRequest(text=""), "INVALID_ARGUMENT", "prompt"),
        (pb2.GenerateRequest(), "INVALID_ARGUMENT", "prompt"),
        (pb2.GenerateRequest(text="w5 " * 600), "INVALID_ARGUMENT", "max_model_len"),
        (
            pb2.GenerateRequest(token_ids=pb2.TokenIds(ids=[5] * 500), sampling=pb2.SamplingParams(max_tokens=20)),
            "INVALID_ARGUMENT",
            "you requested 520 tokens (500 in the prompt, 20 in the completion)",
        ),
        (pb2.GenerateRequest(token_ids=pb2.TokenIds(ids=[5, 300])), "INVALID_ARGUMENT", "prompt_token_ids"),
        (pb2.GenerateRequest(text="w5", model="other"), "NOT_FOUND", "model"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_errors(stub, md, req, code, field):
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(req, metadata=md, timeout=30))
    assert e.value.code() == getattr(grpc.StatusCode, code)
    assert field in e.value.details()
    assert "Traceback" not in e.value.details()


def test_api_key(stub):
    req = pb2.GenerateRequest(text="w5", sampling=pb2.SamplingParams(max_tokens=2))
    for md, msg in ((None, "missing API key"), ([("authorization", "Bearer wrong")], "invalid API key")):
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(req, metadata=md, timeout=30))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and msg in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            stub.GetModelInfo(pb2.GetModelInfoRequest(), metadata=md)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
