"""The TP all-reduce switch: validation, where the symmetric all-reduce applies, and that
asking for it on CPUs leaves gloo in charge (with a warning). Its GPU run is in
tests/test_gpu_tensor_parallel.py."""

import logging

import pytest
import torch

from kernels.switches import kernel_env_vars
from workers import symm_all_reduce as sar
from workers.distributed import TPGroup


@pytest.mark.parametrize("value,ok", [("", True), ("nccl", True), ("symm", True), ("SYMM", True),
                                      ("nvls", False), ("1", False)])
def test_backend_switch_validated_at_start_up(monkeypatch, value, ok):
    monkeypatch.setenv(sar.SWITCH, value)
    if ok:
        assert kernel_env_vars()[sar.SWITCH] == value  # forwarded to the worker actors
    else:
        with pytest.raises(ValueError, match="must be nccl or symm"):
            kernel_env_vars()


@pytest.mark.parametrize("value", ["100", "big", "-5"])
def test_buffer_size_switch_validated(monkeypatch, value):
    monkeypatch.setenv(sar.MAX_BYTES_SWITCH, value)
    with pytest.raises(ValueError, match="at least 4096"):
        kernel_env_vars()
    monkeypatch.setenv(sar.MAX_BYTES_SWITCH, "65536")
    assert sar.max_bytes() == 65536


def test_symm_asked_on_cpu_warns_and_keeps_gloo(monkeypatch, caplog):
    monkeypatch.setenv(sar.SWITCH, "symm")
    with caplog.at_level(logging.WARNING):
        assert sar.maybe_create("gloo", None, torch.device("cpu")) is None
    assert "stays gloo" in caplog.text
    monkeypatch.setenv(sar.SWITCH, "nccl")
    assert sar.maybe_create("nccl", None, torch.device("cuda", 0)) is None  # default: never built


class _FakeCuda:
    """Just the tensor attributes ``fits`` reads (no CUDA tensor exists on this machine)."""

    is_cuda = True

    def __init__(self, numel, dtype=torch.bfloat16, offset=0, contiguous=True):
        self._n, self.dtype, self._off, self._c = numel, dtype, offset, contiguous

    def numel(self):
        return self._n

    def element_size(self):
        return torch.tensor([], dtype=self.dtype).element_size()

    def storage_offset(self):
        return self._off

    def is_contiguous(self):
        return self._c


def test_fits_only_small_aligned_contiguous_cuda_tensors():
    fast = sar.SymmAllReduce.__new__(sar.SymmAllReduce)  # the size rule alone, no buffer
    fast.max_bytes = 8192
    assert fast.fits(_FakeCuda(4096))  # 8 KB of bf16: a batch-1 decode activation of an 8B model
    assert fast.fits(_FakeCuda(2048, torch.float32))
    assert not fast.fits(_FakeCuda(4097))  # over the buffer
    assert not fast.fits(_FakeCuda(64, torch.float16))  # the one-shot kernel has no fp16
    assert not fast.fits(_FakeCuda(64, offset=3))  # 6 bytes into its storage: misaligned
    assert not fast.fits(_FakeCuda(7))  # 14 bytes: not a multiple of 16
    assert not fast.fits(_FakeCuda(64, contiguous=False))
    assert not fast.fits(torch.zeros(4, 16))  # CPU tensors never go to the symmetric path


def test_tp_group_of_one_is_the_identity():
    x = torch.randn(3, 5)
    assert TPGroup().all_reduce(x) is x
