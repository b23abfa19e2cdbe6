"""FP8 weights' own skinny-GEMM tuning entries (``|fp8`` keys): chosen before the shape's
16-bit entry, which applies where there is none; ``benchmarks.kernels.bench --tune --weights
fp8`` adds them to a table without touching its 16-bit entries (and a 16-bit re-tune keeps
them)."""

import pytest
import torch

from benchmarks.kernels.bench import main, merged_entries, tuned_entries
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


def test_weights_flag_needs_tune(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--weights", "fp8"])
    assert e.value.code == 2 and "--weights goes with --tune" in capsys.readouterr().err
