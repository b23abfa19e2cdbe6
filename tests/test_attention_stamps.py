"""Decode attention's profiling stamps (``paged_attention_triton(stamps=)``) and their
summary (``kernels.bench_attention_stamps``)."""

import pytest
import torch

from kernels.bench_attention_stamps import STAMP_NAMES, summarize


def _launch(t0: int, offsets_us: list[list[float]], programs: int = 4) -> torch.Tensor:
    """One launch's buffer: program p's stamp k at ``t0 + offsets_us[p][k]`` us (ns ints)."""
    buf = torch.zeros(programs + 1, 32, dtype=torch.int64)
    for p, offs in enumerate(offsets_us):
        for k, o in enumerate(offs):
            if o is not None:
                buf[p, k] = t0 + int(o * 1e3)
    return buf


def test_summary_offsets_gaps_and_spans():
    n = len(STAMP_NAMES)
    full = lambda base: [base + k for k in range(n)]  # noqa: E731 - stamps 1 us apart
    early_exit = [0.5] + [None] * (n - 1)  # a spare split: only its start
    calls = []
    for c in range(3):
        t0 = 1_000_000 + c * 20_000  # launches 20 us apart; each lasts 7 us (+ 2 us skew)
        calls.append(_launch(t0, [full(0.0), full(2.0), early_exit]))
    s = summarize(torch.stack(calls))
    assert s["launches"] == 2  # the first launch has no predecessor
    assert s["span_us"] == pytest.approx(9.0)  # last program's end: 2 + 7
    assert s["gap_us"] == pytest.approx(20.0 - 9.0)
    st = s["stamps_us"]
    assert st["start"] == {"first": 0.0, "median": pytest.approx(0.5), "last": pytest.approx(2.0)}
    assert st["end"]["first"] == pytest.approx(7.0) and st["end"]["last"] == pytest.approx(9.0)
    assert st["after_wait"]["median"] == pytest.approx(3.0)  # programs at 2 and 4 us


def test_summary_skips_unwritten_launches():
    n = len(STAMP_NAMES)
    empty = torch.zeros(3, 32, dtype=torch.int64)
    one = _launch(5_000, [[float(k) for k in range(n)]], programs=2)
    s = summarize(torch.stack([one, empty, one.clone()]))
    assert s["launches"] == 0 and s["gap_us"] is None and s["span_us"] is None


def _decode_case(ctx=300, bound=512, hq=32, hkv=8, d=128, bs=16):
    """One request's one-token decode attention with fused rope, on the GPU: a launcher
    ``run(stamps=None) -> (out, k_cache, v_cache)`` on fresh copies of the caches."""
    from kernels.paged_attention import paged_attention_triton
    from kernels.rope_inline import DecodeRope

    if not torch.cuda.is_available():
        pytest.fail("GPU test without a GPU")
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    per = bound // bs
    k_cache = torch.randn(per, bs, hkv, d, device=dev, dtype=dt, generator=g)
    v_cache = torch.randn(per, bs, hkv, d, device=dev, dtype=dt, generator=g)
    bt = torch.randperm(per, device=dev, dtype=torch.int32, generator=g).view(1, per)
    qkv = torch.randn(1, (hq + 2 * hkv) * d, device=dev, dtype=dt, generator=g)
    q = qkv[:, : hq * d].view(1, hq, d)
    k = qkv[:, hq * d: (hq + hkv) * d].view(1, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(1, hkv, d)
    seq = torch.tensor([ctx + 1], device=dev, dtype=torch.int32)
    qsl = torch.tensor([0, 1], device=dev, dtype=torch.int32)
    pos = torch.tensor([ctx], device=dev)
    cs = torch.randn(bound, d, device=dev, generator=g)
    slot = bt[:, ctx // bs].long() * bs + ctx % bs

    def run(stamps=None):
        kc, vc = k_cache.clone(), v_cache.clone()
        torch.cuda.synchronize()  # the clones complete before a PDL launch reads them
        out = paged_attention_triton(q, kc, vc, bt, seq, qsl, 1, bound, d ** -0.5,
                                     rope=DecodeRope(pos, k, v, cs, slot), stamps=stamps)
        torch.cuda.synchronize()
        return out, kc, vc

    return run


@pytest.mark.gpu
def test_stamped_launch_matches_and_stamps_are_ordered():
    hkv = 8
    run = _decode_case(hkv=hkv)
    stamps = torch.zeros(hkv * 64 + 1, 32, device="cuda", dtype=torch.int64)
    plain, stamped = run(), run(stamps)
    assert all(torch.equal(a, b) for a, b in zip(plain, stamped))
    s = stamps[:, : len(STAMP_NAMES)].cpu()
    ran = s[:, STAMP_NAMES.index("end")] > 0
    assert int(ran.sum()) >= hkv  # every KV head's splits that had keys
    for a, b in (("start", "pre_wait"), ("pre_wait", "after_wait"), ("after_wait", "q_ready"),
                 ("q_ready", "tiles_done"), ("tiles_done", "end")):
        assert bool((s[ran, STAMP_NAMES.index(a)] <= s[ran, STAMP_NAMES.index(b)]).all()), (a, b)
    merged = s[:, STAMP_NAMES.index("merged")] > 0
    assert int(merged.sum()) == hkv  # one merging program a KV head


@pytest.mark.gpu
@pytest.mark.parametrize("ctx,bound", [(300, 512), (1000, 1024), (100, 4096)])
def test_preloaded_tile_gives_the_same_result(monkeypatch, ctx, bound):
    """``SYNCLESS_ATTN_PRELOAD`` 1/2 (the split's tile loaded before the PDL wait) against
    the L2-prefetch launch (0), PDL on: the same caches, and the same output (bitwise with 1;
    with 2 the launch takes 8 warps, whose softmax sums may round differently). ctx 100 of
    a 4096 bound: splits of several tiles, where the knob does not apply."""
    monkeypatch.setenv("SYNCLESS_PDL", "1")
    monkeypatch.setenv("SYNCLESS_ATTN_PRELOAD", "0")
    run = _decode_case(ctx=ctx, bound=bound)
    base = run()
    for n in ("1", "2"):
        monkeypatch.setenv("SYNCLESS_ATTN_PRELOAD", n)
        out, kc, vc = run()
        assert torch.equal(kc, base[1]) and torch.equal(vc, base[2]), n
        if n == "1" or bound == 4096:
            assert torch.equal(out, base[0]), n
        else:
            torch.testing.assert_close(out, base[0], atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("ctx,bound", [(300, 512), (3000, 4096)])
def test_one_pass_merge_gives_the_same_result(monkeypatch, ctx, bound):
    """``SYNCLESS_ATTN_MERGE=1`` against the two-pass merge, PDL on: the same caches, outputs
    within bf16 rounding (fp32 sums in another order), and the counters re-armed (a second
    launch, equal to the first)."""
    monkeypatch.setenv("SYNCLESS_PDL", "1")
    run = _decode_case(ctx=ctx, bound=bound)
    monkeypatch.setenv("SYNCLESS_ATTN_MERGE", "2")
    base = run()
    monkeypatch.setenv("SYNCLESS_ATTN_MERGE", "1")
    first, second = run(), run()
    for got in (first, second):
        assert torch.equal(got[1], base[1]) and torch.equal(got[2], base[2])
        torch.testing.assert_close(got[0], base[0], atol=2e-2, rtol=2e-2)
    assert torch.equal(first[0], second[0])
