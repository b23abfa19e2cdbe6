"""``benchmarks.host_ops``: the launch path's host primitives timed idle and behind a GPU
busy-wait. On the GPU each must return long before the busy-wait ends (none waits for the
device); on the CPU the benchmark refuses to run, saying why."""

import pytest
import torch

from benchmarks.host_ops import main, measure


def test_bad_arguments_and_no_gpu_are_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--calls", "0"])
    assert e.value.code == 2 and "--calls" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a GPU"):
            main([])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_no_primitive_waits_for_the_device():
    res = measure(busy_ms=20.0, calls=10)
    assert len(res["us"]) >= 8
    for name, r in res["us"].items():
        assert 0 < r["idle_us"] and 0 < r["busy_us"] < 20_000 / 4, (name, r)
