"""``benchmarks.kernel_timeline``: each kernel charged only what it adds to a step's span."""

import pytest

from benchmarks.kernel_timeline import exposed_per_step, exposed_time


def test_overlapping_kernels_are_charged_only_their_extension():
    # a: 0-10; b (PDL, starts early, waits inside): 4-15 adds 5; idle 15-18; c: 18-20 adds 2;
    # d: 19-19.5, inside c, adds nothing
    ks = [("b", 4.0, 15.0), ("a", 0.0, 10.0), ("c", 18.0, 20.0), ("d", 19.0, 19.5)]
    t = exposed_time(ks)
    by = t["by_name"]
    assert by["a"]["exposed_us"] == pytest.approx(10.0)
    assert by["b"]["exposed_us"] == pytest.approx(5.0) and by["b"]["duration_us"] == pytest.approx(11.0)
    assert by["c"]["exposed_us"] == pytest.approx(2.0)
    assert by["d"]["exposed_us"] == 0.0 and by["d"]["calls"] == 1
    assert t["idle_us"] == pytest.approx(3.0) and t["span_us"] == pytest.approx(20.0)
    # the charges and the idle time add up to the span
    assert sum(r["exposed_us"] for r in by.values()) + t["idle_us"] == pytest.approx(t["span_us"])


def test_per_step_summary_sorts_by_exposed_time_and_divides_by_steps():
    ks = [("gemv", 0.0, 8.0), ("attn", 2.0, 12.0), ("gemv", 12.5, 20.5), ("attn", 14.0, 24.0)]
    s = exposed_per_step(ks, steps=2)
    assert [r["name"] for r in s["exposed_top"]] == ["gemv", "attn"]
    gemv, attn = s["exposed_top"]
    assert gemv["exposed_us_per_step"] == pytest.approx(8.0) and gemv["calls_per_step"] == 1
    assert attn["exposed_us_per_step"] == pytest.approx(3.75)  # (4 + 3.5) / 2
    assert attn["duration_us_per_step"] == pytest.approx(10.0)
    assert s["idle_us_per_step"] == pytest.approx(0.25) and s["span_us_per_step"] == pytest.approx(12.0)


def test_empty_and_malformed_input():
    assert exposed_time([])["span_us"] == 0.0
    with pytest.raises(ValueError, match="ends"):
        exposed_time([("k", 5.0, 1.0)])
