"""``SYNCLESS_DECODE_LAYER=1`` end to end on the CPU: batch-1 decode steps run each decoder
layer through ``ops.decode_layer`` (here its plain-torch reference; on CUDA the one-launch
kernel, ``tests/test_gpu_decode_layer.py``), and greedy outputs still equal transformers'.
This checks the model's wiring: the layer's tensors, the gate|up layout, q/k norms, the KV
cache and the step's metadata reach the layer as the op-by-op path uses them."""

import random

import pytest

from cluster import LLM, SamplingParams
from tests.checkpoints import hf_greedy


@pytest.mark.parametrize("arch,extra", [("qwen3", {"tie_word_embeddings": True}),
                                        ("llama", {"heads": 8, "kv_heads": 2})],
                         ids=["qwen3-qk-norm", "llama-gqa4"])
def test_one_launch_layer_greedy_matches_transformers(ray_local, ckpt_dir, monkeypatch, arch,
                                                      extra):
    monkeypatch.setenv("SYNCLESS_DECODE_LAYER", "1")  # forwarded to the worker actor
    model = ckpt_dir(arch, **extra)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (7, 16)]
    expected = hf_greedy(model, prompts, 10)
    llm = LLM(model=str(model), block_size=8, max_model_len=128, max_num_seqs=1)
    try:
        info = llm.engine.executor.info
        assert all(i["kernel_switches"].get("SYNCLESS_DECODE_LAYER") == "1" for i in info), info
        for prompt, want in zip(prompts, expected):  # one request at a time: batch-1 decode
            out = llm.generate([{"prompt_token_ids": prompt}],
                               SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                               use_tqdm=False)
            assert out[0].outputs[0].token_ids == want
    finally:
        llm.shutdown()


def test_one_launch_layer_small_batches_match_transformers(ray_local, ckpt_dir, monkeypatch):
    """Four requests decoding together (batches of 1 to 4 tokens, one a request, as they
    join and finish), through the layer's batched form."""
    monkeypatch.setenv("SYNCLESS_DECODE_LAYER", "1")
    model = ckpt_dir("qwen3", tie_word_embeddings=True)
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (5, 12, 3, 20)]
    expected = hf_greedy(model, prompts, 8)
    llm = LLM(model=str(model), block_size=8, max_model_len=128, max_num_seqs=4)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
    finally:
        llm.shutdown()
