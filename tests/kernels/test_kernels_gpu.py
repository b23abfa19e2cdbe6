"""The compiled Triton kernels on CUDA against ``kernels.reference`` (``-m gpu``).

Same comparisons as ``tests/kernels/test_kernels.py`` at realistic sizes and bf16
tolerance, every kernel call under ``torch.cuda.set_sync_debug_mode("error")``
(a host sync inside a kernel wrapper raises), plus CUDA-graph capture/replay
of decode attention with device ``seq_lens`` changed between replays.
Imports fine on a CPU-only machine; every test is marked ``gpu``.
"""

import contextlib
import random

import pytest
import torch
import triton

from kernels import reference as ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BF16 = dict(atol=2e-2, rtol=2e-2)
TOL = {torch.bfloat16: BF16, torch.float16: dict(atol=5e-3, rtol=5e-3), torch.float32: dict(atol=1e-4, rtol=1e-4)}


def use_kernel_settings(monkeypatch, **changes):
    """The installed ``KernelSettings`` with ``changes`` for the rest of the test (as a worker
    installs its config's kernel options)."""
    from dataclasses import replace

    from kernels import settings

    monkeypatch.setattr(settings, "_installed", replace(settings.current(), **changes))


@contextlib.contextmanager
def no_sync():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def capture(step):
    """``step()`` in a CUDA graph, after one warm-up call on a side stream (its kernels compile
    outside the capture); returns ``(graph, the captured call's output)``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def make_attention_case(
    q_lens, seq_lens, hq, hkv, d=128, bs=16, dtype=torch.bfloat16, pad_tokens=0, bound=None, seed=0
):
    """Random paged KV on CUDA; unused block-table entries are -1 (must never be read)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    ub = bound or max(seq_lens)
    width = triton.cdiv(ub, bs) + 1
    num_blocks = len(q_lens) * width + 3
    kv_shape = (num_blocks, bs, hkv, d)
    k_cache = torch.randn(kv_shape, generator=g, device="cuda").to(dtype)
    v_cache = torch.randn(kv_shape, generator=g, device="cuda").to(dtype)
    perm = torch.randperm(num_blocks, generator=g, device="cuda")[: len(q_lens) * width]
    block_table = perm.view(len(q_lens), width).to(torch.int32)
    for r, s in enumerate(seq_lens):
        block_table[r, triton.cdiv(s, bs) :] = -1
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    q = torch.randn(int(qsl[-1]) + pad_tokens, hq, d, generator=g, device="cuda").to(dtype)
    return dict(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=block_table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        qsl_cpu=qsl,
        query_start_loc=qsl.cuda(),
        max_query_len=max(q_lens),
        max_seq_len_upper_bound=ub,
        scale=d**-0.5,
    )


def triton_attention(c, num_splits=None, scale=None, fused_reduce=None):
    from kernels.paged_attention import paged_attention_triton

    with no_sync():
        return paged_attention_triton(
            c["q"],
            c["k_cache"],
            c["v_cache"],
            c["block_table"],
            c["seq_lens"],
            c["query_start_loc"],
            c["max_query_len"],
            c["max_seq_len_upper_bound"],
            c["scale"] if scale is None else scale,
            num_splits=num_splits,
            fused_reduce=fused_reduce,
        )


def reference_attention(c):
    return ref.paged_attention_reference(
        c["q"],
        c["k_cache"],
        c["v_cache"],
        c["block_table"].clamp(min=0),
        c["seq_lens"],
        c["query_start_loc"],
        c["qsl_cpu"],
        c["max_seq_len_upper_bound"],
        c["scale"],
    )


def check_attention(c, num_splits=None, fused_reduce=None):
    n = int(c["qsl_cpu"][-1])
    out = triton_attention(c, num_splits, fused_reduce=fused_reduce)[:n].float()
    torch.testing.assert_close(out, reference_attention(c)[:n].float(), **TOL[c["q"].dtype])


def decode_lens(n, bs=16, max_len=2000, seed=0):
    rnd = random.Random(seed)
    edges = [1, bs - 1, bs, bs + 1, 64, 65, 4 * bs, 4 * bs + 1]
    return (edges + [rnd.randint(1, max_len) for _ in range(n)])[:n]


@pytest.mark.parametrize("hq,hkv", [(8, 8), (32, 8), (64, 8)])  # GQA 1, 4, 8
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_paged_attention_decode(hq, hkv, d, num_splits):
    lens = decode_lens(24)
    c = make_attention_case([1] * len(lens), lens, hq, hkv, d=d, pad_tokens=8, bound=2100)
    check_attention(c, num_splits)


@pytest.mark.parametrize("fused_reduce", [True, False])
@pytest.mark.parametrize("hq,hkv", [(8, 8), (32, 8), (16, 8)])
def test_paged_attention_decode_fused_vs_kernel_reduce(hq, hkv, fused_reduce):
    from kernels.paged_attention import arrival_counters

    lens = decode_lens(40, max_len=4000, seed=5)
    c = make_attention_case([1] * len(lens), lens, hq, hkv, pad_tokens=3, bound=4096, seed=6)
    for splits in (None, 3, 16):
        check_attention(c, splits, fused_reduce=fused_reduce)
    torch.cuda.synchronize()
    assert int(arrival_counters(c["q"].device, 1).count_nonzero()) == 0  # all re-armed


@pytest.mark.parametrize("hq,hkv", [(8, 8), (32, 8), (64, 8)])
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("bs", [16, 64])
def test_paged_attention_mixed_batch(hq, hkv, num_splits, bs):
    # decode rows, a fresh 300-token prefill, spec-decode-like rows, a chunked prefill
    # (ctx 871) crossing blocks, an empty request, and a 17-token prefill
    q_lens = [1, 300, 1, 4, 129, 1, 0, 17]
    seq_lens = [17, 300, 64, 50, 1000, 1, 9, 17]
    c = make_attention_case(q_lens, seq_lens, hq, hkv, bs=bs, pad_tokens=5, bound=1100)
    check_attention(c, num_splits)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_paged_attention_other_dtypes(dtype):
    c = make_attention_case([1, 40, 1, 3], [500, 40, 33, 80], 32, 8, dtype=dtype)
    check_attention(c, 1)
    check_attention(c, 3)


def test_paged_attention_wrong_scale_detected():
    c = make_attention_case([1, 1, 20], [300, 31, 20], 32, 8)
    out = triton_attention(c, scale=c["scale"] * 1.5)[:22].float()
    assert not torch.allclose(out, reference_attention(c)[:22].float(), **BF16)


@pytest.mark.parametrize("num_splits", [None, 1])
def test_paged_attention_cuda_graph_decode(num_splits):
    from kernels.paged_attention import paged_attention_triton

    nreq, bound = 8, 2048
    c = make_attention_case([1] * nreq, [bound] * nreq, 32, 8, bound=bound, seed=3)

    def step():
        return paged_attention_triton(
            c["q"],
            c["k_cache"],
            c["v_cache"],
            c["block_table"],
            c["seq_lens"],
            c["query_start_loc"],
            1,
            bound,
            c["scale"],
            num_splits=num_splits,
        )

    graph, out = capture(step)
    for seed in range(3):  # only device values change between replays
        c["seq_lens"].copy_(torch.tensor(decode_lens(nreq, max_len=bound, seed=seed)))
        c["q"].copy_(torch.randn_like(c["q"]))
        with no_sync():
            graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), reference_attention(c).float(), **BF16)


def test_write_kv():
    from kernels.kv_write import write_kv_triton

    t, h, d, nb, bs = 37, 8, 128, 40, 16
    fused = torch.randn(t, 48 * d, device="cuda", dtype=torch.bfloat16)  # QKV-like rows
    key, value = fused[:, 32 * d : 40 * d].view(t, h, d), fused[:, 40 * d :].view(t, h, d)
    slots = torch.randperm(nb * bs, device="cuda")[:t]
    slots[::5] = -1
    k_cache = torch.randn(nb, bs, h, d, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    k_exp, v_exp = k_cache.clone(), v_cache.clone()
    ref.write_kv_reference(key, value, k_exp, v_exp, slots)
    with no_sync():
        write_kv_triton(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_exp) and torch.equal(v_cache, v_exp)


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("shape", [(37, 4096), (37 * 32, 128), (5, 3000)])
def test_rms_norm(with_residual, shape):
    from kernels.rms_norm import rms_norm_triton

    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(shape[-1], device="cuda")).to(torch.bfloat16)
    res = torch.randn_like(x) if with_residual else None
    with no_sync():
        out, new_res = rms_norm_triton(x, w, 1e-6, res)
    exp_out, exp_res = ref.rms_norm_reference(x, w, 1e-6, res)
    torch.testing.assert_close(out, exp_out, **BF16)
    if with_residual:
        torch.testing.assert_close(new_res, exp_res, **BF16)


def test_rotary_embedding():
    from kernels.rotary import rotary_embedding_triton

    t, hq, hk, d = 37, 32, 8, 128
    qkv = torch.randn(t, (hq + 2 * hk) * d, device="cuda", dtype=torch.bfloat16)
    q, k = qkv[:, : hq * d].view(t, hq, d), qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    inv = 1.0 / 1e6 ** (torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d)
    f = torch.arange(4096, device="cuda", dtype=torch.float32)[:, None] * inv[None, :]
    cache = torch.cat([f.cos(), f.sin()], dim=-1)
    positions = torch.randint(0, 4096, (t,), device="cuda")
    with no_sync():
        q_out, k_out = rotary_embedding_triton(positions, q, k, cache)
    q_exp, k_exp = ref.rotary_embedding_reference(positions, q, k, cache)
    torch.testing.assert_close(q_out, q_exp, **BF16)
    torch.testing.assert_close(k_out, k_exp, **BF16)


@pytest.mark.parametrize("batch,seq", [(1, 32768), (8, 8192), (64, 4096), (256, 1024)])
def test_decode_bandwidth_report(batch, seq):
    """Prints achieved KV bandwidth (run with -s); asserts only correctness."""
    from kernels.paged_attention import paged_attention_triton

    hq, hkv, d = 32, 8, 128
    c = make_attention_case([1] * batch, [seq] * batch, hq, hkv, d=d, seed=4)
    args = (
        c["q"],
        c["k_cache"],
        c["v_cache"],
        c["block_table"],
        c["seq_lens"],
        c["query_start_loc"],
        1,
        seq,
        c["scale"],
    )
    ms = triton.testing.do_bench(lambda: paged_attention_triton(*args))
    kv_bytes = batch * seq * hkv * d * 2 * c["k_cache"].element_size()
    print(f"\ndecode batch={batch} seq={seq}: {ms * 1e3:.1f} us, {kv_bytes / ms / 1e9:.0f} GB/s KV read")
    if batch * seq <= 65536:
        check_attention(c)


def rel_err(out, ref_):
    out, ref_ = out.double(), ref_.double()
    return float((out - ref_).norm() / ref_.norm().clamp_min(1e-30))


@pytest.mark.parametrize("t,inter", [(37, 14336), (5, 3072), (1, 1000)])
def test_silu_and_mul(t, inter):
    from kernels.activation import silu_and_mul_triton

    x = 3 * torch.randn(t, 2 * inter, device="cuda", dtype=torch.bfloat16)
    with no_sync():
        out = silu_and_mul_triton(x)
    # same rounding as F.silu(g) * u on the GPU: bit-identical up to exp's last ulp
    torch.testing.assert_close(out, ref.silu_and_mul_reference(x), atol=1e-2, rtol=8e-3)


@pytest.mark.parametrize("hq,hk,qk_norm", [(32, 8, False), (16, 8, True), (8, 8, False), (64, 8, True)])
def test_rope_and_write_kv(hq, hk, qk_norm):
    from kernels.rope_kv import rope_and_write_kv_triton

    t, d, nb, bs = 45, 128, 40, 16
    qkv = torch.randn(t, (hq + 2 * hk) * d, device="cuda", dtype=torch.bfloat16)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    v = qkv[:, (hq + hk) * d :].view(t, hk, d)
    inv = 1.0 / 1e6 ** (torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d)
    f = torch.arange(4096, device="cuda", dtype=torch.float32)[:, None] * inv[None, :]
    cache = torch.cat([f.cos(), f.sin()], dim=-1)
    positions = torch.randint(0, 4096, (t,), device="cuda")
    slots = torch.randperm(nb * bs, device="cuda")[:t]
    slots[::7] = -1
    qw = (1 + 0.1 * torch.randn(d, device="cuda")).to(torch.bfloat16) if qk_norm else None
    kw = (1 + 0.1 * torch.randn(d, device="cuda")).to(torch.bfloat16) if qk_norm else None
    k_cache = torch.randn(nb, bs, hk, d, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    k_exp, v_exp = k_cache.clone(), v_cache.clone()
    q_exp = ref.rope_and_write_kv_reference(positions, q, k, v, cache, k_exp, v_exp, slots, qw, kw, 1e-6)
    with no_sync():
        q_out = rope_and_write_kv_triton(positions, q, k, v, cache, k_cache, v_cache, slots, qw, kw, 1e-6)
    torch.testing.assert_close(q_out, q_exp, **BF16)
    torch.testing.assert_close(k_cache, k_exp, **BF16)
    assert torch.equal(v_cache, v_exp)


SKINNY_SHAPES = {  # (N, K, variant) of the decode projections of Llama-3.1-8B and Qwen3-0.6B
    "8b_qkv": (6144, 4096, "norm_res"),
    "8b_o": (4096, 4096, "plain"),
    "8b_gate_up": (28672, 4096, "norm_res_act"),
    "8b_down": (4096, 14336, "plain"),
    "06b_qkv": (4096, 1024, "norm_res"),
    "06b_gate_up": (6144, 1024, "norm_res_act"),
    "06b_o": (1024, 2048, "plain"),
    "odd": (1000, 1000, "norm_act_bias"),
}


def skinny_inputs(m, n, k, variant, dtype=torch.bfloat16):
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(dtype)
    kw = {}
    if "norm" in variant:
        kw["norm_weight"] = (1 + 0.1 * torch.randn(k, device="cuda")).to(dtype)
        kw["eps"] = 1e-6
    if "res" in variant:
        kw["residual"] = torch.randn(m, k, device="cuda", dtype=dtype)
    if "act" in variant:
        kw["act"] = "silu_and_mul_pairs" if "pairs" in variant else "silu_and_mul"
    if "bias" in variant:
        kw["bias"] = torch.randn(n, device="cuda", dtype=dtype)
    return x, w, kw


def reference_fp64(x, w, kw):
    """The unfused math in float64 on the same 16-bit inputs (a rounding-free oracle)."""
    up = {k_: (v.double() if torch.is_tensor(v) else v) for k_, v in kw.items()}
    return ref.skinny_linear_reference(x.double(), w.double(), **up)


@pytest.mark.parametrize("m", [1, 2, 8, 16, 33, 64])
@pytest.mark.parametrize("shape", list(SKINNY_SHAPES))
def test_skinny_linear(shape, m):
    from kernels.skinny_gemm import MAX_M, skinny_linear_triton

    if m > MAX_M:
        pytest.skip(f"M {m} > MAX_M {MAX_M}")
    n, k, variant = SKINNY_SHAPES[shape]
    x, w, kw = skinny_inputs(m, n, k, variant)
    with no_sync():
        y, new_res = skinny_linear_triton(x, w, **kw)
    y_exp, res_exp = reference_fp64(x, w, kw)
    assert rel_err(y, y_exp) < 1e-2, rel_err(y, y_exp)  # bf16 operands: 1e-3..1e-2
    if "residual" in kw:
        torch.testing.assert_close(new_res.double(), res_exp, atol=0, rtol=8e-3)


def test_skinny_linear_fp32_logits_and_cuda_graph():
    from kernels.skinny_gemm import skinny_linear_triton

    x, w, _ = skinny_inputs(4, 2000, 1024, "plain")
    with no_sync():
        y, _ = skinny_linear_triton(x, w, out_dtype=torch.float32)
    assert y.dtype == torch.float32
    # widened after rounding to bf16, as linear(...).float() is
    assert torch.equal(y, y.to(torch.bfloat16).float())
    assert rel_err(y, x.double() @ w.double().T) < 1e-2
    xs = x.clone()
    g = torch.cuda.CUDAGraph()
    skinny_linear_triton(xs, w)
    with torch.cuda.graph(g):
        out, _ = skinny_linear_triton(xs, w)
    for _ in range(2):
        xs.copy_(torch.randn_like(xs))
        g.replay()
        torch.cuda.synchronize()
        assert rel_err(out, xs.double() @ w.double().T) < 1e-2


def _tune_candidates():
    from benchmarks.kernels.skinny_tune import TUNE_CANDIDATES

    return [(mc, c) for mc, cs in TUNE_CANDIDATES.items() for c in cs]


@pytest.mark.parametrize("variant", ["plain", "norm_res", "norm_res_act"])
@pytest.mark.parametrize("cand", _tune_candidates(), ids=lambda c: f"m{c[0]}-{'-'.join(map(str, c[1]))}")
def test_skinny_linear_every_tuning_candidate(cand, variant):
    """Whatever ``benchmarks.kernels.bench --tune`` picks has been checked here (K=1000: masked tail)."""
    from kernels.skinny_gemm import skinny_linear_triton

    mc, (use_dot, bn, bk, nw, st, pf) = cand
    cfg = dict(use_dot=use_dot, block_n=bn, block_k=bk, num_warps=nw, num_stages=st, prefetch=pf)
    for m, k in ((1 if mc == 1 else 5, 1024), (1 if mc == 1 else 16, 1000)):
        x, w, kw = skinny_inputs(m, 2 * 1040, k, variant)
        with no_sync():
            y, _ = skinny_linear_triton(x, w, config=cfg, **kw)
        assert rel_err(y, reference_fp64(x, w, kw)[0]) < 1e-2


def test_skinny_tuned_entries_on_their_shapes():
    """Every entry of the shipped tuning table, on its own weight shape."""
    import json

    from kernels.skinny_gemm import TUNING_FILE, skinny_linear_triton

    if not TUNING_FILE.exists():
        pytest.skip("no kernels/skinny_tuning.json")
    entries = json.loads(TUNING_FILE.read_text())["entries"]
    variant = {
        "plain": "plain",
        "plain_f32": "plain",
        "norm": "norm_res",
        "norm_act": "norm_res_act",
        "norm_act_pairs": "norm_res_act_pairs",
    }
    from kernels.gemv import gemv_triton

    for key, cfg in entries.items():
        if cfg is None:
            continue
        kind, mc, nk = key.split("|")
        n, k = map(int, nk.split("x"))
        m = 1 if mc == "m1" else 16
        x, w, kw = skinny_inputs(m, n, k, variant[kind])
        if kind == "plain_f32":
            kw["out_dtype"] = torch.float32
        run = gemv_triton if cfg.get("kernel") == "gemv" else skinny_linear_triton
        with no_sync():
            y, _ = run(x, w, config=cfg, **kw)
        assert rel_err(y, reference_fp64(x, w, kw)[0]) < 1e-2, key


@pytest.mark.parametrize("rows", [1, 7, 256])
def test_exponential_race_matches_reference(rows):
    """Seeded draws over a Qwen-sized vocabulary equal the torch reference's, without a host sync.

    The noise is bit-identical; ``-log U`` may still differ by an ulp from torch's float32
    ``log``, which can flip a row whose two best scores are that close. So: every row with a
    clear winner (relative gap > 1e-4 in float64) must agree, and the kernel's pick must
    always score within 1e-5 of the row's best. (A float32 ``tl.log``, accurate only in
    absolute terms near U = 1 where the winners are, failed this on clear rows.)"""
    from kernels.sampling import exponential_race_triton

    g = torch.Generator(device="cuda").manual_seed(rows)
    vocab = 151936
    probs = torch.softmax(torch.randn(rows, vocab, device="cuda", generator=g) * 3, dim=-1)
    seeds = torch.randint(0, 2**62, (rows,), device="cuda", generator=g)
    pos = torch.randint(0, 40000, (rows,), device="cuda", generator=g)
    with no_sync():
        got = exponential_race_triton(probs, seeds, pos)
    want = ref.exponential_race_reference(probs, seeds, pos)
    score = probs.double() / -torch.log(ref.uniform_noise64(seeds, pos, vocab))
    top2 = score.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-4 * top2[:, 0]
    assert clear.float().mean() > 0.9  # the check below covers most rows
    picked = score.gather(1, got[:, None])[:, 0]
    ref_picked = score.gather(1, want[:, None])[:, 0]
    bad = ((top2[:, 0] - picked) > 1e-5 * top2[:, 0]).nonzero().flatten().tolist()
    ref_bad = ((top2[:, 0] - ref_picked) > 1e-5 * top2[:, 0]).nonzero().flatten().tolist()
    assert not bad and not ref_bad, f"kernel off the best on rows {bad}, reference on {ref_bad}"
    assert torch.equal(got[clear], want[clear])
