"""200 concurrent streaming requests (HTTP and gRPC) lose and duplicate no token; aborted
and disconnected requests leave no KV block allocated."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import openai

from cluster.proto import pb2, pb2_grpc
from metadata.sampling_params import SamplingParams


N_HTTP, N_GRPC, MAX_TOKENS = 100, 100, 4


def _prompt(k: int) -> list[int]:
    return [3 + (k * 7) % 250, 3 + (k * 13) % 250, 3 + k % 250]


def _params(k: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.95, seed=1000 + k, max_tokens=MAX_TOKENS, ignore_eos=True)


def test_200_concurrent_streams(server, offline, model_name):
    n = N_HTTP + N_GRPC
    refs = offline.generate(
        [{"prompt_token_ids": _prompt(k)} for k in range(n)], [_params(k) for k in range(n)], use_tqdm=False
    )
    md = [("authorization", f"Bearer {server.api_key}")]

    async def run():
        client = openai.AsyncOpenAI(
            base_url=server.url + "/v1",
            api_key=server.api_key,
            max_retries=0,
            timeout=120,
            http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=200), timeout=120),
        )
        channel = grpc.aio.insecure_channel(server.grpc_target)
        stub = pb2_grpc.GenerationStub(channel)

        async def http(k):
            stream = await client.completions.create(
                model=model_name,
                prompt=_prompt(k),
                temperature=0.8,
                top_p=0.95,
                seed=1000 + k,
                max_tokens=MAX_TOKENS,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            pieces, finish, usage = [], [], None
            async for chunk in stream:
                if chunk.usage:
                    usage = chunk.usage.completion_tokens
                for c in chunk.choices:
                    pieces.append(c.text)
                    if c.finish_reason:
                        finish.append(c.finish_reason)
            return {"pieces": pieces, "finish": finish, "usage": usage}

        async def rpc(k):
            sp = pb2.SamplingParams(temperature=0.8, top_p=0.95, seed=1000 + k, max_tokens=MAX_TOKENS, ignore_eos=True)
            req = pb2.GenerateRequest(token_ids=pb2.TokenIds(ids=_prompt(k)), sampling=sp)
            ids, text, finish, usage = [], "", [], None
            async for r in stub.Generate(req, metadata=md, timeout=120):
                ids += list(r.token_ids)
                text += r.text
                if r.finish_reason:
                    finish.append(r.finish_reason)
                if r.HasField("usage"):
                    usage = r.usage.completion_tokens
            return {"ids": ids, "text": text, "finish": finish, "usage": usage}

        try:
            jobs = [http(k) for k in range(N_HTTP)] + [rpc(k) for k in range(N_HTTP, n)]
            return await asyncio.gather(*jobs)
        finally:
            await client.close()
            await channel.close()

    results = asyncio.run(run())
    for k, (got, ref) in enumerate(zip(results, refs)):
        o = ref.outputs[0]
        assert len(o.token_ids) == MAX_TOKENS
        assert got["finish"] == ["length"] and got["usage"] == MAX_TOKENS, k
        if k < N_HTTP:
            # one chunk per token, each with its word: nothing lost, nothing repeated
            assert len(got["pieces"]) == MAX_TOKENS, (k, got)
            assert "".join(got["pieces"]) == o.text, k
        else:
            assert got["ids"] == o.token_ids, k
            assert got["text"] == o.text, k
    server.wait_kv_free()
    metrics = httpx.get(server.url + "/metrics").text
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("syncless:") and "{" in line
    }
    assert values["syncless:time_to_first_token_seconds_count"] >= n
    assert values["syncless:inter_token_latency_seconds_count"] >= n * (MAX_TOKENS - 1)
    assert values["syncless:generation_tokens_total"] >= n * MAX_TOKENS
    assert values["syncless:num_requests_running"] == 0 and values["syncless:kv_cache_usage_perc"] == 0


def test_aborts_and_disconnects_free_every_block(server, model_name):
    md = [("authorization", f"Bearer {server.api_key}")]
    headers = {"Authorization": f"Bearer {server.api_key}"}
    long = {"model": model_name, "prompt": "w5 w6 w7", "max_tokens": 400, "ignore_eos": True, "stream": True}

    async def run():
        channel = grpc.aio.insecure_channel(server.grpc_target)
        stub = pb2_grpc.GenerationStub(channel)
        async with httpx.AsyncClient(timeout=120, headers=headers, limits=httpx.Limits(max_connections=100)) as c:

            async def http_disconnect(k):
                async with c.stream("POST", server.url + "/v1/completions", json=dict(long, seed=k, n=1 + k % 3)) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            break  # leave after the first chunk: the connection closes

            async def grpc_cancel(k):
                call = stub.Generate(
                    pb2.GenerateRequest(
                        text="w9 w10",
                        sampling=pb2.SamplingParams(unlimited_tokens=True, ignore_eos=True, n=1 + k % 2, seed=k),
                    ),
                    metadata=md,
                    timeout=120,
                )
                async for _ in call:
                    call.cancel()
                    break

            async def grpc_abort(k):
                rid = f"load-abort-{k}"
                req = pb2.GenerateRequest(
                    request_id=rid, text="w11", sampling=pb2.SamplingParams(unlimited_tokens=True, ignore_eos=True)
                )
                last = None
                async for r in stub.Generate(req, metadata=md, timeout=120):
                    if last is None:
                        assert (await stub.Abort(pb2.AbortRequest(request_id=rid), metadata=md)).aborted
                    last = r
                assert last.finish_reason == "abort"

            async def waiting_then_gone(k):
                # a non-streaming request cancelled by its client, possibly while still waiting
                task = asyncio.ensure_future(
                    c.post(server.url + "/v1/completions", json=dict(long, stream=False, seed=k))
                )
                await asyncio.sleep(0.05 * (k % 4))
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass

            jobs = (
                [http_disconnect(k) for k in range(20)]
                + [grpc_cancel(k) for k in range(15)]
                + [grpc_abort(k) for k in range(10)]
                + [waiting_then_gone(k) for k in range(15)]
            )
            await asyncio.gather(*jobs)
        await channel.close()

    asyncio.run(run())
    state = server.wait_kv_free()
    assert state["num_free_blocks"] == state["num_blocks"] == 512
    # and the server still serves
    r = httpx.post(
        server.url + "/v1/completions", headers=headers, json={"model": model_name, "prompt": "w5", "max_tokens": 3}
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
