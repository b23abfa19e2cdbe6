"""FP8 weights' own skinny-GEMM tuning entries (``|fp8`` keys): chosen before the shape's
16-bit entry, which applies where there is none; ``benchmarks.kernels.bench --tune --weights
fp8`` adds them to a table without touching its 16-bit entries (and a 16-bit re-tune keeps
them)."""

import pytest
import torch

from benchmarks.kernels.bench import main
from benchmarks.kernels.skinny_tune import measured_keys, merged_entries, tuned_entries
from kernels import skinny_gemm as sg
from kernels.settings import overridden

TILE = {"use_dot": True, "block_n": 32, "block_k": 128, "num_warps": 4, "num_stages": 5, "prefetch": False}
DEEP = {**TILE, "block_k": 512, "num_stages": 3}


def test_fp8_entry_comes_first_then_the_16_bit_one():
    table = {sg.tuning_key("plain", 16, 4096, 4096): TILE, sg.tuning_key("plain", 16, 4096, 4096, fp8=True): DEEP}
    assert sg.tuning_key("plain", 16, 4096, 4096, fp8=True) == "plain|m16|4096x4096|fp8"
    assert sg.select_config(8, 4096, 4096, "plain", table, fp8=True) == DEEP
    assert sg.select_config(8, 4096, 4096, "plain", table) == TILE  # 16-bit weights ignore it
    no_fp8 = {sg.tuning_key("plain", 16, 4096, 4096): TILE}
    assert sg.select_config(8, 4096, 4096, "plain", no_fp8, fp8=True) == TILE
    unfused = {**table, sg.tuning_key("norm", 16, 6144, 4096, fp8=True): None}
    assert sg.select_config(8, 6144, 4096, "norm", unfused, fp8=True) is None
    assert sg.select_config(32, 4096, 4096, "plain", table, fp8=True) is None  # past the skinny sizes


def test_the_fp8_linear_reads_its_entry(monkeypatch):
    from kernels.ops import _fp8_skinny_config

    monkeypatch.setattr("kernels.ops._use_triton", lambda t: True)  # the CUDA dispatch, on CPU
    x = torch.zeros(8, 32, dtype=torch.bfloat16)
    w = torch.zeros(64, 32, dtype=torch.float8_e4m3fn)
    base = {sg.tuning_key("plain", 16, 64, 32): TILE}
    with overridden(skinny_table=base):
        assert _fp8_skinny_config(x, w, False, None, None) == TILE
    with overridden(skinny_table={**base, sg.tuning_key("plain", 16, 64, 32, fp8=True): DEEP}):
        assert _fp8_skinny_config(x, w, False, None, None) == DEEP


def _row(variant, m, baseline, best_us):
    best = None if best_us is None else {**DEEP, "us": best_us}
    return {"shape": "s", "variant": variant, "n": 4096, "k": 4096, "m": m, "baseline_us": baseline, "best": best}


def test_tuned_entries_for_each_weight_type():
    rows = [_row("plain", 1, 10.0, 8.0), _row("norm", 8, 10.0, 12.0), _row("plain", 8, 10.0, None)]
    assert tuned_entries(rows) == {
        "plain|m1|4096x4096": DEEP,
        "norm|m16|4096x4096": None,  # the unfused path won
        "plain|m16|4096x4096": None,  # no candidate ran
    }
    # FP8: an entry only where a candidate beats what is served; the 16-bit entry elsewhere
    assert tuned_entries(rows, fp8=True) == {"plain|m1|4096x4096|fp8": DEEP}


def test_a_tune_keeps_the_other_weight_types_entries():
    old = {"plain|m1|8x8": TILE, "norm|m16|8x8": None, "plain|m1|8x8|fp8": TILE}
    assert merged_entries(old, {"plain|m1|8x8|fp8": DEEP}, fp8=True) == {
        "plain|m1|8x8": TILE,
        "norm|m16|8x8": None,
        "plain|m1|8x8|fp8": DEEP,
    }
    assert merged_entries(old, {"plain|m1|8x8": DEEP}, fp8=False) == {"plain|m1|8x8|fp8": TILE, "plain|m1|8x8": DEEP}


@pytest.mark.parametrize(
    "argv,says",
    [
        (["--weights", "fp8"], "--weights and --shapes go with --tune"),
        (["--shapes", "8b_o"], "--weights and --shapes go with --tune"),
        (["--tune", "t.json", "--shapes", "8b_o,70b_o"], "unknown shapes 70b_o"),
    ],
)
def test_tune_flags_are_checked(capsys, argv, says):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_fp8_batch_classes_past_16_rows_only_from_fp8_entries():
    assert [sg.m_class(m, fp8=True) for m in (1, 2, 16, 17, 32, 33, 64, 65)] == [1, 16, 16, 32, 32, 64, 64, None]
    assert sg.m_class(17) is None  # 16-bit weights: the GEMM kernels past 16 rows
    table = {sg.tuning_key("plain", 32, 4096, 4096, fp8=True): DEEP}
    assert sg.select_config(24, 4096, 4096, "plain", table, fp8=True) == DEEP
    assert sg.select_config(24, 4096, 4096, "plain", table) is None
    assert sg.select_config(40, 4096, 4096, "plain", table, fp8=True) is None  # no 33-64 entry: no default


def test_fp8_route(monkeypatch):
    """``kernels.ops.fp8_route``: up to 16 rows weight-only as before; 17-64 rows weight-only only
    where an FP8 entry says so (fused for the call's kind, else unfused around the plain GEMM's
    entry), else the quantized-activation GEMM; the CPU keeps its references' split at 16."""
    from kernels import ops

    w = torch.zeros(64, 32, dtype=torch.float8_e4m3fn)

    def route(m, norm=False, act=None, table=None):
        x = torch.zeros(m, 32, dtype=torch.bfloat16)
        with overridden(skinny_table=table or {}):
            return ops.fp8_route(x, w, norm, act, None)

    assert route(8) == ("fused", None) and route(24) == ("w8a8", None)  # the CPU: its references
    monkeypatch.setattr("kernels.ops._use_triton", lambda t: True)  # the CUDA dispatch, on CPU
    assert route(8) == ("fused", sg.DEFAULTS[("plain", 16)])
    assert route(8, norm=True) == ("unfused", sg.DEFAULTS[("plain", 16)])  # the default says unfused
    assert route(24) == ("w8a8", None) and route(24, norm=True, act="silu_and_mul") == ("w8a8", None)
    fused = {sg.tuning_key("norm_act", 32, 64, 32, fp8=True): DEEP}
    assert route(24, norm=True, act="silu_and_mul", table=fused) == ("fused", DEEP)
    plain = {sg.tuning_key("plain", 64, 64, 32, fp8=True): TILE}
    assert route(40, norm=True, table=plain) == ("unfused", TILE)
    assert route(40, table=plain) == ("fused", TILE)
    assert route(24, table=plain) == ("w8a8", None)  # an entry of the other class
    assert route(65, table={sg.tuning_key("plain", 64, 64, 32, fp8=True): TILE}) == ("w8a8", None)
    monkeypatch.setattr(ops, "SKINNY_MAX_M", 4)  # the skinny path capped (0: off): past it, w8a8
    assert route(4) == ("fused", sg.DEFAULTS[("plain", 16)]) and route(8) == ("w8a8", None)
    assert route(8, table={sg.tuning_key("plain", 16, 64, 32, fp8=True): TILE}) == ("w8a8", None)


def test_tuned_fp8_entries_of_the_wider_classes():
    rows = [_row("plain", 32, 10.0, 8.0), _row("norm", 64, 10.0, 11.0)]
    assert tuned_entries(rows, fp8=True) == {"plain|m32|4096x4096|fp8": DEEP}
    # a fused-norm shape whose unfused composition (norm kernel + plain weight-only + act) won
    unfused = {**_row("norm", 32, 10.0, 9.0), "best_unfused": {**TILE, "us": 7.0}, "unfused_configs": []}
    assert tuned_entries([unfused], fp8=True) == {"norm|m32|4096x4096|fp8": None, "plain|m32|4096x4096|fp8": TILE}
    fused = {**unfused, "best_unfused": {**TILE, "us": 9.5}}
    assert tuned_entries([fused], fp8=True) == {"norm|m32|4096x4096|fp8": DEEP}
    assert measured_keys([unfused], fp8=True) == {"norm|m32|4096x4096|fp8", "plain|m32|4096x4096|fp8"}


def test_an_fp8_retune_drops_the_entries_it_no_longer_wins():
    old = {"plain|m1|8x8": TILE, "plain|m32|8x8|fp8": DEEP, "plain|m64|8x8|fp8": DEEP}
    measured = {"plain|m32|8x8|fp8", "plain|m16|8x8|fp8"}  # m32 measured, no candidate won this time
    assert merged_entries(old, {}, fp8=True, measured=measured) == {"plain|m1|8x8": TILE, "plain|m64|8x8|fp8": DEEP}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("m", [24, 40])
def test_gpu_fp8_weight_only_past_16_rows(m):
    """With an FP8 entry for its class, ``ops.linear`` at 17-64 rows runs the weight-only skinny
    GEMM (16-bit activations): it matches the weight-only reference, where the quantized
    activations' path would be ~3e-2 off."""
    from kernels import ops
    from kernels.fp8_reference import quantize_weight_fp8
    from kernels.reference import skinny_linear_reference

    torch.manual_seed(m)
    n, k = 4096, 4096
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    wq, ws = quantize_weight_fp8(torch.randn(n, k, device="cuda") * 0.02)
    cfg = {"use_dot": True, "block_n": 32, "block_k": 256, "num_warps": 4, "num_stages": 3, "prefetch": False}
    with overridden(skinny_table={sg.tuning_key("plain", sg.m_class(m, fp8=True), n, k, fp8=True): cfg}):
        assert ops.fp8_route(x, wq, False, None, None) == ("fused", cfg)
        y, _ = ops.linear(x, wq, weight_scale=ws)
    exp, _ = skinny_linear_reference(x.float(), wq, weight_scale=ws)
    err = ((y.float() - exp).norm() / exp.norm()).item()
    assert err < 1e-2, err


def test_tune_files(tmp_path, monkeypatch):
    """``tune``'s file: an FP8 tune of a new file starts from the packaged table (16-bit entries
    and header kept, its run beside them); a 16-bit re-tune keeps the FP8 entries. (The
    measurements, GPU only, are replaced by fixed rows here.)"""
    import json

    import benchmarks.kernels.skinny_tune as bench

    rows = {True: [_row("plain", 32, 10.0, 8.0)], False: [_row("plain", 1, 10.0, 12.0)]}
    monkeypatch.setattr(bench, "bench_gemm", lambda ms, fp8=False, shapes=None: rows[fp8])
    path = tmp_path / "t.json"
    packaged = json.loads(sg.TUNING_FILE.read_text())
    bench.tune(str(path), fp8=True)
    out = json.loads(path.read_text())
    assert out["entries"] == {**packaged["entries"], "plain|m32|4096x4096|fp8": DEEP}
    assert out["device"] == packaged["device"] and out["fp8"]["measurements"] == rows[True]
    bench.tune(str(path), fp8=False)
    again = json.loads(path.read_text())
    packaged_fp8 = {k: v for k, v in packaged["entries"].items() if k.endswith("|fp8")}
    assert again["entries"] == {"plain|m1|4096x4096": None, **packaged_fp8, "plain|m32|4096x4096|fp8": DEEP}
    assert again["fp8"] == out["fp8"] and again["measurements"] == rows[False]


def _fp8_candidates():
    from benchmarks.kernels.skinny_tune import TUNE_CANDIDATES_FP8

    return [(mc, c) for mc, cs in TUNE_CANDIDATES_FP8.items() for c in cs]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("variant", ["plain", "norm_res_act"])
@pytest.mark.parametrize("cand", _fp8_candidates(), ids=lambda c: f"m{c[0]}-{'-'.join(map(str, c[1]))}")
def test_gpu_every_fp8_tuning_candidate(cand, variant):
    """Whatever ``--tune --weights fp8`` picks has been checked here: FP8 weights at the class's
    largest batch, against the weight-only reference (K=1000: a masked tail)."""
    from benchmarks.kernels.skinny_tune import CONFIG_FIELDS
    from kernels.fp8_reference import quantize_weight_fp8
    from kernels.reference import skinny_linear_reference
    from tests.kernels.test_kernels_gpu import rel_err, skinny_inputs

    mc, values = cand
    x, w, kw = skinny_inputs(mc, 512, 1000, variant)
    wq, ws = quantize_weight_fp8(w.float())
    y, _ = sg.skinny_linear_triton(x, wq, weight_scale=ws, config=dict(zip(CONFIG_FIELDS, values)), **kw)
    exp, _ = skinny_linear_reference(x, wq, weight_scale=ws, **kw)
    assert rel_err(y, exp) < 2e-2


def test_the_fp8_baseline_runs_without_fp8_entries(monkeypatch):
    """An FP8 tune's baseline is the path without FP8 entries (a re-tune finding the same tiles
    keeps them); the installed table is back afterwards. (On the CPU the candidates cannot
    launch and are recorded as errors; the timing is replaced by a recorder.)"""
    import benchmarks.kernels.skinny_tune as tune_mod
    from kernels.settings import current

    seen = []

    def record(fns, target_ms=2.0):
        seen.append(dict(current().skinny_table))
        for f in fns:
            f()
        return 1.0

    monkeypatch.setattr(tune_mod, "GEMM_SHAPES", {"tiny_o": (64, 32, "plain")})
    monkeypatch.setattr(tune_mod, "graph_time_us", record)
    monkeypatch.setattr(tune_mod, "rotation_copies", lambda nbytes, cap=32: 1)
    table = {sg.tuning_key("plain", 32, 64, 32): TILE, sg.tuning_key("plain", 32, 64, 32, fp8=True): DEEP}
    with overridden(skinny_table=table):
        rows = tune_mod.bench_gemm([32], fp8=True)
        assert current().skinny_table == table
    assert seen[0] == tune_mod.without_fp8_entries(table) == {sg.tuning_key("plain", 32, 64, 32): TILE}
    assert len(rows) == 1 and rows[0]["best"] is None  # (no candidate launches on the CPU)
