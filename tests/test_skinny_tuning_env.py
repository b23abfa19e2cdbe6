"""``SYNCLESS_SKINNY_TUNING``: a benchmark's fresh tuning table replaces the packaged one,
and a bad file is a clear error, never a silent fallback to the defaults."""

import json

import pytest

from kernels import skinny_gemm as sg


def test_tuning_file_from_env_routes_batch_one_to_gemv(tmp_path, monkeypatch):
    gemv = {"kernel": "gemv", "block_n": 4, "block_k": 1024, "num_warps": 4, "ctas_per_sm": 2}
    table = {"entries": {sg.tuning_key("norm_act", 1, 28672, 4096): gemv,
                         sg.tuning_key("plain", 1, 4096, 4096): None}}
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps(table))
    monkeypatch.setenv(sg.TUNING_ENV, str(path))
    assert sg.select_config(1, 28672, 4096, "norm_act") == gemv
    assert sg.select_config(1, 4096, 4096, "plain") is None  # null: the unfused path
    # a shape the file does not name: the measured defaults
    assert sg.select_config(1, 1000, 1000, "plain") == sg.DEFAULTS[("plain", 1)]
    monkeypatch.delenv(sg.TUNING_ENV)
    assert sg.select_config(1, 28672, 4096, "norm_act") != gemv


def test_bad_tuning_file_from_env_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv(sg.TUNING_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="SYNCLESS_SKINNY_TUNING"):
        sg.select_config(1, 4096, 4096, "plain")
    bad = tmp_path / "bad.json"
    bad.write_text("{\"no_entries\": 1}")
    monkeypatch.setenv(sg.TUNING_ENV, str(bad))
    with pytest.raises(ValueError, match="not a skinny-GEMM tuning file"):
        sg.select_config(1, 4096, 4096, "plain")
