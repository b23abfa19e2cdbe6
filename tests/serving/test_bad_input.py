"""Bad input gets a clear error naming what is wrong, and does not disturb the engine.

"Does not disturb": a shared engine serves a reference request before the bad
calls, and after each of them it serves it again with the same result (which is
also transformers' own greedy continuation), with no blocks or requests left over.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest

from cluster import LLM, SamplingParams
from cluster.input_processor import InvalidRequestError
from metadata.config import ConfigError
from metadata.sampling_params import SamplingParamsError
from tests.checkpoints import hf_greedy
from workers.models.arch import SUPPORTED_ARCHITECTURES, ModelLoadError

MAX_MODEL_LEN = 64
BLOCK = 8
NUM_BLOCKS = 24  # 192 slots: plenty for max_model_len 64
REF_PROMPT = [random.Random(5).randrange(3, 256) for _ in range(11)]
REF_PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def model(ckpt_dir):
    return ckpt_dir("llama")


@pytest.fixture(scope="module")
def llm(ray_local, model):
    engine = LLM(model=str(model), block_size=BLOCK, num_kv_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def reference(llm, model):
    expected = hf_greedy(model, [REF_PROMPT], 10)[0]
    got = llm.generate([{"prompt_token_ids": REF_PROMPT}], REF_PARAMS)[0].outputs[0].token_ids
    assert got == expected
    return got


def assert_undisturbed(llm, reference):
    eng = llm.engine
    assert not eng.has_unfinished() and not eng.groups, "the bad call left requests behind"
    eng.scheduler.blocks.check_all_free()
    out = llm.generate([{"prompt_token_ids": REF_PROMPT}], REF_PARAMS)[0].outputs[0]
    assert out.token_ids == reference
    assert not eng.dead


BAD_PROMPTS = [
    ("", "prompt", "empty"),
    ([], "prompt_token_ids", "empty"),
    ({"prompt_token_ids": []}, "prompt_token_ids", "empty"),
    ({"prompt": ""}, "prompt", "empty"),
    ("   ", "prompt", "no tokens"),  # the word-level tokenizer yields nothing for whitespace
    ([5] * MAX_MODEL_LEN, "prompt", "max_model_len"),
    ([5] * (MAX_MODEL_LEN + 40), "prompt", "max_model_len"),
    (" ".join(["w5"] * (MAX_MODEL_LEN + 1)), "prompt", "max_model_len"),
    ([3, 256], "prompt_token_ids", "vocabulary"),
    ([3, -1], "prompt_token_ids", "vocabulary"),
    ([3, True], "prompt_token_ids", "integers"),
    ([3, 4.0], "prompt_token_ids", "integers"),
    (5, "prompt", "a prompt must be"),
    (None, "prompt", "a prompt must be"),
    ({"prompt_token_ids": [3], "extra": 1}, "prompt", "unknown prompt keys"),
]


@pytest.mark.parametrize("prompt,field,words", BAD_PROMPTS, ids=[f"{i}-{w}" for i, (_, _, w) in enumerate(BAD_PROMPTS)])
def test_bad_prompt(llm, reference, prompt, field, words):
    with pytest.raises(InvalidRequestError, match=words) as info:
        llm.engine.add_request("bad", prompt, REF_PARAMS)
    assert info.value.field == field
    with pytest.raises(InvalidRequestError, match=words):
        llm.generate([{"prompt_token_ids": REF_PROMPT}, prompt], REF_PARAMS)
    assert_undisturbed(llm, reference)


def test_longest_prompt_that_fits(llm):
    out = llm.generate([[5] * (MAX_MODEL_LEN - 1)], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    c = out[0].outputs[0]
    assert len(c.token_ids) == 1 and c.finish_reason == "length"


@pytest.mark.parametrize(
    "prompt_len,max_tokens,capacity,words",
    [
        (
            MAX_MODEL_LEN - 5,
            6,
            None,
            f"maximum context length is {MAX_MODEL_LEN} tokens. However, you "
            f"requested {MAX_MODEL_LEN + 1} tokens ({MAX_MODEL_LEN - 5} in the prompt, 6 in the completion)",
        ),
        (1, MAX_MODEL_LEN, None, f"at most {MAX_MODEL_LEN - 1} here"),
        (30, 20, 40, "KV cache holds only 40 tokens"),
    ],
)
def test_server_max_tokens_past_the_context_is_refused(llm, prompt_len, max_tokens, capacity, words):
    """A length the client set past the context (``strict_field``, the servers' API fields) is
    refused with OpenAI's wording; one that fits exactly, or the same request offline, is cut."""
    inputs = llm.engine.inputs
    params = SamplingParams(max_tokens=max_tokens)
    prompt = [5] * prompt_len
    with pytest.raises(InvalidRequestError, match=words.replace("(", r"\(").replace(")", r"\)")) as info:
        inputs.make_requests("r", prompt, params, capacity, strict_field="max_completion_tokens")
    assert info.value.field == "max_completion_tokens"
    room = min(MAX_MODEL_LEN, capacity or MAX_MODEL_LEN) - prompt_len
    (cut,) = inputs.make_requests("r", prompt, params, capacity)  # offline: cut to the room
    assert cut.max_tokens == room
    (fits,) = inputs.make_requests("r", prompt, SamplingParams(max_tokens=room), capacity, strict_field="max_tokens")
    assert fits.max_tokens == room
    (default,) = inputs.make_requests("r", prompt, SamplingParams(max_tokens=None), capacity, strict_field="max_tokens")
    assert default.max_tokens == room


BAD_PARAMS = [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(max_tokens=2.5), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature="0.5"), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(top_p=-0.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(n=0), "n"),
    (dict(seed=-1), "seed"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens"),
    (dict(logprobs=21), "logprobs"),
    (dict(prompt_logprobs=21), "prompt_logprobs"),
    (dict(logit_bias={5: 100.5}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias=[5]), "logit_bias"),
    (dict(stop=[""]), "stop"),
    (dict(stop=5), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(ignore_eos="yes"), "ignore_eos"),
]


@pytest.mark.parametrize("kw,name", BAD_PARAMS, ids=[f"{n}={list(k.values())[0]!r}" for k, n in BAD_PARAMS])
def test_bad_sampling_params(llm, reference, kw, name):
    with pytest.raises(SamplingParamsError, match=rf"^{name} must be"):
        SamplingParams(**kw)
    # params changed after construction are validated again by the engine
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for k, v in kw.items():
        setattr(sp, k, v)
    if "max_tokens" not in kw and "min_tokens" in kw:
        sp.max_tokens = 4
    with pytest.raises(InvalidRequestError, match=name) as info:
        llm.engine.add_request("bad", {"prompt_token_ids": REF_PROMPT}, sp)
    assert info.value.field == name
    assert_undisturbed(llm, reference)


def test_unknown_sampling_option():
    with pytest.raises(TypeError, match="best_of_typo"):
        SamplingParams(best_of_typo=2)


def test_other_bad_requests(llm, reference):
    eng = llm.engine
    with pytest.raises(InvalidRequestError, match="stop token id 300"):
        eng.add_request("bad", [3, 4], SamplingParams(stop_token_ids=[300]))
    with pytest.raises(InvalidRequestError, match="SamplingParams") as info:
        eng.add_request("bad", [3, 4], {"temperature": 0})
    assert info.value.field == "sampling_params"
    eng.add_request("dup", [3, 4], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="already in use"):
        eng.add_request("dup", [5, 6], SamplingParams(max_tokens=2))
    while eng.has_unfinished():
        eng.step()
    assert eng.output("dup").finished
    eng.release("dup")
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["w3", "w4"], [REF_PARAMS])
    assert_undisturbed(llm, reference)


def test_bad_call_while_requests_run(llm, reference):
    """Bad calls in the middle of a running batch leave the running requests exact."""
    eng = llm.engine
    prompts = {f"run{i}": [random.Random(i).randrange(3, 256) for _ in range(4 + 5 * i)] for i in range(3)}
    solo = {
        rid: llm.generate([{"prompt_token_ids": p}], REF_PARAMS)[0].outputs[0].token_ids for rid, p in prompts.items()
    }
    for rid, p in prompts.items():
        eng.add_request(rid, {"prompt_token_ids": p}, REF_PARAMS)
    for _ in range(3):
        eng.step()
    for prompt, _, words in BAD_PROMPTS:
        with pytest.raises(InvalidRequestError, match=words):
            eng.add_request("bad", prompt, REF_PARAMS)
    bad = SamplingParams(temperature=0)
    bad.top_p = 0.0
    with pytest.raises(InvalidRequestError, match="top_p"):
        eng.add_request("bad2", [3], bad)
    eng.step()
    with pytest.raises(InvalidRequestError):
        llm.generate([[3, 4], ""], REF_PARAMS)
    while eng.has_unfinished():
        eng.step()
    for rid in prompts:
        assert eng.output(rid).outputs[0].token_ids == solo[rid]
        eng.release(rid)
    assert_undisturbed(llm, reference)


# ---------------------------------------------------------------- engine start-up
def test_unknown_and_removed_options(model):
    with pytest.raises(ConfigError, match="unknown option 'block_sise'.*'block_size'"):
        LLM(model=str(model), block_sise=16)
    with pytest.raises(ConfigError, match="'swap_space' was removed: preemption is by recompute"):
        LLM(model=str(model), swap_space=4)
    with pytest.raises(ConfigError, match="option 'block_size'"):
        LLM(model=str(model), block_size="16")


def test_max_model_len_beyond_the_model(model):
    with pytest.raises(ConfigError, match="max_model_len 4096 exceeds .* max_position_embeddings 512"):
        LLM(model=str(model), max_model_len=4096)


def _copy(model, tmp_path, name):
    d = tmp_path / name
    shutil.copytree(model, d)
    return d


def test_missing_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        LLM(model=str(tmp_path))
    with pytest.raises(ModelLoadError, match="no config.json"):
        LLM(model=str(tmp_path / "does-not-exist"))


def test_missing_checkpoint_files(model, tmp_path):
    d = _copy(model, tmp_path, "noweights")
    for f in d.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors files"):
        LLM(model=str(d))


def test_missing_tokenizer(model, tmp_path):
    d = _copy(model, tmp_path, "notok")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (d / f).unlink()
    with pytest.raises(ModelLoadError, match="tokenizer"):
        LLM(model=str(d))


@pytest.mark.parametrize("archs", [["GPT2LMHeadModel"], ["MixtralForCausalLM"], []])
def test_unsupported_architecture(model, tmp_path, archs):
    d = _copy(model, tmp_path, "arch")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = archs
    cfg["model_type"] = "gpt2" if not archs else cfg["model_type"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported architecture") as info:
        LLM(model=str(d))
    for name in SUPPORTED_ARCHITECTURES:
        assert name in str(info.value)
    if archs:
        assert archs[0] in str(info.value)


def test_checkpoint_missing_a_tensor(ray_local, model, tmp_path, llm, reference):
    """A shard without one tensor: the worker's load fails and the message names it."""
    from safetensors.torch import load_file, save_file

    d = _copy(model, tmp_path, "partial")
    (f,) = list(d.glob("*.safetensors"))
    tensors = load_file(str(f))
    gone = "model.layers.1.mlp.down_proj.weight"
    del tensors[gone]
    save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.raises(Exception, match="layers.1.mlp.down_proj.weight") as info:
        LLM(model=str(d), num_kv_blocks=8, worker_start_timeout_s=60)
    assert "missing" in str(info.value)
    assert_undisturbed(llm, reference)
