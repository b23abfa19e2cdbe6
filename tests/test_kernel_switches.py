"""Kernel switches set on the driver are the ones forwarded to the workers, and only those;
the on/off ones parse strictly."""

import pytest

from kernels.switches import KERNEL_SWITCHES, kernel_env_vars


def test_kernel_env_vars_forwards_exactly_the_set_switches(monkeypatch):
    for name in KERNEL_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    assert kernel_env_vars() == {}
    monkeypatch.setenv("SYNCLESS_PDL", "1")
    monkeypatch.setenv("SYNCLESS_SKINNY_TUNING", "/tmp/t.json")
    monkeypatch.setenv("SYNCLESS_UNRELATED", "x")  # not a kernel switch: stays behind
    assert kernel_env_vars() == {"SYNCLESS_PDL": "1", "SYNCLESS_SKINNY_TUNING": "/tmp/t.json"}


def test_every_switch_the_kernels_read_is_listed():
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1] / "kernels"
    read = set()
    for path in root.glob("*.py"):
        read |= set(re.findall(r'"(SYNCLESS_[A-Z0-9_]+)"', path.read_text()))
    assert read <= set(KERNEL_SWITCHES), sorted(read - set(KERNEL_SWITCHES))


@pytest.mark.parametrize("name,getter,default", [
    ("SYNCLESS_ROPE_IN_ATTENTION", "rope_in_attention_enabled", True),  # one launch fewer
    ("SYNCLESS_FUSED_MLP", "fused_mlp_enabled", False),  # measured slower on the H200: opt-in
])
def test_boolean_switches_parse_strictly(monkeypatch, name, getter, default):
    from kernels import ops

    read = getattr(ops, getter)
    monkeypatch.delenv(name, raising=False)
    assert read() is default
    for raw, want in (("0", False), ("off", False), ("1", True), ("on", True), ("yes", True)):
        monkeypatch.setenv(name, raw)
        assert read() is want
    for bad in ("sometimes", "maybe"):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=name):
            read()


def test_malformed_pdl_switches_fail_at_start_up(monkeypatch):
    for name in KERNEL_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SYNCLESS_PDL", "maybe")
    with pytest.raises(ValueError, match="SYNCLESS_PDL must be auto, 1 or 0"):
        kernel_env_vars()
    monkeypatch.setenv("SYNCLESS_PDL", "auto")
    monkeypatch.setenv("SYNCLESS_PDL_MAX_TOKENS", "x")
    with pytest.raises(ValueError, match="SYNCLESS_PDL_MAX_TOKENS must be a non-negative integer"):
        kernel_env_vars()


def test_malformed_handoff_and_attention_switches_fail_at_start_up(monkeypatch):
    from kernels import norm_handoff

    for name in KERNEL_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    assert norm_handoff.enabled() is True  # measured faster (notes/2026-12-04h)
    monkeypatch.setenv("SYNCLESS_NORM_HANDOFF", "0")
    assert norm_handoff.enabled() is False and kernel_env_vars() == {"SYNCLESS_NORM_HANDOFF": "0"}
    for name, bad, msg in (("SYNCLESS_NORM_HANDOFF", "maybe", "must be 0 or 1"),
                           ("SYNCLESS_ATTN_RELEASE", "soon", "must be early or late"),
                           ("SYNCLESS_DECODE_ATTN_STAGES", "two", "non-negative integer"),
                           ("SYNCLESS_DECODE_LAYER", "fast", "must be 0 or 1")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=msg):
            kernel_env_vars()
        monkeypatch.delenv(name)


def test_malformed_tile_gemm_switches_fail_at_start_up(monkeypatch, tmp_path):
    for name in KERNEL_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SYNCLESS_TILE_GEMM", "sometimes")
    with pytest.raises(ValueError, match="SYNCLESS_TILE_GEMM must be 0 or 1"):
        kernel_env_vars()
    monkeypatch.delenv("SYNCLESS_TILE_GEMM")
    monkeypatch.setenv("SYNCLESS_TILE_GEMM_TUNING", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="not a tile-GEMM tuning file"):
        kernel_env_vars()
    monkeypatch.setenv("SYNCLESS_TILE_GEMM", "0")  # off: the table is never read
    assert kernel_env_vars() == {"SYNCLESS_TILE_GEMM": "0",
                                 "SYNCLESS_TILE_GEMM_TUNING": str(tmp_path / "missing.json")}


def test_malformed_decode_layer_config_fails_at_start_up(monkeypatch):
    for name in KERNEL_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SYNCLESS_DECODE_LAYER_CONFIG", "num_warps=8,tile=4096")
    assert kernel_env_vars() == {"SYNCLESS_DECODE_LAYER_CONFIG": "num_warps=8,tile=4096"}
    monkeypatch.setenv("SYNCLESS_DECODE_LAYER_CONFIG", "num_warps=5")  # even with the layer off
    with pytest.raises(ValueError, match="SYNCLESS_DECODE_LAYER_CONFIG"):
        kernel_env_vars()


def test_start_up_refuses_to_serve_after_a_grid_barrier_timeout():
    """A one-launch kernel's barrier that timed out left garbage: the worker's warm-up check
    raises instead of serving it (here on a CPU counter buffer with one timeout recorded)."""
    import types

    import torch

    from kernels import grid_sync
    from workers.model_runner import ModelRunner

    dev = torch.device("cpu")
    runner = types.SimpleNamespace(device=dev)
    buf = grid_sync.counters(dev, 4)
    ModelRunner._check_grid_barriers(runner)  # nothing recorded: fine
    buf[grid_sync.ERROR_INDEX] = 1
    try:
        with pytest.raises(RuntimeError, match="grid-barrier timeout"):
            ModelRunner._check_grid_barriers(runner)
    finally:
        buf.zero_()
