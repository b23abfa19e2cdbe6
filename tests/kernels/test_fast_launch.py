"""``kernels.fast_launch``'s specialisation key (CPU: no launch). A key coarser than Triton's
would launch a variant compiled for other arguments (misaligned vector loads, an int32
parameter given an int64 value), so every distinction Triton makes must change the key."""

import pytest
import torch

from kernels.fast_launch import _arg_key, _Uncached


def test_tensors_differ_by_dtype_and_16_byte_alignment():
    x = torch.zeros(64, dtype=torch.float32)
    assert _arg_key(x) == _arg_key(torch.zeros(8, dtype=torch.float32))
    assert _arg_key(x) != _arg_key(x[1:])  # 4 bytes off: not 16-aligned
    assert _arg_key(x) == _arg_key(x[4:])  # 16 bytes off
    assert _arg_key(x) != _arg_key(x.view(torch.int32))


@pytest.mark.parametrize(
    "a,b",
    [(1, 2), (16, 17), (32, 33), (2**31 - 1, 2**31), (-(2**31), -(2**31) - 1), (2**63 - 1, 2**63), (0, 1)],
)
def test_ints_differ_where_triton_specialises(a, b):
    assert _arg_key(a) != _arg_key(b)


def test_same_class_ints_share_a_key():
    assert _arg_key(17) == _arg_key(19) and _arg_key(32) == _arg_key(48) and _arg_key(-3) == _arg_key(5)


def test_other_scalars_by_type_and_unmodelled_kinds_refused():
    assert _arg_key(True) != _arg_key(1) and _arg_key(0.5) == _arg_key(2.0) and _arg_key(None) is type(None)
    for v in ((1, 2), [1], "s"):
        with pytest.raises(_Uncached):
            _arg_key(v)
