"""GPU tests of the mid-batch tile GEMM (``kernels.tile_gemm``): the kernels at the Qwen3-0.6B
decode shapes against the plain-torch reference, the layer dispatch taking them where a
tuning table says so, and greedy generation equal to transformers with them on."""

import json

import pytest
import torch

from tests.checkpoints import write_checkpoint
from tests.worker.test_gpu_engine import _hf_greedy, assert_greedy_equal

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cfg(bm, bn, bk, split, warps=4, stages=3):
    return dict(block_m=bm, block_n=bn, block_k=bk, split_k=split, num_warps=warps, num_stages=stages)


@cuda
@pytest.mark.parametrize("m", [32, 128, 200])
@pytest.mark.parametrize(
    "n,k,cfg,mode",
    [
        (4096, 1024, _cfg(64, 64, 64, 1), "plain"),  # qkv
        (1024, 2048, _cfg(64, 64, 128, 4), "plain"),  # o_proj, split-K
        (1024, 2048, _cfg(128, 64, 64, 8, warps=8), "add_norm"),
        (6144, 1024, _cfg(64, 128, 64, 1, warps=8), "act"),  # gate|up row pairs, act in the GEMM
        (6144, 1024, _cfg(64, 64, 64, 2), "act"),  # ... in the split sum
        (1024, 3072, _cfg(32, 32, 128, 2), "add_norm"),  # down
        (151936, 1024, _cfg(128, 128, 64, 1, warps=8), "logits"),
    ],
)
def test_tile_gemm_gpu_matches_reference(m, n, k, cfg, mode):
    from kernels import reference as ref
    from kernels.tile_gemm import tile_linear_add_norm_triton, tile_linear_reference, tile_linear_triton

    g = torch.Generator(device="cuda").manual_seed(m + n)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16)
    tol = dict(atol=2e-2, rtol=2e-2)
    if mode == "add_norm":
        res = torch.randn(m, n, device="cuda", generator=g).to(torch.bfloat16)
        nw = (torch.rand(n, device="cuda", generator=g) + 0.5).to(torch.bfloat16)
        out, new_res = tile_linear_add_norm_triton(x, w, cfg, res, nw, 1e-6)
        out_exp, res_exp = ref.rms_norm_reference(tile_linear_reference(x, w), nw, 1e-6, res)
        torch.testing.assert_close(new_res, res_exp, **tol)
        torch.testing.assert_close(out, out_exp, **tol)
        # the tile GEMM then the norm kernel: the same rounded sum (the new residual bit for
        # bit); the normalised output within one rounding (the sum of squares may reduce in
        # another order)
        from kernels.rms_norm import rms_norm_triton

        o2, r2 = rms_norm_triton(tile_linear_triton(x, w, cfg), nw, 1e-6, res)
        assert torch.equal(new_res, r2)
        torch.testing.assert_close(out, o2, atol=1e-2, rtol=8e-3)
        return
    act = "silu_and_mul_pairs" if mode == "act" else None
    out_dtype = torch.float32 if mode == "logits" else None
    y = tile_linear_triton(x, w, cfg, out_dtype=out_dtype, act=act)
    y_exp = tile_linear_reference(x, w, out_dtype=out_dtype, act=act)
    assert y.dtype == y_exp.dtype and y.shape == y_exp.shape
    torch.testing.assert_close(y.float(), y_exp.float(), **tol)
    if mode == "logits":
        assert torch.equal(y, y.to(torch.bfloat16).float())  # bf16 values, widened


@pytest.fixture(scope="module")
def tile_ckpt(tmp_path_factory):
    # the engine tests' checkpoint (small vocabulary: top-2 gaps above bf16 noise)
    return write_checkpoint(
        tmp_path_factory.mktemp("tile-llama"),
        "llama",
        hidden=256,
        heads=8,
        kv_heads=2,
        layers=2,
        vocab_size=96,
        max_pos=1024,
    )


def _tile_table(path, classes=(32,)):
    """A tuning table for the test checkpoint's projections (hidden 256, 8 x 32 q heads, 2 KV
    heads, intermediate 512, vocabulary 96): every path of the dispatch, split or not."""
    entries = {}
    for mc in classes:
        entries.update(
            {
                f"m{mc}|384x256": _cfg(32, 32, 64, 1),  # qkv
                f"m{mc}|256x256": _cfg(32, 32, 64, 2),  # o_proj (unfused use)
                f"add_norm|m{mc}|256x256": _cfg(32, 32, 64, 4),  # o_proj + post-attn norm
                f"m{mc}|1024x256": _cfg(32, 64, 64, 2),  # gate|up, act in the split sum
                f"m{mc}|256x512": _cfg(32, 32, 128, 1),  # down of the last layer
                f"add_norm|m{mc}|256x512": _cfg(32, 32, 64, 2),  # down + next input norm
                f"m{mc}|96x256": _cfg(32, 32, 64, 1),  # logits (float32)
            }
        )
    path.write_text(json.dumps({"entries": entries}))
    return str(path)


@cuda
def test_layer_ops_take_the_tile_path(tmp_path, monkeypatch):
    """In-process, 24 rows at the test checkpoint's shapes: ``ops.linear`` and
    ``fused_norm_ops.mlp_block`` take every tile kernel the table names (the down projection handing
    the next layer a ``Normed`` input), with the cuBLAS path's results within bf16
    tolerance; ``tile_gemm=False`` takes none."""
    from kernels import fused_norm_ops, ops, tile_gemm
    from kernels.ops import build_kernel_settings
    from kernels.settings import overridden
    from metadata.config import KernelConfig
    from kernels.norm_handoff import Normed
    from kernels.rms_norm import rms_norm_triton

    calls = {"plain": 0, "add_norm": 0}
    plain, add_norm = tile_gemm.tile_linear_triton, tile_gemm.tile_linear_add_norm_triton

    def count(kind, fn):
        def wrapped(*a, **kw):
            calls[kind] += 1
            return fn(*a, **kw)

        return wrapped

    monkeypatch.setattr(tile_gemm, "tile_linear_triton", count("plain", plain))
    monkeypatch.setattr(tile_gemm, "tile_linear_add_norm_triton", count("add_norm", add_norm))
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(torch.bfloat16)

    x, res, attn = rnd(24, 256), rnd(24, 256), rnd(24, 256)
    nw1, nw2 = rnd(256, scale=0.1) + 1, rnd(256, scale=0.1) + 1
    w_qkv, w_o, w_gu = rnd(384, 256, scale=0.06), rnd(256, 256, scale=0.06), rnd(1024, 256, scale=0.06)
    w_down, w_lm = rnd(256, 512, scale=0.04), rnd(96, 256, scale=0.06)

    def run():
        qkv, r1 = ops.linear(x, w_qkv, residual=res, norm_weight=nw1, eps=1e-6)
        h, r2 = fused_norm_ops.mlp_block(
            attn, w_o, r1, nw2, 1e-6, w_gu, w_down, act="silu_and_mul_pairs", handoff_to=(nw1, 1e-6, w_qkv)
        )
        if not isinstance(h, Normed):  # cuBLAS path: the next layer's add + norm still to do
            normed, r2 = rms_norm_triton(h, nw1, 1e-6, r2)
            h = Normed(normed)
        logits, _ = ops.linear(h.x, w_lm, out_dtype=torch.float32)
        return qkv, h.x, r2, logits

    table = build_kernel_settings(KernelConfig(tile_gemm_tuning=_tile_table(tmp_path / "t.json"))).tile_table
    with torch.no_grad():
        with overridden(tile_table={}):  # tile_gemm=False
            base = run()
        assert calls == {"plain": 0, "add_norm": 0}
        with overridden(tile_table=table):
            got = run()
    # qkv, gate|up, logits: the GEMM; o_proj + norm and down + next norm: add_norm
    assert calls == {"plain": 3, "add_norm": 2}, calls
    for a, b in zip(got, base):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), atol=0.03 * b.abs().max().item(), rtol=0.03)


@cuda
def test_precompile_launches_each_selected_variant(tmp_path, monkeypatch):
    from kernels import tile_gemm

    table = tile_gemm.load_table(_tile_table(tmp_path / "t.json", classes=(32, 128)))
    w = lambda n, k: torch.zeros(n, k, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    uses = [
        (w(384, 256), "plain"),
        (w(1024, 256), "act"),
        (w(256, 512), "add_norm"),
        (w(96, 256), "logits"),
        (w(100, 256), "plain"),  # no entry
        (w(384, 256), "plain"),
    ]  # a second layer's twin: launched once
    assert tile_gemm.precompile(uses, table=table) == 4 * 2
    assert tile_gemm.precompile(uses, max_rows=20, max_logit_rows=16, table=table) == 3  # class 32
    assert tile_gemm.precompile(uses, table={}) == 0  # tile_gemm=False


@cuda
@pytest.mark.parametrize(
    "eager,num,mc",
    [(False, 24, 32), (True, 24, 32), (False, 8, 16)],
    ids=["cuda-graphs", "eager", "cuda-graphs-16-rows"],
)
def test_gpu_greedy_matches_transformers_with_tile_gemm(ray_local, tile_ckpt, tmp_path, monkeypatch, eager, num, mc):
    """``num`` concurrent requests (decode steps in the ``mc``-row class; the 16-row class
    takes the tile path over the skinny GEMM) with the test table: the o_proj/down split sums
    do the norms between layers; greedy equal to transformers."""
    import random

    from cluster import LLM, SamplingParams

    table = _tile_table(tmp_path / "t.json", classes=(mc,))
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 96) for _ in range(rng.randrange(4, 120))] for _ in range(num)]
    expected, hf_logits = _hf_greedy(tile_ckpt, prompts, 24)
    llm = LLM(
        model=str(tile_ckpt),
        dtype="bfloat16",
        enforce_eager=eager,
        max_model_len=1024,
        kv_cache_memory_bytes=256 << 20,
        max_num_seqs=mc,
        tile_gemm_tuning=table,
    )
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        )
        got = [o.outputs[0].token_ids for o in outs]
        stats = ray_local.get([w.stats.remote() for w in llm.engine.executor.workers], timeout=60)
    finally:
        llm.shutdown()
    assert_greedy_equal(prompts, got, expected, hf_logits, torch.bfloat16, num_layers=2)
    # the worker's table matched this model: warm-up launched each of its 7 variants (one
    # class: max_num_seqs is its size) -- the same selection every step of that class makes
    assert all(s["tile_gemm_warm_launches"] == 7 for s in stats), stats
    # No kernel variant mid-serving, graphs or not. With graphs every variant is warm; with
    # enforce_eager, start-up ran one scratch decode pass per eager one-token attention shape
    # (workers.eager_warm_up; without it two attention variants compiled mid-serving here).
    for s in stats:
        firsts = s["kernel_variants_first"]
        assert s["kernel_variants_after_start"] == 0, firsts
        assert (s["eager_warm_cases"] > 0) == eager, s
