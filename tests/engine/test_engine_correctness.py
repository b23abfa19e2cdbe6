"""Greedy outputs equal transformers' own models, token for token."""

import random

import pytest

from cluster import LLM, SamplingParams
from tests.checkpoints import hf_greedy

MAX_NEW = 12


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [3, 17, 32, 33, 1, 48, 9, 64][:n]
    return [[rng.randrange(3, vocab) for _ in range(L)] for L in lengths]


@pytest.mark.parametrize(
    "arch,extra",
    [
        ("llama", {}),
        (
            "llama",
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 32,
                }
            },
        ),
        ("qwen2", {}),
        ("qwen3", {"tie_word_embeddings": True}),
        ("phi3", {}),  # q|k|v and gate|up stored fused
    ],
    ids=["llama", "llama-rope-llama3", "qwen2", "qwen3-tied", "phi3"],
)
def test_greedy_matches_transformers(ray_local, ckpt_dir, arch, extra):
    model = ckpt_dir(arch, **extra)
    prompts = _prompts(8, 256)
    expected = hf_greedy(model, prompts, MAX_NEW)
    # small chunks force chunked prefill; few blocks force preemption
    llm = LLM(
        model=str(model), block_size=8, num_kv_blocks=24, max_num_batched_tokens=20, max_num_seqs=6, max_model_len=256
    )
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
        )
        got = [o.outputs[0].token_ids for o in outs]
        assert got == expected
        assert llm.engine.scheduler.num_preemptions > 0, "the cache should have forced preemption"
        llm.engine.scheduler.blocks.check_all_free()
    finally:
        llm.shutdown()


def test_sharded_checkpoint_and_gqa_ratios(ray_local, ckpt_dir):
    model = ckpt_dir("llama", heads=8, kv_heads=1, shards=3)
    assert len(list(model.glob("*.safetensors"))) > 1
    prompts = _prompts(3, 256, seed=1)
    expected = hf_greedy(model, prompts, 8)
    llm = LLM(model=str(model), block_size=16, max_model_len=256)
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        )
        assert [o.outputs[0].token_ids for o in outs] == expected
    finally:
        llm.shutdown()
