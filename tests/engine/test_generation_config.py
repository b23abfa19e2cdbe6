"""A checkpoint's ``generation_config.json`` (``cluster.generation_config``): its EOS ids stop
generation, its sampling values are the defaults of what a request leaves out (offline, HTTP,
gRPC), 'vllm' ignores it, and a broken file fails start-up naming itself."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from cluster.generation_config import GenerationDefaults, load_generation_defaults
from metadata.config import EngineConfig
from workers.models.arch import ModelLoadError

PROMPT = [5, 9, 13, 17, 21, 25]


def _with_generation_config(src, dst, **fields):
    shutil.copytree(src, dst)
    (dst / "generation_config.json").write_text(json.dumps(fields))
    return dst


def _load(path, choice="auto"):
    return load_generation_defaults(EngineConfig.from_options(model=str(path), generation_config=choice), str(path))


def test_the_file_names_stop_tokens_and_request_defaults(tmp_path, ckpt_dir):
    d = _with_generation_config(
        ckpt_dir(),
        tmp_path / "m",
        eos_token_id=[7, 1, 7],
        temperature=0,
        top_p=0.9,
        top_k=20,
        max_new_tokens=5,
        do_sample=True,
        bos_token_id=0,
    )
    g = _load(d)
    assert g.eos_token_ids == (7, 1) and g.source == str(d / "generation_config.json")
    assert g.sampling == {"temperature": 0.0, "top_p": 0.9, "top_k": 20, "max_tokens": 5}
    assert isinstance(g.sampling["temperature"], float)  # (an int where a float goes: converted)
    p = g.params(top_k=3, seed=1)  # what a request sets wins; the rest are the file's
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.seed) == (0.0, 0.9, 3, 5, 1)
    vllm = _load(d, "vllm")  # the stop tokens still, not the sampling values
    assert vllm.eos_token_ids == (7, 1) and vllm.sampling == {} and vllm.params().temperature == 1.0
    other = _with_generation_config(ckpt_dir(), tmp_path / "other", eos_token_id=3)
    assert _load(d, str(other)).eos_token_ids == (3,)  # a directory named instead
    plain = _load(ckpt_dir())  # transformers' save_pretrained writes one: the config's EOS, no sampling
    assert plain.eos_token_ids == (1,) and plain.sampling == {}
    (d / "generation_config.json").unlink()
    assert _load(d) == GenerationDefaults()  # a checkpoint without one


@pytest.mark.parametrize(
    "content, says",
    [
        ("{", "not a readable JSON file"),
        ("[1]", "expected a JSON object"),
        ('{"eos_token_id": "x"}', "eos_token_id must be a token id"),
        ('{"temperature": -1}', "temperature must be"),
        ('{"top_p": "high"}', "Expected `float`"),
    ],
)
def test_a_broken_file_fails_naming_itself(tmp_path, ckpt_dir, content, says):
    d = _with_generation_config(ckpt_dir(), tmp_path / "m")
    (d / "generation_config.json").write_text(content)
    with pytest.raises(ModelLoadError, match=says) as e:
        _load(d)
    assert "generation_config.json" in str(e.value)


def test_a_directory_without_the_file_is_refused(tmp_path, ckpt_dir):
    with pytest.raises(ModelLoadError, match="no generation_config.json there"):
        _load(ckpt_dir(), str(tmp_path))


def test_api_requests_take_the_defaults_for_what_they_omit():
    import msgspec

    from cluster.grpc_api import sampling_from_proto
    from cluster.openai_protocol import ChatCompletionRequest, CompletionRequest, chat_params, completion_params
    from cluster.proto import pb2

    g = GenerationDefaults((), {"temperature": 0.6, "top_k": 20, "max_tokens": 7})
    chat = msgspec.convert({"messages": [{"role": "user", "content": "hi"}], "top_k": 5}, ChatCompletionRequest)
    p = chat_params(chat, defaults=g)
    assert (p.temperature, p.top_k, p.max_tokens) == (0.6, 5, 7)
    assert chat_params(chat).temperature == 1.0 and chat_params(chat).max_tokens is None  # no file
    cmpl = msgspec.convert({"prompt": "hi", "temperature": 0, "max_tokens": 3}, CompletionRequest)
    p = completion_params(cmpl, defaults=g)
    assert (p.temperature, p.top_k, p.max_tokens) == (0.0, 20, 3)
    bare = msgspec.convert({"prompt": "hi"}, CompletionRequest)
    assert completion_params(bare, defaults=g).max_tokens == 16  # (OpenAI's default; vLLM keeps it)
    p = sampling_from_proto(pb2.SamplingParams(top_p=0.5), g)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.6, 0.5, 20, 7)


def _greedy_stop(ckpt):
    """transformers' greedy continuation of ``PROMPT`` and a token of it to stop at (index >= 2,
    not earlier in the continuation)."""
    from tests.checkpoints import hf_greedy

    ref = hf_greedy(ckpt, [PROMPT], 12)[0]
    i = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i] and ref[i] != 1)
    return ref, i


def test_offline_generation_stops_at_its_eos_and_defaults_to_its_sampling(ray_local, tmp_path, ckpt_dir):
    from cluster import LLM, SamplingParams

    ref, i = _greedy_stop(ckpt_dir())
    d = _with_generation_config(ckpt_dir(), tmp_path / "m", eos_token_id=ref[i], temperature=0.0, max_new_tokens=12)
    llm = LLM(model=str(d), max_model_len=64, num_kv_blocks=32)
    try:
        assert llm.get_default_sampling_params().temperature == 0.0
        out = llm.generate([{"prompt_token_ids": PROMPT}], use_tqdm=False)[0].outputs[0]
        assert out.token_ids == ref[: i + 1] and out.finish_reason == "stop"  # greedy, stopped there
        assert out.stop_reason == ref[i]  # named, as vLLM names the generation config's EOS ids
        engine = llm.engine  # below LLM: a request without params takes the file's defaults too
        engine.add_request("bare", {"prompt_token_ids": PROMPT})
        while engine.has_unfinished():
            engine.step()
        assert engine.output("bare").outputs[0].token_ids == ref[: i + 1]
        engine.release("bare")
        explicit = SamplingParams(temperature=0, max_tokens=12)  # the stop tokens hold for any params
        assert (
            llm.generate([{"prompt_token_ids": PROMPT}], explicit, use_tqdm=False)[0].outputs[0].token_ids
            == ref[: i + 1]
        )
        unstopped = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)  # (as the model's own EOS)
        assert llm.generate([{"prompt_token_ids": PROMPT}], unstopped, use_tqdm=False)[0].outputs[0].token_ids == ref
    finally:
        llm.shutdown()
    # 'vllm': the file's stop tokens still, the engine's own sampling defaults
    from cluster.model_source import resolve_model

    source = resolve_model(EngineConfig.from_options(model=str(d), generation_config="vllm"))
    assert source.generation.eos_token_ids == (ref[i],) and source.generation.params() == SamplingParams()


def test_the_http_api_fills_omitted_fields_from_the_file(ray_local, tmp_path, ckpt_dir):
    from aiohttp.test_utils import TestClient, TestServer

    from cluster.async_engine import AsyncEngine
    from cluster.http_api import OpenAIServer

    ref, i = _greedy_stop(ckpt_dir())
    d = _with_generation_config(ckpt_dir(), tmp_path / "m", eos_token_id=ref[i], temperature=0, max_new_tokens=12)
    cfg = EngineConfig.from_options(model=str(d), max_model_len=64, num_kv_blocks=32)

    async def main():
        eng = AsyncEngine(cfg)
        await eng.start()
        try:
            generation = load_generation_defaults(cfg, str(d))
            async with TestClient(TestServer(OpenAIServer(eng, "m", generation=generation).app())) as c:
                body = {"model": "m", "prompt": PROMPT}  # no temperature, no max_tokens
                return await (await c.post("/v1/completions", json=body)).json()
        finally:
            await eng.shutdown()

    r = asyncio.run(main())
    choice = r["choices"][0]
    assert r["usage"]["completion_tokens"] == i + 1 and choice["finish_reason"] == "stop", r
