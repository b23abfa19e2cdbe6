"""Prefix caching on real engines (Ray workers, tiny checkpoint): greedy outputs with caching
equal outputs without it and transformers', token for token, with sync and async scheduling
and under preemption; the benchmark runs on the CPU and reports the hit rate."""

from __future__ import annotations

import random

import pytest

from cluster import LLM, SamplingParams
from tests.checkpoints import hf_greedy

BLOCK = 8
MAX_NEW = 10


def _toks(rng, n):
    return [rng.randrange(3, 256) for _ in range(n)]


def _prompts() -> list[list[int]]:
    """Shared system prompts (one ends on a block boundary, one just off), suffixes that end a
    prompt exactly on / just off / just before a boundary, repeated prompts, a block's tokens at
    another position."""
    rng = random.Random(5)
    sys_a, sys_b = _toks(rng, 2 * BLOCK), _toks(rng, 3 * BLOCK + 3)
    out = []
    for sys_p in (sys_a, sys_b):
        for end in (0, 1, BLOCK - len(sys_p) % BLOCK, BLOCK - len(sys_p) % BLOCK + 1, BLOCK - 1, 2 * BLOCK + 5):
            out.append(sys_p + _toks(rng, end) if end else list(sys_p))
    # a cached block's tokens at another position (and parent) must not hit
    out += [list(out[2]), list(out[7]), sys_a[BLOCK:] + _toks(rng, 5), _toks(rng, BLOCK), _toks(rng, 1)]
    return out


PROMPTS = _prompts()


@pytest.fixture(scope="module")
def model(ckpt_dir):
    return ckpt_dir("llama")


@pytest.fixture(scope="module")
def expected(model):
    return hf_greedy(model, PROMPTS, MAX_NEW)


@pytest.fixture(scope="module")
def engines(ray_local, model):
    """on/sync with a KV cache small enough to preempt, on/async, off/sync."""
    common = dict(block_size=BLOCK, max_num_batched_tokens=40, max_model_len=128)
    specs = {
        "on-sync": dict(num_kv_blocks=16, max_num_seqs=4),
        "on-async": dict(num_kv_blocks=48, max_num_seqs=3, async_scheduling=True),
        "off-sync": dict(num_kv_blocks=48, max_num_seqs=3, enable_prefix_caching=False),
    }
    made = {}
    try:
        for name, kw in specs.items():
            made[name] = LLM(model=str(model), **common, **kw)
        yield made
    finally:
        for llm in made.values():
            llm.shutdown()


def _generate(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.dead is None, llm.engine.dead
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_outputs_with_and_without_caching_equal_transformers(engines, expected):
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    for name, llm in engines.items():
        sch = llm.engine.scheduler
        first = _generate(llm, PROMPTS, greedy)
        again = _generate(llm, PROMPTS[::-1], greedy)[::-1]  # every prompt cached now (if caching)
        assert first == expected, name
        assert again == expected, name
        st = sch.prefix_cache_stats()
        if name.startswith("on"):
            assert st["enabled"] and st["hits"] > 0 and st["num_cached_blocks"] > 0, (name, st)
        else:
            assert not st["enabled"] and st["hits"] == 0 and st["num_cached_blocks"] == 0
        sch.blocks.check_all_free()
    assert engines["on-sync"].engine.scheduler.num_preemptions > 0, "the small cache should force preemption"
    st = engines["on-async"].engine.scheduler.prefix_cache_stats()
    # the second round hits every prompt's whole cached prefix: all full blocks but the last token's
    assert st["hits"] >= sum((len(p) - 1) // BLOCK * BLOCK for p in PROMPTS), st


def test_async_stops_and_seeded_sampling_with_caching(engines, expected):
    """Requests that stop early while later steps are in flight leave only confirmed blocks
    cached: a later request sharing their prefix still gets exactly the reference."""
    on, off = engines["on-async"], engines["off-sync"]
    stops = [
        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, stop_token_ids=[e[2]]) for e in expected
    ]
    got = _generate(on, PROMPTS, stops)
    assert got == [e[: e.index(e[2]) + 1] for e in expected]
    longer = [p + e[:6] for p, e in zip(PROMPTS, expected)]  # continues past the stopped outputs
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW - 6, ignore_eos=True)
    assert _generate(on, longer, greedy) == [e[6:] for e in expected]
    seeded = [SamplingParams(temperature=1.0, seed=i, max_tokens=MAX_NEW, ignore_eos=True) for i in range(len(PROMPTS))]
    assert _generate(on, PROMPTS, seeded) == _generate(off, PROMPTS, seeded)
    on.engine.scheduler.blocks.check_all_free()


def test_salted_requests_do_not_hit_other_tenants(engines, expected):
    llm = engines["on-async"]
    sch = llm.engine.scheduler
    for salt, hits_expected in (("tenant-x", False), ("tenant-x", True), ("tenant-y", False)):
        before = sch.prefix_cache_stats()["hits"]
        sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, cache_salt=salt)
        assert _generate(llm, PROMPTS[-2:-1], sp) == expected[-2:-1]  # a prompt of exactly one block
        assert _generate(llm, PROMPTS[7:8], sp) == expected[7:8]
        gained = sch.prefix_cache_stats()["hits"] - before
        assert (gained > 0) == hits_expected, (salt, gained)


def test_benchmark_smoke(ray_local, tmp_path, monkeypatch):
    from benchmarks import prefix_cache

    monkeypatch.setenv("SYNCLESS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "pc.json"
    res = prefix_cache.main(["--smoke", "--num-prompts", "6", "--output", str(out), "--plot"])
    on, off = res["runs"]["on"], res["runs"]["off"]
    assert on["prefix_cache"]["hit_rate"] > 0 and off["prefix_cache"]["hits"] == 0
    for r in (on, off):
        assert r["num_requests"] == 6 and r["output_tokens_per_second"] > 0
        assert r["ttft"]["mean_ms"] > 0 and r["probe_ttft"]["mean_ms"] > 0
    assert set(res["ratio_on_over_off"]) >= {"output_tokens_per_second", "ttft_speedup", "probe_ttft_speedup"}
    assert 0 <= res["outputs_equal_fraction"] <= 1
    assert out.exists() and out.with_suffix(".png").stat().st_size > 1000
