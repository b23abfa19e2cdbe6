"""Kernel switches set on the driver are the ones forwarded to the workers, and only those."""

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


def test_rope_in_attention_switch(monkeypatch):
    import pytest

    from kernels import ops

    monkeypatch.delenv("SYNCLESS_ROPE_IN_ATTENTION", raising=False)
    assert ops.rope_in_attention_enabled() is True  # default: one launch a layer fewer
    for raw, want in (("0", False), ("off", False), ("1", True), ("yes", True)):
        monkeypatch.setenv("SYNCLESS_ROPE_IN_ATTENTION", raw)
        assert ops.rope_in_attention_enabled() is want
    monkeypatch.setenv("SYNCLESS_ROPE_IN_ATTENTION", "sometimes")
    with pytest.raises(ValueError, match="SYNCLESS_ROPE_IN_ATTENTION"):
        ops.rope_in_attention_enabled()
