"""The warm-up's scratch requests (a mixed step, then a two-row decode step, through ``execute``,
run on GPUs before serving) leave nothing behind: their rows are released and later requests get exactly the
tokens and logits of a runner that never ran them. Run here on the CPU, where ``warm_up``
itself skips them (nothing to compile)."""

import torch

from metadata.config import EngineConfig
from metadata.wire import NewRequest, SamplingOptions, ScheduledRow, StepPlan

BS = 8
GREEDY = SamplingOptions(0.0, 1.0, 0, 0.0, 0, 1.0, 0.0, 0.0, 0, [], -1)


def _runner(model_dir, max_model_len=128):
    from workers.distributed import TPGroup
    from workers.model_runner import ModelRunner

    cfg = EngineConfig.from_options(num_kv_blocks=12, block_size=BS, max_num_seqs=4)
    r = ModelRunner(cfg, str(model_dir), torch.device("cpu"), TPGroup(), max_model_len)
    r.init_kv_cache(12)
    r.logits = []
    inner = r.model.compute_logits
    r.model.compute_logits = lambda h: r.logits.append(inner(h)) or r.logits[-1]
    return r


def _serve(r):
    """A request on the blocks the scratch request used (0-2), prefill then 3 decode steps."""
    prompt = [5, 9, 17, 33, 2, 41, 7, 11, 13, 60, 3]
    plans = [
        StepPlan(
            1,
            new_requests=[NewRequest.of(7, prompt, [], GREEDY, [2, 0, 1])],
            rows=[ScheduledRow(7, len(prompt), len(prompt), [], True)],
        )
    ]
    plans += [StepPlan(2 + k, rows=[ScheduledRow(7, 1, len(prompt) + 1 + k, [], True)]) for k in range(3)]
    return [r.execute(p).outputs[0].token_ids for p in plans]


def test_scratch_request_leaves_no_trace(ckpt_dir):
    torch.set_num_threads(1)
    model = ckpt_dir("llama")
    warmed, fresh = _runner(model), _runner(model)
    warmed._scratch_request_steps()
    # a mixed step sampling one of its two rows, then a step sampling both (greedy and sampled)
    assert [len(x) for x in warmed.logits] == [1, 2]
    assert not warmed.state.row_of  # the scratch rows are released
    warmed.logits.clear()
    assert _serve(warmed) == _serve(fresh)
    for a, b in zip(warmed.logits, fresh.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_one_scratch_request_where_two_do_not_fit(ckpt_dir):
    """A cache of 4 blocks holds one scratch request (3 blocks), not two: its prefill and decode."""
    r = _runner(ckpt_dir("llama"))
    r.init_kv_cache(4)
    r._scratch_request_steps()
    assert [len(x) for x in r.logits] == [1, 1]
    assert not r.state.row_of


def test_one_scratch_request_where_a_step_cannot_hold_two_prompts(ckpt_dir):
    """A step budget under the two prompts' 2n - 1 tokens (n = 17 at block size 8): one request."""
    from workers.distributed import TPGroup
    from workers.model_runner import ModelRunner

    cfg = EngineConfig.from_options(
        num_kv_blocks=12, block_size=BS, max_num_seqs=4, max_num_batched_tokens=32, enable_chunked_prefill=True
    )
    r = ModelRunner(cfg, str(ckpt_dir("llama")), torch.device("cpu"), TPGroup(), 128)
    r.init_kv_cache(12)
    r.logits = []
    inner = r.model.compute_logits
    r.model.compute_logits = lambda h: r.logits.append(inner(h)) or r.logits[-1]
    r._scratch_request_steps()
    assert [len(x) for x in r.logits] == [1, 1]


def test_scratch_request_skipped_when_the_cache_is_too_small(ckpt_dir):
    from workers.distributed import TPGroup
    from workers.model_runner import ModelRunner

    cfg = EngineConfig.from_options(num_kv_blocks=2, block_size=BS, max_num_seqs=2)
    r = ModelRunner(cfg, str(ckpt_dir("llama")), torch.device("cpu"), TPGroup(), 128)
    r.init_kv_cache(2)
    r._scratch_request_steps()  # needs 3 blocks: returns without a step
    assert not r.state.row_of


def test_eager_decode_passes_leave_no_trace(ckpt_dir):
    """``enforce_eager``'s start-up passes (``workers.eager_warm_up``, one per eager attention
    variant and batch size) run through the real model here on the CPU, where ``warm_up``
    itself skips them: they write no KV cache byte and change no later token or logit."""
    torch.set_num_threads(1)
    model = ckpt_dir("qwen3")  # q/k norms: the decode attention's full prologue
    warmed, fresh = _runner(model, 1024), _runner(model, 1024)  # bounds up to 4 splits
    before = [t.clone() for layer in warmed.kv_caches for t in layer]
    warmed._warm_eager_decode()
    # every batch size 1..4 once, plus the bounds that reach the other split counts
    sizes = [len(x) for x in warmed.logits]
    assert warmed.eager_warm_cases == len(sizes) and len(sizes) > 4
    assert sorted(set(sizes)) == [1, 2, 3, 4]
    after = [t for layer in warmed.kv_caches for t in layer]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    warmed.logits.clear()
    assert _serve(warmed) == _serve(fresh)
    for a, b in zip(warmed.logits, fresh.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_spec_kernel_warm_up_leaves_the_state_untouched(ckpt_dir):
    """``SpecDecoder.warm_up`` (run on GPUs before serving, to compile the verify and commit
    kernels) runs here through the torch references: it works on scratch tensors only."""
    from workers.distributed import TPGroup
    from workers.model_runner import ModelRunner

    model = str(ckpt_dir("llama"))
    for method in ("ngram", "draft_model"):
        extra = {"speculative_model": model} if method == "draft_model" else {}
        cfg = EngineConfig.from_options(
            num_kv_blocks=12, block_size=BS, max_num_seqs=4, speculative_method=method, **extra
        )
        r = ModelRunner(cfg, model, torch.device("cpu"), TPGroup(), 128)
        r.init_kv_cache(12)
        st = r.state
        st.token_ids.random_(0, 50)
        before = [t.clone() for t in (st.token_ids, st.num_computed, st.output_counts)]
        r.spec.warm_up(st)
        assert all(torch.equal(a, b) for a, b in zip(before, (st.token_ids, st.num_computed, st.output_counts)))


def test_spec_kernel_warm_up_covers_a_padded_logits_stride(ckpt_dir, monkeypatch):
    """With a vocabulary padded to a multiple of the TP size, the LM head's logits rows are
    wider than the vocabulary: warm-up runs the verify kernels on both layouts."""
    import kernels.spec_ops as spec_ops
    from workers.distributed import TPGroup
    from workers.model_runner import ModelRunner

    model = str(ckpt_dir("llama"))
    cfg = EngineConfig.from_options(num_kv_blocks=12, block_size=BS, max_num_seqs=4, speculative_method="ngram")
    r = ModelRunner(cfg, model, torch.device("cpu"), TPGroup(), 128)
    r.init_kv_cache(12)
    strides = []
    inner = spec_ops.verify_slots
    monkeypatch.setattr(
        "workers.spec_decode.verify_slots",
        lambda logits, *a, **kw: strides.append(logits.stride(0)) or inner(logits, *a, **kw),
    )
    vocab = r.state.output_counts.shape[1]
    assert r.model.lm_head.padded_vocab == vocab  # (what warm_up passes on a GPU: TP 1 pads nothing)
    r.spec.warm_up(r.state, vocab + 3)
    assert sorted(set(strides)) == [vocab, vocab + 3]


def test_worker_start_up_lines_reach_the_console():
    """A worker actor's start-up progress (KV sizing, graph captures: ``workers.*`` INFO lines)
    goes to its stderr, which Ray forwards to the driver, from the driver's level up; one
    handler per process."""
    import logging

    from workers.actor import _show_worker_logs

    log = logging.getLogger("workers")
    saved = log.handlers[:], log.level, log.propagate
    log.handlers[:] = []
    try:
        _show_worker_logs(logging.INFO)
        _show_worker_logs(logging.INFO)
        assert len(log.handlers) == 1 and log.getEffectiveLevel() == logging.INFO and not log.propagate
        assert logging.getLogger("workers.cuda_graphs").isEnabledFor(logging.INFO)
        _show_worker_logs(logging.WARNING)  # cluster.serve --log-level warning
        assert not logging.getLogger("workers.cuda_graphs").isEnabledFor(logging.INFO)
    finally:
        log.handlers[:], log.level, log.propagate = saved[0], saved[1], saved[2]


def test_launch_phases_split_the_launch(ckpt_dir):
    """Each sampling launch records its host time by phase (``LAUNCH_PHASES``), flagged mixed
    when no decode graph fit (every step on the CPU): what ``benchmarks.launch_wait`` and
    ``benchmarks.throughput`` print to show where a launch's time goes."""
    from workers.model_runner import LAUNCH_PHASES

    r = _runner(ckpt_dir("llama"))
    _serve(r)
    assert len(r.launch_phases) == len(r.launch_ms) == 4
    for phases, total in zip(r.launch_phases, r.launch_ms):
        assert phases[0] is True and len(phases) == 1 + len(LAUNCH_PHASES)
        assert all(ms >= 0 for ms in phases[1:]) and sum(phases[1:]) <= total
    assert phases[3] > 0  # the forward ran


def test_launch_thread_time_leaves_out_time_the_thread_did_not_run(ckpt_dir):
    """Each sampling launch also records its thread's CPU time (``launch_cpu``): about its wall
    time while the thread runs throughout, and short of it by the time the thread did not run,
    here a 30 ms sleep inside the placement (what another thread holding the GIL, or a blocking
    call, does to a worker's launch): the gap ``benchmarks.launch_wait`` reports."""
    import time

    model = ckpt_dir("llama")
    quiet = _runner(model)
    _serve(quiet)
    assert len(quiet.launch_cpu) == len(quiet.launch_ms) == 4
    for (mixed, wall, cpu), total in zip(quiet.launch_cpu, quiet.launch_ms):
        assert mixed is True and wall == total and 0 < cpu <= wall + 0.05

    stalled = _runner(model)
    stage = stalled.state.stage

    def stage_after_a_sleep(reqs):
        time.sleep(0.03)
        return stage(reqs)

    stalled.state.stage = stage_after_a_sleep
    _serve(stalled)
    assert len(stalled.launch_cpu) == 4
    for _, wall, cpu in stalled.launch_cpu:
        assert wall >= 30 and wall - cpu >= 29, (wall, cpu)
