"""No Triton variant depends on the batch size beyond the launch's constexprs (CPU, no launch).

Triton specialises every int argument not listed in ``do_not_specialize`` on ``== 1`` and
``% 16 == 0``, and every tensor on 16-byte alignment. An argument that follows the token
count (a split-major buffer's stride) thus compiles a second variant the first time an eager
step of the other parity comes: mid-serving, after start-up warmed the first
(``test_gpu_tile_gemm.py`` on the device saw two). Here each launch's arguments are recorded instead of
run, and launches with the same constexprs must agree on every specialisation.
"""

from collections import defaultdict

import pytest
import torch

from kernels import attention_splits, paged_attention, pdl
from kernels.rope_inline import DecodeRope
from tests.kernels.launch_recorder import LaunchRecorder, launch_key

ATTENTION = paged_attention._paged_attention_kernel
REDUCE = attention_splits._reduce_splits_kernel


def _launches(monkeypatch, q_lens, hq, hkv, d, bound, fused_rope=False, **opts):
    g = torch.Generator().manual_seed(len(q_lens))
    n, r = sum(q_lens), len(q_lens)
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=g)  # strided views, as in the model
    q = qkv[:, : hq * d].view(n, hq, d)
    if fused_rope:
        opts["rope"] = DecodeRope(
            torch.arange(n),
            qkv[:, hq * d : (hq + hkv) * d].view(n, hkv, d),
            qkv[:, (hq + hkv) * d :].view(n, hkv, d),
            torch.randn(bound, d, generator=g),
            torch.arange(n),
        )
    k_cache = torch.randn(4 * bound // 16, 16, hkv, d, generator=g)
    block_table = torch.zeros(r, bound // 16, dtype=torch.int32)
    seq_lens = torch.full((r,), bound - 8, dtype=torch.int32)
    qsl = torch.zeros(r + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    attn, red = LaunchRecorder(ATTENTION), LaunchRecorder(REDUCE)
    monkeypatch.setattr(paged_attention, "_paged_attention_kernel", attn)
    monkeypatch.setattr(attention_splits, "_reduce_splits_kernel", red)
    paged_attention.paged_attention_triton(
        q, k_cache, k_cache, block_table, seq_lens, qsl, max(q_lens), bound, d**-0.5, **opts
    )
    return [(rec.fn, call) for rec in (attn, red) for call in rec.calls]


def _assert_one_variant_per_constexpr_set(launches):
    keys = defaultdict(set)
    for fn, (args, kwargs) in launches:
        consts, spec, opts = launch_key(fn, args, kwargs)
        keys[(fn.__name__, consts, opts)].add(spec)
    assert len(keys) >= 1
    for (name, _, _), specs in keys.items():
        if len(specs) > 1:
            differ = sorted(set.union(*(set(s) for s in specs)) - set.intersection(*(set(s) for s in specs)))
            pytest.fail(f"{name}: {len(specs)} variants for one constexpr set; differing: {differ}")


@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 32), (14, 2, 64), (16, 8, 128)])
def test_eager_decode_batches_share_variants(monkeypatch, hq, hkv, d):
    """One-token decode steps of 1-40 requests, eager, with splits merged in the launch."""
    launches = []
    for n in range(1, 41):
        launches += _launches(monkeypatch, [1] * n, hq, hkv, d, 1024, eager=True)
    assert any(kw["NUM_SPLITS"] > 1 for _, (_, kw) in launches)  # the split path is covered
    _assert_one_variant_per_constexpr_set(launches)


@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 32), (14, 2, 64), (32, 8, 128)])
def test_graph_decode_batches_with_fused_rope_and_pdl_share_variants(monkeypatch, hq, hkv, d):
    """The engine's captured decode launch: fused rope, PDL on (so the one-tile preload), the
    bound at max_model_len, batches of 1-40 requests."""
    monkeypatch.setattr(pdl, "launch_kwargs", lambda t: {"USE_PDL": True, "launch_pdl": True})
    launches = []
    for n in range(1, 41):
        launches += _launches(monkeypatch, [1] * n, hq, hkv, d, 1024, fused_rope=True)
    kws = [kw for _, (_, kw) in launches]
    assert any(kw["PRELOAD"] is True for kw in kws) and all(kw["ROPE"] for kw in kws)
    _assert_one_variant_per_constexpr_set(launches)


@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 32), (14, 2, 64)])
def test_mixed_batches_with_the_reduce_launch_share_variants(monkeypatch, hq, hkv, d):
    """Prefill-shaped steps of 5-24 tokens with forced splits: the separate reduce launch."""
    launches = []
    for extra in range(20):
        launches += _launches(
            monkeypatch, [5] + [1] * extra, hq, hkv, d, 512, eager=True, num_splits=3, fused_reduce=False
        )
    assert any(fn is REDUCE for fn, _ in launches)  # the reduce launch is covered
    _assert_one_variant_per_constexpr_set(launches)


@pytest.mark.parametrize("n", [96, 100, 1001])  # 100, 1001: an N (a vocabulary) not % 16
def test_split_k_tile_gemm_shares_variants_across_batch_sizes(monkeypatch, n):
    """The split-K tile GEMM and its split sums for 17-40-row batches: the partials' split
    stride must not follow ``M * N``'s divisibility."""
    from kernels import tile_gemm

    cfg = dict(block_m=32, block_n=32, block_k=64, split_k=4, num_warps=4, num_stages=3)
    names = ("_tile_gemm_kernel", "_split_sum_kernel", "_split_sum_add_norm_kernel")
    recs = {name: LaunchRecorder(getattr(tile_gemm, name)) for name in names}
    for name, rec in recs.items():
        monkeypatch.setattr(tile_gemm, name, rec)
    w = torch.randn(n, 256)
    for m in range(17, 41):
        x = torch.randn(m, 256)
        tile_gemm.tile_linear_triton(x, w, cfg, out_dtype=torch.float32)
        tile_gemm.tile_linear_add_norm_triton(x, w, cfg, torch.randn(m, n), torch.ones(n), 1e-6)
    launches = [(rec.fn, call) for rec in recs.values() for call in rec.calls]
    assert {fn.__name__ for fn, _ in launches} == set(names)
    _assert_one_variant_per_constexpr_set(launches)
