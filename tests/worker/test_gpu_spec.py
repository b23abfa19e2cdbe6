"""GPU speculative decoding: CUDA graphs for verify and draft passes, the sync check on."""

import random

import pytest
import torch

from tests.checkpoints import write_checkpoint

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(
        tmp_path_factory.mktemp("gpu-spec"),
        "llama",
        hidden=256,
        heads=8,
        kv_heads=2,
        layers=2,
        vocab_size=96,
        max_pos=1024,
    )


def _prompts():
    rng = random.Random(0)
    out = []
    for n in (5, 40, 77, 130, 12, 64, 9, 200):
        base = [rng.randrange(3, 96) for _ in range(max(2, n // 3))]
        out.append((base * 4)[:n])
    return out


def _llm(ckpt, **opts):
    from cluster import LLM

    base = dict(device="cuda", dtype="float32", sync_check="error", max_model_len=512, max_num_seqs=8)
    return LLM(model=str(ckpt), num_kv_blocks=256, **base, **opts)


def _run(ckpt, **opts):
    from cluster import SamplingParams

    llm = _llm(ckpt, **opts)
    try:
        greedy = llm.generate(
            [{"prompt_token_ids": p} for p in _prompts()],
            SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
            use_tqdm=False,
        )
        sampled = llm.generate(
            [{"prompt_token_ids": p} for p in _prompts()],
            SamplingParams(temperature=0.9, top_k=20, seed=3, max_tokens=32, ignore_eos=True),
            use_tqdm=False,
        )
        return (
            [o.outputs[0].token_ids for o in greedy],
            [o.outputs[0].token_ids for o in sampled],
            dict(llm.engine.stats),
        )
    finally:
        llm.shutdown()


@cuda
def test_spec_on_gpu_equals_plain_greedy_with_sync_check(ray_gpu, ckpt):
    """float32 so that verify (k+1 tokens per row) and plain decode agree exactly;
    sync_check='error' turns any implicit host<->device sync into a failure."""
    plain, _, _ = _run(ckpt, async_scheduling=True)
    for spec in (
        {"speculative_method": "draft_model", "speculative_model": str(ckpt), "num_speculative_tokens": 3},
        {"speculative_method": "ngram", "num_speculative_tokens": 5},
    ):
        greedy, sampled, stats = _run(ckpt, async_scheduling=True, **spec)
        assert greedy == plain, spec
        assert all(len(s) == 32 for s in sampled)
        assert stats.get("spec_draft_tokens", 0) > 0
        if spec["speculative_method"] == "draft_model":
            assert stats["spec_accepted_tokens"] >= 0.9 * stats["spec_draft_tokens"]


@cuda
@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_uneven_draft_counts_replay_the_padded_verify_graph(ray_gpu, ckpt, method):
    """Rows near their ``max_tokens`` carry fewer drafts: those verify steps are padded to
    1 + k tokens a row and replay the verify graph (worker stats count them), the draft
    model's uniform proposals replay their one graph, and the greedy outputs still equal
    plain decoding's (float32), with the sync check on."""
    import ray

    from cluster import SamplingParams

    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    params = [SamplingParams(temperature=0, max_tokens=9 + 5 * i, ignore_eos=True) for i in range(len(prompts))]
    spec = {"speculative_method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        spec["speculative_model"] = str(ckpt)
    outs = {}
    for name, opts in (("plain", {}), ("spec", spec)):
        llm = _llm(ckpt, async_scheduling=True, **opts)
        try:
            outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            stats = ray.get([w.stats.remote() for w in llm.engine.executor.workers])
        finally:
            llm.shutdown()
        padded = sum(s["padded_verify_steps"] for s in stats)
        assert (padded > 0) == (name == "spec"), (name, padded)
        proposals = sum(s["propose_graph_replays"] for s in stats)  # uniform proposals: one graph
        assert (proposals > 0) == (name == "spec" and method == "draft_model"), (name, proposals)
    assert outs["spec"] == outs["plain"]
