"""decode_roofline's arithmetic: the phase-wise floor and the host/device split of a
profiled cell (no device needed)."""

import pytest


def test_decode_roofline_phase_floor():
    from benchmarks.roofline_model import phase_floor_s

    # an 8B b256 ctx 512 cell: 15.0 GB of bf16 weights, 18.1 GB of KV
    w, kv, bw, mm = 15.0e9, 18.1e9, 4.29e12, 780e12
    floor = phase_floor_s(w, kv, 2, 256, bw, mm)
    assert floor == pytest.approx(2 * 256 * w / 2 / mm + kv / bw)  # GEMMs compute-bound here
    assert floor > (w + kv) / bw
    assert phase_floor_s(w, kv, 2, 1, bw, mm) == pytest.approx((w + kv) / bw)  # batch 1: memory


def test_decode_roofline_device_split():
    from benchmarks.roofline_model import device_split

    # a Qwen3-0.6B b1 cell: 998 us of kernels in a 1.573 ms step, roofline 0.2946 ms
    split = device_split(998.0, 1.573, 0.2946)
    assert split["kernel_ratio"] == pytest.approx(998e-3 / 0.2946)
    assert split["device_idle_fraction"] == pytest.approx(1 - 998 / 1573)
    # kernels longer than the pipelined step (overlap across steps): never negative idle
    assert device_split(1200.0, 1.0, 0.5)["device_idle_fraction"] == 0.0
    assert device_split(0.0, 1.0, 0.5) == {}  # a CPU run: no device kernels
