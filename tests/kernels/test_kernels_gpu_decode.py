"""Decode-path kernels added for batch-1 latency, on CUDA (``-m gpu``): the split Triton
argmax against ``torch.argmax``, the skinny GEMM with its bulk L2 prefetch of each
program's weight rows (eagerly and inside a CUDA graph) and the one-launch step-input
preparation against its torch reference. Every call runs under
``torch.cuda.set_sync_debug_mode("error")``. Imports fine on a CPU-only machine."""

import pytest
import torch

from tests.kernels.test_kernels_gpu import (
    no_sync,
    reference_fp64,
    rel_err,
    skinny_inputs,
    use_kernel_settings,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("rows,vocab", [(1, 128256), (7, 151936), (256, 151936), (3, 1000)])
def test_argmax_matches_torch(rows, vocab):
    from kernels.argmax import argmax_triton

    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, vocab, device="cuda", generator=g) * 4
    x[0, vocab - 1] = 1e4  # the winner in the last, ragged tile
    if rows > 2:
        x[1, 5] = x[1, vocab // 2] = 1e4  # a tie across splits: the lower index
        x[2, vocab // 3] = float("nan")
    with no_sync():
        got = argmax_triton(x)
        got_bf16 = argmax_triton(x.to(torch.bfloat16))
    assert torch.equal(got, x.argmax(dim=-1))
    assert torch.equal(got_bf16, x.to(torch.bfloat16).argmax(dim=-1))


@pytest.mark.parametrize("preload", [1, 2])
@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("variant", ["plain", "norm_res", "norm_res_act", "norm_res_act_pairs"])
@pytest.mark.parametrize("n,k", [(4096, 1024), (1000, 1000), (2 * 1042, 4096)])
def test_skinny_linear_peeled_chunks_under_pdl(n, k, variant, m, preload, monkeypatch):
    """Leading K chunks loaded before the PDL wait (``preload``), PDL on: equal to the
    reference, K = 1000 and 1024 with one chunk too (nothing past K is read)."""
    from kernels.skinny_gemm import fallback_config, skinny_linear_triton

    use_kernel_settings(monkeypatch, pdl="on")
    x, w, kw = skinny_inputs(m, n, k, variant)
    # The peeled chunks read the weights before the PDL wait, which kernels.pdl allows
    # because no kernel writes weights. Here the kernel just before the launch is the one
    # that wrote them ("plain": w is created last), and before the wait nothing makes its
    # writes visible. Without this synchronize the plain case (1000x1000, M 8, one peeled
    # chunk) failed once and passed on a rerun: a race of this
    # test's set-up, not of the engine, whose weights are written at load time.
    torch.cuda.synchronize()
    cfg = dict(fallback_config(m), preload=preload)
    if m == 1:  # the FMA path's tuned chunk: K <= 1024 is one chunk
        cfg["block_k"] = 1024
    with no_sync():
        y, _ = skinny_linear_triton(x, w, config=cfg, **kw)
    assert rel_err(y, reference_fp64(x, w, kw)[0]) < 1e-2


def test_skinny_linear_in_cuda_graph():
    from kernels.skinny_gemm import fallback_config, skinny_linear_triton

    x, w, kw = skinny_inputs(1, 6144, 1024, "norm_res_act")
    cfg = fallback_config(1)
    xs = x.clone()
    skinny_linear_triton(xs, w, config=cfg, **kw)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, _ = skinny_linear_triton(xs, w, config=cfg, **kw)
    for _ in range(3):
        xs.copy_(torch.randn_like(xs))
        g.replay()
        torch.cuda.synchronize()
        assert rel_err(out, reference_fp64(xs, w, kw)[0]) < 1e-2


@pytest.mark.parametrize(
    "q_lens,short",
    [([1], False), ([1] * 64, False), ([3, 1, 17, 5], True), ([1, 1, 5, 1, 2, 1, 9] * 5 + [3, 1], False)],
)
def test_prepare_inputs_matches_reference(q_lens, short):
    from kernels import reference as ref
    from kernels.input_prep import prepare_inputs_triton
    from tests.kernels.test_kernels_input_prep import make_case

    case = [t.cuda() if torch.is_tensor(t) else t for t in make_case(q_lens, short_capacity=short)]
    with no_sync():
        got = prepare_inputs_triton(*case)
    for g_, w in zip(got, ref.prepare_inputs_reference(*case)):
        assert g_.dtype == w.dtype and torch.equal(g_, w)


@pytest.mark.parametrize(
    "cfg",
    [
        dict(block_n=4, block_k=1024, num_warps=4, ctas_per_sm=2),
        dict(block_n=8, block_k=512, num_warps=8, ctas_per_sm=4),
        dict(block_n=2, block_k=2048, num_warps=8, ctas_per_sm=4),
    ],
)
@pytest.mark.parametrize("variant", ["plain", "norm_res", "norm_res_act", "norm_act_bias"])
@pytest.mark.parametrize("n,k", [(6144, 4096), (1000, 1000), (2 * 1042, 14336)])
def test_persistent_gemv_matches_fp64(n, k, variant, cfg):
    """Every row block of every program's flat walk, ragged N and K tails, the residual store."""
    from kernels.gemv import gemv_triton

    x, w, kw = skinny_inputs(1, n, k, variant)
    with no_sync():
        y, new_res = gemv_triton(x, w, config=cfg, **kw)
    y_exp, res_exp = reference_fp64(x, w, kw)
    assert rel_err(y, y_exp) < 1e-2
    if "residual" in kw:
        torch.testing.assert_close(new_res, (x.float() + kw["residual"].float()).to(x.dtype))


def test_persistent_gemv_pdl_chain_in_cuda_graph(monkeypatch):
    """PDL on: a graph chain where each GEMV reads the one before (a dependency the early
    weight load must not break); replays match the fp64 chain."""
    from kernels.gemv import gemv_triton

    use_kernel_settings(monkeypatch, pdl="on")
    n = 2048
    ws = [(torch.randn(n, n, device="cuda") / n**0.5).to(torch.bfloat16) for _ in range(4)]
    x = torch.randn(1, n, device="cuda", dtype=torch.bfloat16)

    def chain(h):
        for w in ws:
            h, _ = gemv_triton(h, w)
        return h

    chain(x)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = chain(x)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        h = x.double()
        for w in ws:
            h = (h @ w.double().T).to(torch.bfloat16).double()
        assert rel_err(out, h) < 2e-2


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("hq,hkv", [(16, 8), (32, 8), (8, 8)])
@pytest.mark.parametrize("lens", [[512], [1, 16, 17, 64, 65, 100, 511, 4000]])
def test_decode_attention_with_rope_matches_reference(qk_norm, hq, hkv, lens):
    """Rope + KV write inside the attention launch (default splits, fused merge) equals the
    unfused reference on the same bf16 inputs, head_dim 128; padding rows untouched."""
    from kernels.paged_attention import paged_attention_triton
    from kernels.rope_inline import DecodeRope
    from tests.kernels.test_kernels_attention_rope import expected, make_case

    c = make_case(lens, hq, hkv, 128, torch.bfloat16, qk_norm, pad_reqs=2, device="cuda")
    kc, vc = c["k_cache"].clone(), c["v_cache"].clone()
    rope = DecodeRope(c["positions"], c["k"], c["v"], c["cs"], c["slots"], c["qw"], c["kw"], 1e-6)
    with no_sync():
        out = paged_attention_triton(
            c["q"], kc, vc, c["table"], c["seq"], c["qsl"], 1, c["bound"], c["scale"], rope=rope
        )
    exp, kc_exp, vc_exp = expected(c)
    n = len(lens)
    torch.testing.assert_close(out[:n].float(), exp[:n].float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(kc, kc_exp, atol=2e-2, rtol=2e-2)
    assert torch.equal(vc, vc_exp)


def test_decode_attention_with_rope_graph_chain(monkeypatch):
    """Three layers' attention with the rope prologue in a CUDA graph with PDL on, each
    layer's q made from the one before: replays with new inputs match the reference."""
    from kernels.paged_attention import paged_attention_triton
    from kernels.rope_inline import DecodeRope
    from tests.kernels.test_kernels_attention_rope import expected, make_case

    use_kernel_settings(monkeypatch, pdl="on")
    c = make_case([37, 300, 1], 32, 8, 128, torch.bfloat16, True, device="cuda")
    kc0, vc0 = c["k_cache"].clone(), c["v_cache"].clone()
    qkv0 = torch.cat([c["q"].flatten(1), c["k"].flatten(1), c["v"].flatten(1)], 1)
    qkv = qkv0.clone()
    nq, nk = 32 * 128, 8 * 128

    def layers():
        x = qkv
        for _ in range(3):
            t = x.shape[0]
            q, k, v = x[:, :nq].view(t, 32, 128), x[:, nq : nq + nk].view(t, 8, 128), x[:, nq + nk :].view(t, 8, 128)
            rope = DecodeRope(c["positions"], k, v, c["cs"], c["slots"], c["qw"], c["kw"], 1e-6)
            o = paged_attention_triton(
                q, c["k_cache"], c["v_cache"], c["table"], c["seq"], c["qsl"], 1, c["bound"], c["scale"], rope=rope
            )
            x = torch.cat([o.flatten(1), x[:, nq:]], 1)  # the next layer's q: this output
        return x

    layers()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = layers()
    for seed in range(2):
        qkv.copy_(
            torch.randn(qkv.shape, generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda").to(
                qkv.dtype
            )
        )
        c["k_cache"].copy_(kc0)
        c["v_cache"].copy_(vc0)
        g.replay()
        torch.cuda.synchronize()
        x = qkv.clone()
        ref_c = dict(c, k_cache=kc0.clone(), v_cache=vc0.clone())
        for _ in range(3):
            t = x.shape[0]
            ref_c.update(
                q=x[:, :nq].view(t, 32, 128), k=x[:, nq : nq + nk].view(t, 8, 128), v=x[:, nq + nk :].view(t, 8, 128)
            )
            o, ref_c["k_cache"], ref_c["v_cache"] = expected(ref_c)
            x = torch.cat([o.flatten(1), x[:, nq:]], 1)
        n = 3
        torch.testing.assert_close(out[:n, :nq].float(), x[:n, :nq].float(), atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(c["k_cache"], ref_c["k_cache"], atol=2e-2, rtol=2e-2)
