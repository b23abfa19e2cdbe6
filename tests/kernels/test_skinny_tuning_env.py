"""The ``skinny_tuning`` option: a benchmark's fresh tuning table replaces the packaged one,
and a bad file is a clear error at start-up, never a silent fallback to the defaults."""

import json

import pytest

from kernels import skinny_gemm as sg
from kernels.ops import build_kernel_settings, skinny_config
from kernels.settings import overridden
from metadata.config import ConfigError, EngineConfig, KernelConfig


def test_tuning_file_routes_batch_one_to_gemv(tmp_path):
    gemv = {"kernel": "gemv", "block_n": 4, "block_k": 1024, "num_warps": 4, "ctas_per_sm": 2}
    table = {"entries": {sg.tuning_key("norm_act", 1, 28672, 4096): gemv, sg.tuning_key("plain", 1, 4096, 4096): None}}
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps(table))
    entries = build_kernel_settings(KernelConfig(skinny_tuning=str(path))).skinny_table
    assert sg.select_config(1, 28672, 4096, "norm_act", entries) == gemv
    assert sg.select_config(1, 4096, 4096, "plain", entries) is None  # null: the unfused path
    # a shape the file does not name: the measured defaults
    assert sg.select_config(1, 1000, 1000, "plain", entries) == sg.DEFAULTS[("plain", 1)]
    assert sg.select_config(1, 28672, 4096, "norm_act") != gemv  # the packaged table
    assert build_kernel_settings(KernelConfig()).skinny_table == sg.load_table()


def test_ops_reads_the_installed_table(tmp_path, monkeypatch):
    import torch

    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"entries": {sg.tuning_key("plain", 1, 64, 32): None}}))
    monkeypatch.setattr("kernels.ops._use_triton", lambda t: True)  # the CUDA dispatch, on CPU
    x, w = torch.zeros(1, 32, dtype=torch.bfloat16), torch.zeros(64, 32, dtype=torch.bfloat16)
    assert skinny_config(x, w, False, None, None) == sg.DEFAULTS[("plain", 1)]
    with overridden(skinny_table=build_kernel_settings(KernelConfig(skinny_tuning=str(path))).skinny_table):
        assert skinny_config(x, w, False, None, None) is None


def test_bad_tuning_file_is_an_error_at_startup(tmp_path):
    with pytest.raises(ConfigError, match="skinny_tuning=.*missing.json: not a tuning file"):
        EngineConfig.from_options(skinny_tuning=str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"no_entries": 1}')
    with pytest.raises(ConfigError, match="skinny_tuning=.*not a tuning file"):
        EngineConfig.from_options(skinny_tuning=str(bad))
    with pytest.raises(ValueError, match="skinny_tuning=.*not a skinny-GEMM tuning file"):
        build_kernel_settings(KernelConfig(skinny_tuning=str(bad)))  # the worker's own check
