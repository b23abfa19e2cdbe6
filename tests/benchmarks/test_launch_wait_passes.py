"""``benchmarks.launch_wait.run_mode`` on the CPU: with ``passes`` > 1 only the last pass's
launches are recorded (the earlier ones warm every step shape), with new prompts."""

import statistics

from benchmarks.launch_wait import run_mode, workload


def test_only_the_last_pass_is_recorded(ray_local, ckpt_dir):
    ck = str(ckpt_dir("llama", max_pos=4096))
    kw = dict(num_prompts=8, prompt_len=40, max_num_seqs=4, vocab=200, sync_check="off")
    one = run_mode("async", ck, "safetensors", 5.0, passes=1, **kw)
    two = run_mode("async", ck, "safetensors", 5.0, passes=2, **kw)
    n1, n2 = len(one["launch_ms"]), len(two["launch_ms"])
    assert n1 > 20 and abs(n2 - n1) <= n1 // 4, (n1, n2)  # one pass's worth, not two
    assert two["mixed_launch_ms"] and len(two["launch_phases_ms"]) == n2
    assert [c[1] for c in two["launch_cpu_ms"]] == two["launch_ms"]  # each launch's thread CPU time beside
    # the thread's CPU time is never far above its wall time (a loaded 2-core machine may
    # account a tick late, so the bound is on the median, the sign on every launch)
    cpu = two["launch_cpu_ms"]
    assert all(c[2] >= 0 for c in cpu) and statistics.median(c[2] - c[1] for c in cpu) <= 0.05, cpu


def test_sync_modes_run_the_engines_default_scheduling(ray_local, ckpt_dir):
    """``sync`` and ``sync+draft`` (the engine's default: the driver waits for each step's
    tokens) run without async scheduling, every other mode with it; the sync run is timed
    launch by launch like the async ones."""
    from benchmarks.launch_wait import MODES, mode_options

    assert {m for m in MODES if not mode_options(m, "m")["async_scheduling"]} == {"sync", "sync+draft"}
    assert mode_options("sync+draft", "m")["speculative_method"] == "draft_model"
    ck = str(ckpt_dir("llama", max_pos=4096))
    run = run_mode("sync", ck, "safetensors", 5.0, num_prompts=8, prompt_len=40, max_num_seqs=4, vocab=200)
    assert run["async_scheduling"] is False and len(run["launch_ms"]) > 20, run["launch_ms"]


def test_each_pass_has_new_prompts_of_the_same_shape():
    (a, pa), (b, pb) = workload(4, 30, 100, seed=0), workload(4, 30, 100, seed=1)
    assert a != b and [len(p) for p in a] == [len(p) for p in b]
    assert [p.max_tokens for p in pa] == [p.max_tokens for p in pb]


def test_staggered_arrivals_place_prompts_beside_running_rows(ray_local, ckpt_dir):
    """``arrivals="staggered"``: rows finish about one a step, so waiting prompts are placed
    beside running decode rows in many more steps than the batched workload's few."""
    ck = str(ckpt_dir("llama", max_pos=4096))
    kw = dict(num_prompts=16, prompt_len=40, max_num_seqs=4, vocab=200, sync_check="off")
    batched = run_mode("async", ck, "safetensors", 5.0, **kw)
    staggered = run_mode("async", ck, "safetensors", 5.0, arrivals="staggered", **kw)
    nb, ns = len(batched["mixed_launch_ms"]), len(staggered["mixed_launch_ms"])
    assert ns >= nb + 4, (nb, ns)


def test_arrivals_are_checked():
    import pytest

    with pytest.raises(ValueError, match="arrivals"):
        workload(4, 30, 100, arrivals="poisson")
    _, params = workload(48, 30, 100, arrivals="staggered")
    assert len({p.max_tokens for p in params}) > 40  # rows finish at (nearly) distinct steps


def test_the_options_mode_samples_every_path(ray_local, ckpt_dir):
    """``async+options``: the rows take every sampling option in turn (valid parameters, an
    engine that serves them) beside plain greedy and temperature rows."""
    from benchmarks.launch_wait import RICH_OPTIONS

    _, params = workload(28, 30, 100, rich=True)
    for extra in filter(None, RICH_OPTIONS):  # each set of extras on a greedy and a temperature row
        kinds = {p.temperature > 0 for p in params if all(getattr(p, k) == v for k, v in extra.items())}
        assert kinds == {False, True}, extra
    assert any(p.temperature == 0 for p in params) and any(p.logprobs is None for p in params)
    ck = str(ckpt_dir("llama", max_pos=4096))
    run = run_mode("async+options", ck, "safetensors", 5.0, num_prompts=12, prompt_len=30, max_num_seqs=4, vocab=200)
    assert len(run["launch_ms"]) > 20 and run["mixed_launch_ms"]


def test_draft_overheads_compare_with_the_same_runs_plain_launch():
    from benchmarks.launch_wait import draft_overheads

    rows = [
        {"mode": "async", "decode_median_ms": 2.0},
        {"mode": "async+ngram", "decode_median_ms": 2.3},
        {"mode": "async+draft", "decode_median_ms": 3.5},
        {"mode": "async+fp8", "decode_median_ms": 1.8},
    ]
    assert draft_overheads(rows) == [
        "async+ngram: decode launch 2.30 ms = 1.15x plain async's 2.00 ms",
        "async+draft: decode launch 3.50 ms = 1.75x plain async's 2.00 ms",
    ]
    assert draft_overheads(rows[1:]) == []  # no plain row in the run: no ratio
