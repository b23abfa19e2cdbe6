"""GPU engine tests: bf16 greedy vs transformers, CUDA graphs vs eager, the sync check."""

import pytest
import torch

from tests.checkpoints import write_checkpoint

pytestmark = pytest.mark.gpu

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _hf_greedy(model_dir, prompts, n, dtype=torch.bfloat16):
    """transformers' greedy continuations plus a function giving its logits after any prefix."""
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            g = m.generate(torch.tensor([p], device="cuda"), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
            outs.append(g[0, len(p):].tolist())

    def logits_after(ids):
        with torch.no_grad():
            return m(torch.tensor([ids], device="cuda")).logits[0, -1].float()

    return outs, logits_after


def assert_greedy_equal(prompts, got, expected, logits_after, rel_tol):
    """Token-for-token equality; a divergence is accepted only where transformers itself
    sees a near-tie between its token and ours (gap <= rel_tol * max|logit|), and at
    least half the prompts must match on every token."""
    exact = 0
    for i, (ours, ref) in enumerate(zip(got, expected)):
        j = next((k for k, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
        if j is None:
            exact += 1
            continue
        logits = logits_after(prompts[i] + ref[:j])
        gap = float(logits[ref[j]] - logits[ours[j]])
        bound = rel_tol * float(logits.abs().max())
        assert gap <= bound, (
            f"prompt {i} (len {len(prompts[i])}) diverged at token {j} without a near-tie "
            f"(logit gap {gap:.4g} > {bound:.4g}): {ours} vs {ref}"
        )
    assert exact * 2 >= len(prompts), f"only {exact}/{len(prompts)} prompts matched all tokens"


@pytest.fixture(scope="module")
def gpu_ckpt(tmp_path_factory):
    # a small vocabulary keeps top-2 logit gaps above bf16 noise on random weights
    return write_checkpoint(tmp_path_factory.mktemp("gpu-llama"), "llama", hidden=256, heads=8, kv_heads=2,
                            layers=2, vocab_size=96, max_pos=1024)


def _prompts():
    import random

    rng = random.Random(0)
    return [[rng.randrange(3, 96) for _ in range(n)] for n in (5, 33, 64, 100, 17, 250)]


@cuda
@pytest.mark.parametrize("eager,dtype", [(True, "bfloat16"), (False, "bfloat16"), (False, "float32")],
                         ids=["bf16-eager", "bf16-cuda-graphs", "fp32-cuda-graphs"])
def test_gpu_greedy_matches_transformers(ray_local, gpu_ckpt, eager, dtype):
    from cluster import LLM, SamplingParams

    prompts = _prompts()
    expected, logits_after = _hf_greedy(gpu_ckpt, prompts, 32, getattr(torch, dtype))
    llm = LLM(model=str(gpu_ckpt), dtype=dtype, enforce_eager=eager, max_model_len=1024,
              kv_cache_memory_bytes=256 << 20, max_num_seqs=16)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
        got = [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()
    assert_greedy_equal(prompts, got, expected, logits_after, 2e-2 if dtype == "bfloat16" else 1e-4)


@cuda
def test_sync_check_error_full_async_run(ray_local, gpu_ckpt):
    """Mixed prefill/decode, preemption and aborts with sync_check='error': no sync errors."""
    from cluster import LLM, SamplingParams

    llm = LLM(model=str(gpu_ckpt), dtype="bfloat16", sync_check="error", async_scheduling=True,
              max_model_len=1024, num_kv_blocks=40, block_size=16, max_num_batched_tokens=128,
              max_num_seqs=8)
    eng = llm.engine
    try:
        prompts = _prompts() * 3
        for i, p in enumerate(prompts):
            sp = SamplingParams(temperature=0.0 if i % 2 else 0.8, top_p=0.9, seed=i, max_tokens=24,
                                ignore_eos=True, logprobs=2 if i % 3 == 0 else None,
                                presence_penalty=0.5 if i % 4 == 0 else 0.0)
            eng.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
        steps = 0
        finished = {}
        while eng.has_unfinished():
            for d in eng.step():
                if d.finish_reason:
                    finished[d.request_id] = d.finish_reason
                    assert d.finish_reason != "error", d.error
            steps += 1
            if steps == 6:
                assert eng.abort("r1") and eng.abort("r7")
        assert eng.dead is None
        assert eng.scheduler.num_preemptions > 0
        eng.scheduler.blocks.check_all_free()
    finally:
        llm.shutdown()


@cuda
def test_planted_sync_is_caught(gpu_ckpt):
    """A `.item()` planted inside a step raises SyncError naming the call site."""
    from metadata.config import EngineConfig
    from metadata.wire import NewRequest, SamplingOptions, ScheduledRow, StepPlan
    from workers.distributed import TPGroup
    from workers.model_runner import ModelRunner
    from workers.sync_check import SyncCheck, SyncError

    cfg = EngineConfig.from_options(model=str(gpu_ckpt), dtype="bfloat16", num_kv_blocks=16,
                                    enforce_eager=True, max_num_seqs=4)
    runner = ModelRunner(cfg, str(gpu_ckpt), torch.device("cuda", 0), TPGroup(), 1024)
    runner.init_kv_cache(16)
    opts = SamplingOptions(0.0, 1.0, 0, 0.0, 1, 1.0, 0.0, 0.0, 0, [], -1)
    check = SyncCheck("error")

    def plan(step, new):
        return StepPlan(step_id=step, new_requests=[NewRequest(1, [5, 6, 7], [], opts, [0])] if new else [],
                        rows=[ScheduledRow(1, 3 if new else 1, 3 if new else 4, [], True)])

    with check.armed():
        runner.finish(runner.launch(plan(1, True)))  # clean step: no error
    original = runner.model.compute_logits

    def planted(h):
        out = original(h)
        out.sum().item()  # the planted implicit sync
        return out

    runner.model.compute_logits = planted
    with pytest.raises(SyncError, match="test_gpu_engine.py"):
        with check.armed():
            runner.launch(plan(2, False))
    # outside the armed region the same call is allowed
    runner.model.compute_logits = original
