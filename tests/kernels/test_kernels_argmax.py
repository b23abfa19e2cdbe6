"""The Triton argmax (``kernels.argmax``) under the interpreter against ``torch.argmax``
(run in an interpreted child pytest: see ``tests/interpreted.py``)."""

import pytest
import torch

from tests.interpreted import INTERPRETED, delegate_all

if INTERPRETED:
    from kernels import argmax as am
else:
    am = None  # only the child touches triton


@pytest.mark.parametrize(
    "rows,vocab,splits,block", [(5, 1000, None, 128), (3, 4099, 3, 256), (1, 777, 1, 64), (6, 300, 5, 64)]
)
def test_argmax_matches_torch(rows, vocab, splits, block):
    g = torch.Generator().manual_seed(rows * vocab)
    x = torch.randn(rows, vocab, generator=g)
    x[0, vocab - 1] = 100.0  # the winner in the last, ragged tile
    got = am.argmax_triton(x, block=block, num_splits=splits)
    assert got.dtype == torch.int64
    assert got.tolist() == x.argmax(dim=-1).tolist()
    assert int(got[0]) == vocab - 1


def test_argmax_ties_nan_inf_and_strides():
    x = torch.randn(6, 500)
    x[0, :] = 3.0  # all tied: the lowest index
    x[1, 7] = x[1, 450] = 50.0  # a tie across splits
    x[2, :] = float("-inf")  # all -inf: 0, as torch
    x[3, 300] = float("nan")  # a NaN beats everything, even +inf before it
    x[3, 10] = float("inf")
    x[4, 200] = x[4, 100] = float("nan")  # the first NaN
    x[5, 499] = float("inf")
    wide = torch.randn(6, 640)
    wide[:, :500] = x
    for t in (x, wide[:, :500], x.to(torch.bfloat16)):
        got = am.argmax_triton(t, block=64, num_splits=4)
        assert got.tolist() == t.argmax(dim=-1).tolist()
    assert am.argmax_triton(x, block=64, num_splits=4).tolist() == [0, 7, 0, 300, 100, 499]


def test_argmax_bad_input():
    with pytest.raises(ValueError, match="num_splits"):
        am.argmax_triton(torch.randn(2, 100), num_splits=65)
    with pytest.raises(ValueError, match="empty row"):
        am.argmax_triton(torch.randn(2, 0))
    assert am.argmax_triton(torch.randn(0, 10)).shape == (0,)


delegate_all(globals(), __file__)  # parent process: each test reports its child run
