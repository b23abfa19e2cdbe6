"""Speculative decoding end to end: greedy outputs equal transformers' token for token.

Real engines on a real local Ray, n-gram and draft-model proposers, k = 1, 3, 5,
async scheduling on and off, a KV cache small enough to force preemption and a
token budget small enough to chunk prefills. Prompts repeat themselves so that
n-gram lookups and a related draft get accepted (otherwise every draft would be
rejected and the test would not exercise acceptance).
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from cluster import LLM, SamplingParams
from cluster.engine import EngineCore
from metadata.config import ConfigError, EngineConfig
from tests.checkpoints import hf_greedy

BLOCK = 8
MAX_NEW = 20


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    base = [rng.randrange(3, 256) for _ in range(max(2, n // 3))]
    return (base * 4)[:n]


PROMPTS = [_prompt(i, n) for i, n in enumerate([4, 19, 30, 9, 41, 12])]


@pytest.fixture(scope="module")
def model(ckpt_dir):
    return ckpt_dir("llama")


@pytest.fixture(scope="module")
def draft(ckpt_dir):
    # same vocabulary, different weights and shape: a separate draft checkpoint
    return ckpt_dir("qwen3", seed=5, hidden=32, layers=1, heads=2, kv_heads=1)


@pytest.fixture(scope="module")
def greedy_ref(model):
    return hf_greedy(model, PROMPTS, MAX_NEW)


def _llm(model, **spec):
    return LLM(
        model=str(model),
        block_size=BLOCK,
        num_kv_blocks=22,
        max_num_batched_tokens=24,
        max_num_seqs=5,
        max_model_len=160,
        **spec,
    )


CASES = [
    ("ngram", 1, False),
    ("ngram", 3, True),
    ("ngram", 5, False),
    ("ngram", 5, True),
    ("self", 3, True),
    ("self", 1, False),
    ("draft", 5, True),
    ("draft", 3, False),
    ("ngram_host", 3, False),
]


@pytest.mark.parametrize(
    "method,k,async_mode", CASES, ids=[f"{m}-k{k}-{'async' if a else 'sync'}" for m, k, a in CASES]
)
def test_greedy_spec_equals_transformers(ray_local, model, draft, greedy_ref, method, k, async_mode):
    spec = {"num_speculative_tokens": k, "async_scheduling": async_mode}
    if method == "self":
        spec.update(speculative_method="draft_model", speculative_model=str(model))
    elif method == "draft":
        spec.update(speculative_method="draft_model", speculative_model=str(draft))
    else:
        spec.update(speculative_method=method)
    llm = _llm(model, **spec)
    # (with a draft model, every other prompt's logprobs too: eager steps among the draft's)
    scored = method == "draft"
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS],
            [
                SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, prompt_logprobs=i % 2 or None)
                if scored
                else SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
                for i in range(len(PROMPTS))
            ],
        )
        assert [o.outputs[0].token_ids for o in outs] == greedy_ref
        if scored:
            hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
            for i, (p, o) in enumerate(zip(PROMPTS, outs)):
                if i % 2 == 0:
                    assert o.prompt_logprobs is None
                    continue
                with torch.no_grad():
                    ref = hf(torch.tensor([p])).logits[0].log_softmax(-1)
                got = [lp[t] for t, lp in zip(p[1:], o.prompt_logprobs[1:])]
                assert o.prompt_logprobs[0] is None
                assert got == pytest.approx([float(ref[j, t]) for j, t in enumerate(p[1:])], abs=2e-4)
        st = llm.engine.stats
        drafted, accepted = st.get("spec_draft_tokens", 0), st.get("spec_accepted_tokens", 0)
        assert drafted > 0, "no row carried drafts"
        if method == "self":  # the target as its own draft: (almost) everything passes
            assert accepted >= 0.9 * drafted, (accepted, drafted)
        elif method != "draft":
            assert accepted > 0, "repetitive prompts should get some n-gram drafts accepted"
        assert llm.engine.scheduler.num_preemptions > 0, "the small cache should force preemption"
        llm.engine.scheduler.blocks.check_all_free()
    finally:
        llm.shutdown()


def test_stops_and_aborts_mid_draft(ray_local, model, greedy_ref):
    """Stop tokens/strings that land inside an accepted run of drafts end the output exactly
    where plain decoding ends it; an aborted request leaves nothing behind."""
    plain = _llm(model)
    spec = _llm(
        model,
        speculative_method="draft_model",
        speculative_model=str(model),
        num_speculative_tokens=5,
        async_scheduling=True,
    )
    try:
        tok = plain.get_tokenizer()
        params = []
        for i, ref in enumerate(greedy_ref):
            stop_tok = ref[7 + i % 5]
            if i % 2:
                params.append(SamplingParams(temperature=0, max_tokens=MAX_NEW, stop_token_ids=[stop_tok]))
            else:
                params.append(
                    SamplingParams(temperature=0, max_tokens=MAX_NEW, stop=[tok.decode([stop_tok])], ignore_eos=True)
                )
        reqs = [{"prompt_token_ids": p} for p in PROMPTS]
        want = plain.generate(reqs, params)
        got = spec.generate(reqs, params)
        for w, g in zip(want, got):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
            assert g.outputs[0].text == w.outputs[0].text
            assert g.outputs[0].finish_reason == w.outputs[0].finish_reason == "stop"
        assert spec.engine.stats["spec_accepted_tokens"] > 0
        core: EngineCore = spec.engine
        core.add_request(
            "a", {"prompt_token_ids": PROMPTS[4]}, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
        )
        for _ in range(4):
            core.step()
        core.abort("a")
        while core.has_unfinished():
            core.step()
        out = core.output("a")
        assert out.outputs[0].finish_reason == "abort"
        n = len(out.outputs[0].token_ids)
        assert out.outputs[0].token_ids == greedy_ref[4][:n]
        core.scheduler.blocks.check_all_free()
    finally:
        plain.shutdown()
        spec.shutdown()


def test_seeded_sampling_with_drafts_is_reproducible(ray_local, model):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    llm = _llm(model, speculative_method="draft_model", speculative_model=str(model), num_speculative_tokens=3)
    try:
        a = llm.generate([{"prompt_token_ids": PROMPTS[2]}], params)[0].outputs[0].token_ids
        b = llm.generate([{"prompt_token_ids": PROMPTS[2]}], params)[0].outputs[0].token_ids
        assert a == b and len(a) == 16
        assert llm.engine.stats.get("spec_draft_tokens", 0) > 0
    finally:
        llm.shutdown()


def test_startup_refusals(ray_local, model, ckpt_dir):
    with pytest.raises(ConfigError, match="ngram_host.*speculative_method='ngram'.*async_scheduling=False"):
        EngineConfig.from_options(speculative_method="ngram_host", async_scheduling=True)
    with pytest.raises(ConfigError, match="needs speculative_model"):
        EngineConfig.from_options(speculative_method="draft_model")
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        EngineConfig.from_options(speculative_method="ngram", num_speculative_tokens=0)
    with pytest.raises(ConfigError, match="use num_speculative_tokens"):
        EngineConfig.from_options(num_lookahead_slots=3)
    other_vocab = ckpt_dir("llama", vocab_size=320)
    with pytest.raises(Exception, match="vocab"):
        LLM(
            model=str(model),
            speculative_method="draft_model",
            speculative_model=str(other_vocab),
            num_kv_blocks=16,
            max_model_len=64,
        )


def test_spec_benchmark_runs_on_cpu(ray_local, tmp_path):
    from benchmarks.spec_decode import alpha_from_mean_accepted, main, predicted_speedup

    assert abs(alpha_from_mean_accepted(0.5 + 0.25 + 0.125, 3) - 0.5) < 1e-6
    assert abs(predicted_speedup(1.0, 3, 0.0) - 4.0) < 1e-9
    out = main(
        [
            "--shape",
            "tiny",
            "--draft-shape",
            "tiny-draft",
            "--self-draft",
            "--batch-sizes",
            "1",
            "--prompt-len",
            "8",
            "--output-len",
            "8",
            "--device",
            "cpu",
            "--output",
            str(tmp_path / "s.json"),
        ]
    )
    self_row = next(r for r in out["results"] if r["config"] == "spec_self")
    # the target as its own draft: c = 1, so all-accepted k=3 predicts (k+1)/(k+1) = 1
    assert self_row["acceptance_rate"] > 0.9 and abs(self_row["predicted_speedup"] - 1.0) < 0.05
    assert (tmp_path / "s.json").exists()


def _pad_like_graphs(actor, k: int) -> None:
    """What CUDA-graph capture sets on a GPU worker: uneven verify steps pad to 1 + k tokens a
    row, the draft's uneven windows to k + 2 (here on the CPU, with no graphs to replay)."""
    actor.runner.pad_query_lens = (1, 1 + k)
    proposer = actor.runner.spec.proposer if actor.runner.spec is not None else None
    if proposer is not None and hasattr(proposer, "pad_query_lens"):
        proposer.pad_query_lens = (1, k + 2)


def _padded_counts(actor) -> tuple[int, int]:
    proposer = actor.runner.spec.proposer
    return actor.runner.padded_steps, getattr(proposer, "padded_windows", 0)


PAD_CASES = [("ngram", 3), ("self", 3), ("draft", 2)]


@pytest.mark.parametrize("method,k", PAD_CASES, ids=[f"{m}-k{k}" for m, k in PAD_CASES])
def test_padded_verify_steps_keep_outputs(ray_local, model, draft, greedy_ref, method, k):
    """Verify steps whose rows carry different draft counts (rows near ``max_tokens`` get
    fewer), padded to one query length as the GPU does to replay the verify graph: greedy
    outputs still equal transformers', and seeded sampled outputs equal the unpadded run's."""
    import ray

    spec = {"num_speculative_tokens": k, "async_scheduling": True}
    if method == "ngram":
        spec.update(speculative_method="ngram")
    else:
        spec.update(speculative_method="draft_model", speculative_model=str(model if method == "self" else draft))
    reqs = [{"prompt_token_ids": p} for p in PROMPTS]
    greedy = [SamplingParams(temperature=0, max_tokens=6 + 2 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    sampled = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=5 + 2 * i, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    runs = {}
    for padded in (False, True):
        llm = _llm(model, **spec)
        try:
            workers = llm.engine.executor.workers
            if padded:
                ray.get([w.__ray_call__.remote(_pad_like_graphs, k) for w in workers])
            g = llm.generate(reqs, greedy, use_tqdm=False)
            s = llm.generate(reqs, sampled, use_tqdm=False)
            runs[padded] = ([o.outputs[0].token_ids for o in g], [o.outputs[0].token_ids for o in s])
            counts = ray.get(workers[0].__ray_call__.remote(_padded_counts))
            llm.engine.scheduler.blocks.check_all_free()
        finally:
            llm.shutdown()
        if padded:
            assert counts[0] > 0, "no verify step was padded: the test did not exercise padding"
            if method != "ngram":
                assert counts[1] > 0, "no draft window was padded"
        else:
            assert counts == (0, 0)
    for outs, ref in zip(runs[True][0], greedy_ref):
        assert outs == ref[: len(outs)]
    assert [len(o) for o in runs[True][0]] == [p.max_tokens for p in greedy]
    assert runs[True][1] == runs[False][1]
