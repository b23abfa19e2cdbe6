"""The FP8 (e4m3) KV cache's compiled kernels on CUDA (``-m gpu``), at Llama-3.1-8B's attention
shape (32 q heads, 8 KV heads, head dim 128, 16-token pages), against the references with the
same FP8 cache and against the bf16 cache's attention; every kernel call under
``torch.cuda.set_sync_debug_mode("error")``, the decode launch also inside a CUDA graph, and no
new variant compiled for other scale values. The interpreted and compile-only checks of the
same paths: ``tests/kernels/test_kernels_fp8_kv.py``. Imports fine on a CPU-only machine."""

import pytest
import torch

from kernels import reference as ref
from tests.kernels.test_kernels_fp8_kv import (
    FP8,
    SCALES,
    as_bytes,
    assert_keys_close,
    assert_close_scaled,
    attention_case,
    quantize,
    reference_attention,
    rel_err,
    rope_case,
    rope_expected,
)
from tests.kernels.test_kernels_gpu import capture, decode_lens, no_sync, use_kernel_settings

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

HQ, HKV, D = 32, 8, 128
BF16 = torch.bfloat16


def triton_attention(c, num_splits=None, fused_reduce=None, **scales):
    from kernels.paged_attention import paged_attention_triton

    scales = scales or dict(k_scale=c["k_scale"], v_scale=c["v_scale"])
    with no_sync():
        out = paged_attention_triton(
            c["q"], c["k_cache"], c["v_cache"], c["table"], c["seq"], c["qsl"], c["max_q"], c["bound"], c["scale"],
            num_splits=num_splits, fused_reduce=fused_reduce, **scales,
        )  # fmt: skip
    return out[: int(c["qsl_cpu"][-1])].float()


@pytest.mark.parametrize("k_scale,v_scale", SCALES)
def test_gpu_fp8_write_kv_and_rope_kv(k_scale, v_scale):
    from kernels.kv_write import write_kv_triton
    from kernels.rope_kv import rope_and_write_kv_triton
    from tests.kernels.test_kernels import cos_sin_cache

    t, nb, bs = 61, 40, 16
    g = torch.Generator(device="cuda").manual_seed(1)
    qkv = torch.rand(t, (HQ + 2 * HKV) * D, device="cuda", generator=g) * 2 - 1  # QKV-like rows
    qkv[:, HQ * D : (HQ + HKV) * D] *= 400 * k_scale  # past 448 where the scale is 2
    qkv[:, (HQ + HKV) * D :] *= 400 * v_scale
    qkv = qkv.to(BF16)
    q, k, v = (qkv[:, : HQ * D], qkv[:, HQ * D : (HQ + HKV) * D], qkv[:, (HQ + HKV) * D :])
    q, k, v = q.view(t, HQ, D), k.view(t, HKV, D), v.view(t, HKV, D)
    slots = torch.randperm(nb * bs, device="cuda", generator=g)[:t]
    slots[::7] = -1
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    k_cache = quantize(torch.randn(nb, bs, HKV, D, device="cuda", generator=g), 1.0)
    v_cache = quantize(torch.randn(nb, bs, HKV, D, device="cuda", generator=g), 1.0)
    k_exp, v_exp = k_cache.clone(), v_cache.clone()
    ref.write_kv_reference(k, v, k_exp, v_exp, slots, **scales)
    with no_sync():
        write_kv_triton(k, v, k_cache, v_cache, slots, **scales)
    assert k_cache.dtype == FP8 and torch.equal(as_bytes(k_cache), as_bytes(k_exp))
    assert torch.equal(as_bytes(v_cache), as_bytes(v_exp))

    positions = torch.randint(0, 4000, (t,), device="cuda", generator=g)
    cache, w = cos_sin_cache(4096, D).cuda(), (1 + 0.1 * torch.randn(D, device="cuda", generator=g)).to(BF16)
    q_exp = ref.rope_and_write_kv_reference(positions, q, k, v, cache, k_exp, v_exp, slots, w, w, 1e-6, **scales)
    with no_sync():
        q_out = rope_and_write_kv_triton(positions, q, k, v, cache, k_cache, v_cache, slots, w, w, 1e-6, **scales)
    torch.testing.assert_close(q_out, q_exp, atol=2e-2, rtol=2e-2)
    assert_keys_close(k_cache, k_exp)
    assert torch.equal(as_bytes(v_cache), as_bytes(v_exp))


def gpu_case(shape, k_scale, v_scale):
    if shape == "decode":
        lens = decode_lens(24)
        return attention_case([1] * 24, lens, HQ, HKV, BF16, k_scale, v_scale, d=D, slack=100, device="cuda")
    if shape == "verify":  # spec-decode windows: one query block a request, q_len > 1
        lens = decode_lens(16, seed=2)
        q_lens = [1 + i % 4 for i in range(16)]
        seq = [max(s, q) for s, q in zip(lens, q_lens)]
        return attention_case(q_lens, seq, HQ, HKV, BF16, k_scale, v_scale, d=D, slack=40, device="cuda")
    # decode rows, a fresh 300-token prefill, a chunked prefill (ctx 871), an empty request
    q_lens, seq = [1, 300, 1, 4, 129, 1, 0, 17], [17, 300, 64, 50, 1000, 1, 9, 17]
    return attention_case(q_lens, seq, HQ, HKV, BF16, k_scale, v_scale, d=D, slack=100, device="cuda")


@pytest.mark.parametrize("k_scale,v_scale", SCALES)
@pytest.mark.parametrize(
    "shape,splits,fused_reduce",
    [
        ("decode", None, None),
        ("decode", 1, None),
        ("decode", 7, True),
        ("decode", 16, False),
        ("verify", 4, True),
        ("mixed", 1, None),
        ("mixed", 4, None),
    ],
)
def test_gpu_fp8_paged_attention(shape, splits, fused_reduce, k_scale, v_scale):
    c = gpu_case(shape, k_scale, v_scale)
    expect = reference_attention(c)
    assert_close_scaled(triton_attention(c, splits, fused_reduce), expect, BF16)
    assert rel_err(expect, reference_attention(c, c["k_data"], c["v_data"])) < 0.06  # e4m3's error


def rope_gpu_case(lens, k_scale=0.5, v_scale=2.0, bound=None):
    return rope_case(BF16, k_scale, v_scale, lens, heads=(HQ, HKV, D), pad_reqs=2, device="cuda", bound=bound)


@pytest.mark.parametrize("pdl", ["on", "off"])
@pytest.mark.parametrize("n,bound", [(1, None), (4, None), (7, 1024), (3, 300)])
def test_gpu_fp8_decode_attention_with_rope(monkeypatch, pdl, n, bound):
    """The engine's decode launch (``ops.rope_and_attention``: rope, KV write and attention in
    one launch; 128- and 64-key tiles, one and two stages)."""
    from kernels import ops

    use_kernel_settings(monkeypatch, pdl=pdl)
    c = rope_gpu_case(decode_lens(n, max_len=min(bound or 2000, 2000) - 8, seed=n), bound=bound)
    exp, kc_exp, vc_exp = rope_expected(c)
    kc, vc = c["k_cache"].clone(), c["v_cache"].clone()
    args = (c["positions"], c["q"], c["k"], c["v"], c["cs"], kc, vc, c["slots"], c["table"], c["seq"], c["qsl"])
    assert ops.rope_in_attention_applies(n + 1, 1, c["bound"])
    qsl_cpu = c["qsl"].cpu()  # (a host copy: before the no-sync region)
    with no_sync():
        out = ops.rope_and_attention(
            *args, qsl_cpu, 1, c["bound"], c["scale"], c["qw"], c["kw"], 1e-6,
            k_scale=c["k_scale"], v_scale=c["v_scale"],
        )  # fmt: skip
    assert_close_scaled(out[:n], exp[:n], BF16)
    assert_keys_close(kc, kc_exp)
    assert torch.equal(as_bytes(vc), as_bytes(vc_exp))


def test_gpu_fp8_decode_in_cuda_graph_and_one_variant_for_every_scale():
    """A captured FP8 decode launch (rope inside) replayed with new lengths and queries; then
    eager launches with other scale values compile nothing new (runtime float32 arguments)."""
    from kernels.paged_attention import paged_attention_triton
    from kernels.rope_inline import DecodeRope
    from workers.compile_watch import CompileWatch

    n, bound = 8, 2048
    c = rope_gpu_case([bound - 8] * n, bound=bound)
    kc, vc = c["k_cache"].clone(), c["v_cache"].clone()

    def step(k_scale=c["k_scale"], v_scale=c["v_scale"]):
        scales = dict(k_scale=k_scale, v_scale=v_scale)
        rope = DecodeRope(c["positions"], c["k"], c["v"], c["cs"], c["slots"], c["qw"], c["kw"], 1e-6, **scales)
        return paged_attention_triton(
            c["q"], kc, vc, c["table"], c["seq"], c["qsl"], 1, bound, c["scale"], rope=rope, **scales
        )

    graph, out = capture(step)
    for seed in range(3):  # only device values change between replays
        lens = torch.tensor(decode_lens(n, max_len=bound - 8, seed=seed), dtype=torch.int32)
        c["seq"][:n].copy_(lens.cuda())
        c["positions"][:n].copy_((lens - 1).cuda())
        slots = c["table"][torch.arange(n), (lens - 1) // 16].long().cpu() * 16 + (lens - 1) % 16
        c["slots"][:n].copy_(slots.cuda())
        c["q"].copy_(torch.randn_like(c["q"]))
        kc.copy_(c["k_cache"]), vc.copy_(c["v_cache"])
        with no_sync():
            graph.replay()
        torch.cuda.synchronize()
        exp, kc_exp, _ = rope_expected(c)
        assert_close_scaled(out[:n], exp[:n], BF16)
        assert_keys_close(kc, kc_exp)
    watch = CompileWatch()
    assert watch.install()
    try:
        for scales in ((0.25, 3.0), (1.0, 1.0), (7.5, 0.125)):
            step(*scales)
        torch.cuda.synchronize()
    finally:
        watch.uninstall()
    assert watch.variants == [], watch.variants
