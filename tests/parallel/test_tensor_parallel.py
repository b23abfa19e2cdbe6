"""TP=2 (gloo, two Ray actors) produces the same greedy tokens as TP=1."""

import random

import pytest
import ray

from cluster import LLM, SamplingParams

MAX_NEW = 10


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (4, 29, 11, 40)]


def _generate(model, prompts, **options):
    llm = LLM(model=str(model), block_size=8, max_model_len=128, max_num_batched_tokens=48, **options)
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
            use_tqdm=False,
        )
        ex = llm.engine.executor
        stats = ray.get([w.stats.remote() for w in ex.workers], timeout=30)
        return [o.outputs[0].token_ids for o in outs], ex.info, stats
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    "arch,kw,tp2_options",
    [
        # KV heads sharded (2 over 2 ranks); prefill steps above 16 tokens run as two overlapped ubatches
        ("llama", {}, {"ubatch_token_threshold": 16}),
        # one KV head replicated on both ranks, qkv bias, a vocabulary that does not divide by 2
        # (the last vocab shard is padded), tied embeddings
        ("qwen2", {"kv_heads": 1, "vocab_size": 255, "tie_word_embeddings": True}, {}),
    ],
    ids=["llama-sharded-kv-ubatch", "qwen2-replicated-kv-odd-vocab-tied"],
)
def test_tp2_matches_tp1(ray_local, ckpt_dir, arch, kw, tp2_options, monkeypatch):
    model = ckpt_dir(arch, **kw)
    prompts = _prompts(kw.get("vocab_size", 256))
    # a kernel option reaches every worker with the config (the CPU reference path does not
    # read it, so tokens agree)
    tp1, _, _ = _generate(model, prompts, tensor_parallel_size=1)
    tp2, info2, stats = _generate(model, prompts, tensor_parallel_size=2, rope_in_attention=False, **tp2_options)
    assert tp2 == tp1
    if tp2_options.get("ubatch_token_threshold"):
        assert all(s["ubatched_steps"] > 0 for s in stats), stats  # every rank split the same steps
        timings = (
            "launch_ms",
            "mixed_launch_ms",
            "launch_phases_ms",
            "launch_cpu_ms",
            "allocator_growths",
        )  # host timings, allocators
        same = [{k: v for k, v in s.items() if k not in timings} for s in stats]
        assert same[0] == same[1]
    assert all(s["tp_all_reduce"] == "gloo" for s in stats), stats
    assert [i["rank"] for i in info2] == [0, 1] and len({i["pid"] for i in info2}) == 2
    assert all(i["platform"] == "cpu" and i["collective"] == "gloo" for i in info2)
    assert all(i["kernels"]["rope_in_attention"] is False for i in info2), info2
