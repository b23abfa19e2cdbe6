"""The mid-batch tiled GEMM (``kernels.tile_gemm``) under the interpreter against its
plain-torch reference (run in an interpreted child pytest: see ``tests/interpreted.py``)."""

import pytest
import torch

from tests.interpreted import INTERPRETED, delegate_all

if INTERPRETED:
    from kernels import tile_gemm
else:
    tile_gemm = None  # only the child touches triton


def _cfg(bm, bn, bk, split):
    return dict(block_m=bm, block_n=bn, block_k=bk, split_k=split, num_warps=4, num_stages=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "m,n,k,cfg",
    [
        (20, 48, 64, _cfg(16, 16, 32, 1)),  # ragged M and N tiles, K in two chunks
        (33, 40, 128, _cfg(32, 32, 32, 2)),  # split-K: two slices of two chunks, ragged N
        (17, 64, 192, _cfg(16, 32, 16, 4)),  # four slices of three chunks
    ],
)
def test_tile_gemm_matches_reference(dtype, m, n, k, cfg):
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    y = tile_gemm.tile_linear_triton(x, w, cfg)
    y_ref = tile_gemm.tile_linear_reference(x, w)
    assert y.shape == (m, n) and y.dtype == dtype
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(y, y_ref, **tol)
    # and against an independent float64 product (the reference is not its own oracle)
    exact = x.double() @ w.double().t()
    torch.testing.assert_close(y.double(), exact, **tol)


@pytest.mark.parametrize("split", [1, 2])
def test_tile_gemm_float32_logits_are_rounded_then_widened(split):
    g = torch.Generator().manual_seed(split)
    x = torch.randn(18, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(40, 64, generator=g).to(torch.bfloat16)
    y = tile_gemm.tile_linear_triton(x, w, _cfg(16, 16, 32, split), out_dtype=torch.float32)
    assert y.dtype == torch.float32
    # every value is a bf16 value (rounded before widening), as linear(...).to(float32) gives
    assert torch.equal(y, y.to(torch.bfloat16).float())
    torch.testing.assert_close(y, tile_gemm.tile_linear_reference(x, w, torch.float32), atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("split", [1, 2])
def test_tile_gemm_silu_and_mul_pairs_epilogue(split):
    # gate|up as row pairs, the activation in the GEMM (split 1) or the split sum (split 2)
    g = torch.Generator().manual_seed(10 + split)
    x = torch.randn(21, 64, generator=g).to(torch.bfloat16)
    w = (torch.randn(2 * 72, 64, generator=g) / 4).to(torch.bfloat16)
    y = tile_gemm.tile_linear_triton(x, w, _cfg(16, 32, 32, split), act="silu_and_mul_pairs")
    assert y.shape == (21, 72) and y.dtype == torch.bfloat16
    ref = tile_gemm.tile_linear_reference(x, w, act="silu_and_mul_pairs")
    torch.testing.assert_close(y, ref, atol=3e-2, rtol=3e-2)
    full = x.double() @ w.double().t()  # independent: silu(gate) * up of the exact product
    exact = torch.nn.functional.silu(full[:, 0::2]) * full[:, 1::2]
    torch.testing.assert_close(y.double(), exact, atol=6e-2, rtol=4e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", [1, 3])
def test_tile_gemm_add_norm_matches_gemm_then_rms_norm(dtype, split):
    from kernels import reference as ref

    g = torch.Generator().manual_seed(20 + split)
    x = torch.randn(19, 96, generator=g).to(dtype)
    w = (torch.randn(40, 96, generator=g) / 10).to(dtype)
    res = torch.randn(19, 40, generator=g).to(dtype)
    nw = (1 + torch.rand(40, generator=g)).to(dtype)
    cfg = _cfg(16, 16, 32, split)
    out, new_res = tile_gemm.tile_linear_add_norm_triton(x, w, cfg, res, nw, 1e-6)
    y = tile_gemm.tile_linear_triton(x, w, cfg)
    out_exp, res_exp = ref.rms_norm_reference(y, nw, 1e-6, res)
    # the same rounded GEMM output, then the reference's order (the interpreter's bf16
    # casts are not round-to-nearest: one ulp of slack there)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(new_res, res_exp, **tol)
    torch.testing.assert_close(out, out_exp, **tol)
    # independent of the kernels: the exact product, added and normalised in float64
    s = x.double() @ w.double().t() + res.double()
    exact = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * nw.double()
    torch.testing.assert_close(out.double(), exact, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("split", [1, 2])
def test_tile_gemm_fp16_rounding_points_are_the_unfused_ops(split):
    """fp16, where the interpreter's casts round to nearest: the fused epilogues equal the
    tile GEMM followed by the reference ops bit for bit, so a rounding point dropped or
    moved (before the residual add, after the norm, after SiLU) fails here."""
    from kernels import reference as ref

    g = torch.Generator().manual_seed(30 + split)
    x = torch.randn(20, 64, generator=g).to(torch.float16)
    w = (torch.randn(48, 64, generator=g) / 8).to(torch.float16)
    res = torch.randn(20, 48, generator=g).to(torch.float16)
    nw = (1 + torch.rand(48, generator=g)).to(torch.float16)
    cfg = _cfg(16, 16, 32, split)
    y = tile_gemm.tile_linear_triton(x, w, cfg)
    act = tile_gemm.tile_linear_triton(x, w, cfg, act="silu_and_mul_pairs")
    assert torch.equal(act, ref.silu_and_mul_reference(y, pairs=True))
    out, new_res = tile_gemm.tile_linear_add_norm_triton(x, w, cfg, res, nw, 1e-6)
    out_exp, res_exp = ref.rms_norm_reference(y, nw, 1e-6, res)
    assert torch.equal(new_res, res_exp)
    # the sum of squares may reduce in another order: at most one rounding apart, rarely
    diff = (out.float() - out_exp.float()).abs()
    ulp = torch.finfo(torch.float16).eps * out_exp.float().abs().clamp_min(2**-14)
    assert bool((diff <= ulp).all()) and int((diff > 0).sum()) <= out.numel() // 100


def test_tile_gemm_every_output_tile_written():
    # distinct rows and columns: a tile skipped, written twice or by the wrong split shows up
    x = torch.eye(40, 96)[:, :96] + torch.arange(96.0)[None, :] / 96
    w = torch.randn(72, 96, generator=torch.Generator().manual_seed(5))
    for cfg in (_cfg(16, 16, 16, 1), _cfg(16, 32, 16, 3), _cfg(32, 16, 32, 3)):
        torch.testing.assert_close(tile_gemm.tile_linear_triton(x, w, cfg), x @ w.T, atol=1e-4, rtol=1e-4)


def test_tile_gemm_bad_config():
    x, w = torch.randn(20, 64), torch.randn(16, 64)
    with pytest.raises(ValueError, match="multiple of split_k"):
        tile_gemm.tile_linear_triton(x, w, _cfg(16, 16, 32, 3))
    with pytest.raises(ValueError, match="power of two"):
        tile_gemm.tile_linear_triton(x, w, _cfg(16, 24, 32, 1))
    with pytest.raises(ValueError, match="unknown activation"):
        tile_gemm.tile_linear_triton(x, w, _cfg(16, 16, 32, 1), act="silu_and_mul")
    with pytest.raises(ValueError, match="even N"):
        tile_gemm.tile_linear_triton(x, torch.randn(15, 64), _cfg(16, 16, 32, 1), act="silu_and_mul_pairs")
    with pytest.raises(ValueError, match="positive int 'split_k'"):
        tile_gemm.tile_linear_triton(x, w, dict(_cfg(16, 16, 32, 1), split_k=0))


def test_tile_gemm_m_classes():
    assert [tile_gemm.m_class(m) for m in (1, 2, 16, 17, 32, 33, 64, 65, 128, 129, 256, 257)] == [
        None,
        16,
        16,
        32,
        32,
        64,
        64,
        128,
        128,
        256,
        256,
        None,
    ]
    assert [tile_gemm.smallest_rows(c) for c in tile_gemm.M_CLASSES] == [2, 17, 33, 65, 129]


def test_tile_gemm_tuning_selects_per_class_and_shape(tmp_path):
    import json

    from kernels.ops import build_kernel_settings
    from metadata.config import KernelConfig

    cfg = _cfg(64, 32, 64, 2)
    path = tmp_path / "t.json"
    small = _cfg(16, 32, 64, 4)
    path.write_text(json.dumps({"entries": {"m64|1024x2048": cfg, "m128|1024x2048": None, "m16|1024x2048": small}}))
    table = build_kernel_settings(KernelConfig(tile_gemm_tuning=str(path))).tile_table
    assert tile_gemm.select_config(40, 1024, 2048, table=table) == cfg  # class 64
    assert tile_gemm.select_config(100, 1024, 2048, table=table) is None  # null: cuBLAS won
    assert tile_gemm.select_config(40, 2048, 1024, table=table) is None  # no entry for the shape
    assert tile_gemm.select_config(8, 1024, 2048, table=table) == small  # class 16: 2-16 rows
    assert tile_gemm.select_config(1, 1024, 2048, table=table) is None  # batch 1: the GEMV's
    off = build_kernel_settings(KernelConfig(tile_gemm=False)).tile_table  # cuBLAS everywhere
    assert off == {} and tile_gemm.select_config(40, 1024, 2048, table=off) is None


def test_tile_gemm_bad_tuning_file(tmp_path):
    import json

    from kernels.ops import build_kernel_settings
    from metadata.config import KernelConfig

    path = tmp_path / "bad.json"
    path.write_text("{}")
    with pytest.raises(ValueError, match="tile_gemm_tuning=.*not a tile-GEMM tuning file"):
        build_kernel_settings(KernelConfig(tile_gemm_tuning=str(path)))
    path2 = tmp_path / "bad2.json"  # an entry whose split does not divide K
    path2.write_text(json.dumps({"entries": {"m64|1024x2048": _cfg(64, 32, 128, 3)}}))
    with pytest.raises(ValueError, match="multiple of split_k"):
        build_kernel_settings(KernelConfig(tile_gemm_tuning=str(path2)))


def test_tile_gemm_precompile_checks_uses_and_skips_cpu_weights():
    with pytest.raises(ValueError, match="unknown use"):
        tile_gemm.precompile([(torch.zeros(4, 4), "gelu")])
    assert tile_gemm.precompile([(torch.zeros(4, 4, dtype=torch.bfloat16), "plain")]) == 0


def test_tuning_table_keeps_only_clear_wins():
    from benchmarks.kernels.bench_tile_gemm import WIN_MARGIN, tuning_table

    cfg = dict(_cfg(32, 64, 64, 4), us=1.0)
    rows = [
        {"shape": "a", "m": 32, "n": 1024, "k": 2048, "cublas_us": 2.0, "best": cfg},
        {
            "shape": "b",
            "m": 128,
            "n": 1024,
            "k": 2048,
            "cublas_us": 1.0 * WIN_MARGIN,
            "best": cfg,
        },  # only as fast as the margin: cuBLAS stays
        {"shape": "c", "m": 48, "n": 1024, "k": 2048, "cublas_us": 9.0, "best": cfg},  # no class
        {
            "shape": "d",
            "m": 256,
            "n": 4096,
            "k": 1024,
            "cublas_us": 5.0,
            "best": None,
            "add_norm": {"cublas_norm_us": 9.0, "best": cfg},
        },
    ]
    entries = tuning_table(rows, device="test")["entries"]
    assert entries == {
        "m32|1024x2048": _cfg(32, 64, 64, 4),
        "m128|1024x2048": None,
        "m256|4096x1024": None,
        "add_norm|m256|4096x1024": _cfg(32, 64, 64, 4),
    }
    assert tile_gemm.tuning_key(256, 4096, 1024, "add_norm") == "add_norm|m256|4096x1024"


@pytest.mark.parametrize(
    "rows,entry,want", [(8, True, "tile"), (8, False, "skinny"), (1, True, "skinny"), (16, True, "tile")]
)
def test_linear_prefers_a_16_row_tile_entry_over_the_skinny_gemm(tmp_path, monkeypatch, rows, entry, want):
    """At 2-16 rows a tile-table entry for the shape wins over the skinny GEMM's config; batch 1
    and shapes without an entry keep the skinny path. The chosen kernel really runs (interpreter)
    and matches the reference."""
    import json

    from kernels import ops, reference, skinny_gemm

    path = tmp_path / "t.json"
    path.write_text(json.dumps({"entries": {"m16|64x128": _cfg(16, 32, 32, 2)} if entry else {}}))
    from dataclasses import replace

    from kernels import settings

    monkeypatch.setattr(settings, "_installed", replace(settings.current(), tile_table=tile_gemm.load_table(str(path))))
    monkeypatch.setattr(ops, "_use_triton", lambda t: True)
    took = []
    for mod, name, tag in ((skinny_gemm, "skinny_linear_triton", "skinny"), (tile_gemm, "tile_linear_triton", "tile")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _r=real, _t=tag, **k: took.append(_t) or _r(*a, **k))
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 128, generator=g).to(torch.bfloat16)
    w = (torch.randn(64, 128, generator=g) / 8).to(torch.bfloat16)
    y, _ = ops.linear(x, w)
    assert took == [want]
    torch.testing.assert_close(y.float(), reference.skinny_linear_reference(x, w)[0].float(), atol=2e-2, rtol=2e-2)


delegate_all(globals(), __file__)
