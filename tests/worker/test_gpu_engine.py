"""GPU engine tests: bf16 greedy vs transformers, CUDA graphs vs eager, the sync check."""

import pytest
import torch

from tests.checkpoints import write_checkpoint

pytestmark = pytest.mark.gpu

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _hf_greedy(model_dir, prompts, n, dtype=torch.bfloat16):
    """transformers' greedy continuations and, per prompt, its own logits at every
    generated position (``output_logits``: the raw scores generate picked from).

    Our engine runs with ``ignore_eos=True``: it keeps going after EOS and may emit it.
    ``min_new_tokens`` would instead *forbid* EOS in transformers (a logits processor), a
    different argmax, and every position where EOS is the top token would look like a
    divergence (ours picking EOS where transformers' raw logits agree with us; see
    docs/decisions.md). So transformers generates with no EOS at all: plain argmax over
    the whole vocabulary, like ours."""
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    m.generation_config.eos_token_id = None  # never stop, never suppress: n plain argmaxes
    outs, logits = [], []
    with torch.no_grad():
        for p in prompts:
            g = m.generate(
                torch.tensor([p], device="cuda"),
                max_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
                return_dict_in_generate=True,
                output_logits=True,
            )
            toks = g.sequences[0, len(p) :].tolist()
            steps = [step[0].float() for step in g.logits]
            assert len(toks) == n and toks == [int(s.argmax()) for s in steps], (
                "transformers' greedy tokens are not the argmax of its own logits"
            )
            outs.append(toks)
            logits.append(steps)
    return outs, logits


# bf16 tolerance for a greedy divergence (see assert_greedy_equal): unit roundoff
# 2^-8, times (2 + 2 sqrt(R * L)) for R = 12 bf16 roundings on each layer's path
# (norm, q/k/v, rope, attention, o_proj, residual, norm, gate, up, act, down,
# residual) over L layers, times the largest |logit| at that position.
BF16_ROUNDINGS_PER_LAYER = 12
EARLY_TOKENS = 4


def logit_tolerance(dtype: torch.dtype, num_layers: int, max_abs_logit: float) -> float:
    if dtype == torch.float32:
        return 1e-4 * max_abs_logit  # fp32: summation-order noise only
    u = torch.finfo(dtype).eps / 2
    return (2 + 2 * (BF16_ROUNDINGS_PER_LAYER * num_layers) ** 0.5) * u * max_abs_logit


def assert_greedy_equal(prompts, got, expected, hf_logits, dtype, num_layers):
    """Token-for-token comparison with transformers' greedy output.

    Two greedy decoders in 16-bit arithmetic that round at different points (fused
    kernels vs transformers' eager ops) may pick different tokens where the top two
    logits are closer than their rounding noise; after that the continuations are
    unrelated, so only the *first* divergence is judged:

    * at that position transformers' own top-2 gap, and the gap between its logit for
      its token and for ours, must be within the rounding noise: a unit roundoff ``u``
      (2^-8 for bf16) per rounding, accumulating like a random walk over the
      ``R * L`` roundings on the residual path (``2 sqrt(R L) u``), plus ``2u`` for the
      final rounding of the two logits compared, relative to the largest |logit| there
      (rounding errors are relative; the logits' scale sets the absolute noise);
    * divergences must be rare early: most prompts (all but a third) match through the
      first ``EARLY_TOKENS`` tokens, where the KV cache, rotary positions and the
      prefill/decode switch all show their bugs.
    """
    early = []
    for i, (ours, ref) in enumerate(zip(got, expected)):
        assert len(ours) == len(ref), f"prompt {i}: {len(ours)} tokens, expected {len(ref)}"
        j = next((k for k, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
        if j is None:
            continue
        logits = hf_logits[i][j]
        top2 = torch.topk(logits, 2).values
        top2_gap = float(top2[0] - top2[1])
        gap = float(logits[ref[j]] - logits[ours[j]])
        tol = logit_tolerance(dtype, num_layers, float(logits.abs().max()))
        assert top2_gap <= tol and gap <= tol, (
            f"prompt {i} (len {len(prompts[i])}) diverged at token {j} without a near-tie: "
            f"transformers' top-2 gap {top2_gap:.4g}, its logit gap to our token {gap:.4g}, "
            f"tolerance {tol:.4g}: {ours} vs {ref}"
        )
        if j < EARLY_TOKENS:
            early.append(i)
    assert len(early) <= len(prompts) // 3, f"prompts {early} diverged within the first {EARLY_TOKENS} tokens"


@pytest.fixture(scope="module")
def gpu_ckpt(tmp_path_factory):
    # a small vocabulary keeps top-2 logit gaps above bf16 noise on random weights
    return write_checkpoint(
        tmp_path_factory.mktemp("gpu-llama"),
        "llama",
        hidden=256,
        heads=8,
        kv_heads=2,
        layers=2,
        vocab_size=96,
        max_pos=1024,
    )


def _prompts():
    import random

    rng = random.Random(0)
    return [[rng.randrange(3, 96) for _ in range(n)] for n in (5, 33, 64, 100, 17, 250)]


@cuda
@pytest.mark.parametrize(
    "eager,dtype,max_seqs,kernels",
    [
        (True, "bfloat16", 16, {}),
        (False, "bfloat16", 16, {}),
        (False, "float32", 16, {}),
        (False, "bfloat16", 1, {}),  # every decode step at batch 1: the persistent GEMV entries
        # the same with the kernel options off their defaults (shipped to the worker in its config)
        (False, "bfloat16", 1, dict(pdl="off", norm_handoff=False, rope_in_attention=False)),
        (True, "bfloat16", 16, dict(pdl="on", tile_gemm=False)),  # ... PDL in every eager pass
    ],
    ids=[
        "bf16-eager",
        "bf16-cuda-graphs",
        "fp32-cuda-graphs",
        "bf16-cuda-graphs-batch1",
        "bf16-cuda-graphs-batch1-kernel-options-off",
        "bf16-eager-pdl-on-cublas",
    ],
)
def test_gpu_greedy_matches_transformers(ray_local, gpu_ckpt, eager, dtype, max_seqs, kernels):
    from cluster import LLM, SamplingParams

    prompts = _prompts()
    expected, hf_logits = _hf_greedy(gpu_ckpt, prompts, 32, getattr(torch, dtype))
    llm = LLM(
        model=str(gpu_ckpt),
        dtype=dtype,
        enforce_eager=eager,
        max_model_len=1024,
        kv_cache_memory_bytes=256 << 20,
        max_num_seqs=max_seqs,
        **kernels,
    )
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        )
        got = [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()
    assert_greedy_equal(prompts, got, expected, hf_logits, getattr(torch, dtype), num_layers=2)


@cuda
def test_sync_check_error_full_async_run(ray_local, gpu_ckpt):
    """Mixed prefill/decode, preemption, aborts, prompt logprobs, logit bias, allowed ids, bad
    words and structured outputs with sync_check='error': no sync errors."""
    from cluster import LLM, SamplingParams

    llm = LLM(
        model=str(gpu_ckpt),
        dtype="bfloat16",
        sync_check="error",
        async_scheduling=True,
        max_model_len=1024,
        num_kv_blocks=40,
        block_size=16,
        max_num_batched_tokens=128,
        max_num_seqs=8,
    )
    eng = llm.engine
    try:
        prompts = _prompts() * 3
        for i, p in enumerate(prompts):
            sp = SamplingParams(
                temperature=0.0 if i % 2 else 0.8,
                top_p=0.9,
                seed=i,
                max_tokens=24,
                ignore_eos=True,
                logprobs=2 if i % 3 == 0 else None,
                presence_penalty=0.5 if i % 4 == 0 else 0.0,
                prompt_logprobs=1 if i % 5 == 0 else None,  # (eager steps among graph replays)
                logit_bias={7: 2.0, 9: -1.0} if i % 7 == 0 else None,
                structured_outputs={"choice": ["w7", "w9 w11"]} if i % 6 == 1 else None,
                allowed_token_ids=[7, 9, 11, 13] if i % 8 == 3 and i % 6 != 1 else None,
                bad_words=["w5", "w8 w9"] if i % 9 == 4 else None,
            )
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
@pytest.mark.parametrize(
    "options",
    [{}, {"quantization": "fp8", "kv_cache_dtype": "fp8"}, {"quantization": "fp8", "enforce_eager": True}],
    ids=["bf16", "fp8", "fp8-eager"],
)
def test_no_kernel_variant_compiled_after_start_up(ray_local, gpu_ckpt, options):
    """Start-up (graph capture, warm-up) leaves nothing for Triton to compile while serving:
    mixed prefill/decode steps, sampled and greedy rows, logprobs, penalties; with FP8 weights
    and KV cache too, and eagerly (no graph captures compile anything then)."""
    if options.get("quantization") and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9+")
    import ray

    from cluster import LLM, SamplingParams

    llm = LLM(
        model=str(gpu_ckpt),
        dtype="bfloat16",
        async_scheduling=True,
        max_model_len=1024,
        num_kv_blocks=60,
        block_size=16,
        max_num_batched_tokens=128,
        max_num_seqs=8,
        **options,
    )
    try:
        params = [
            SamplingParams(
                temperature=0.0 if i % 2 else 0.8,
                seed=i,
                max_tokens=12,
                ignore_eos=True,
                logprobs=2 if i % 3 == 0 else None,
                presence_penalty=0.5 if i % 4 == 0 else 0.0,
            )
            for i in range(12)
        ]
        llm.generate([{"prompt_token_ids": p} for p in _prompts() * 2], params, use_tqdm=False)
        stats = ray.get([w.stats.remote() for w in llm.engine.executor.workers], timeout=60)
    finally:
        llm.shutdown()
    # (a str message: pytest shortens a list's items, and the middle of a variant tells which)
    assert all(s["kernel_variants_after_start"] == 0 for s in stats), "\n".join(
        v for s in stats for v in s["kernel_variants_first"]
    )


@cuda
def test_planted_sync_is_caught(gpu_ckpt):
    """A `.item()` planted inside a step raises SyncError naming the call site."""
    from metadata.config import EngineConfig
    from metadata.wire import NewRequest, SamplingOptions, ScheduledRow, StepPlan
    from workers.distributed import TPGroup
    from workers.model_runner import ModelRunner
    from workers.sync_check import SyncCheck, SyncError

    cfg = EngineConfig.from_options(
        model=str(gpu_ckpt), dtype="bfloat16", num_kv_blocks=16, enforce_eager=True, max_num_seqs=4
    )
    runner = ModelRunner(cfg, str(gpu_ckpt), torch.device("cuda", 0), TPGroup(), 1024)
    runner.init_kv_cache(16)
    opts = SamplingOptions(0.0, 1.0, 0, 0.0, 1, 1.0, 0.0, 0.0, 0, [], -1)
    check = SyncCheck("error")

    def plan(step, new):
        return StepPlan(
            step_id=step,
            new_requests=[NewRequest.of(1, [5, 6, 7], [], opts, [0])] if new else [],
            rows=[ScheduledRow(1, 3 if new else 1, 3 if new else 4, [], True)],
        )

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
