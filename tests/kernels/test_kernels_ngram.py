"""The n-gram draft kernel (``kernels.ngram``) under the Triton interpreter against
``kernels.reference.ngram_drafts_reference`` + the draft write, and on the GPU."""

import random

import pytest
import torch

from kernels.reference import ngram_drafts_reference
from tests.interpreted import INTERPRETED, delegate_all

if INTERPRETED:
    from kernels import ngram
else:
    ngram = None  # only the child touches triton


def _reference(token_ids, rows, known, width, k, n_min, n_max):
    out = token_ids.clone()
    drafts = ngram_drafts_reference(out[rows, :width], known, k, n_min, n_max)
    pos = known[:, None] + torch.arange(k)[None, :]
    keep = pos < out.shape[1]  # drafts past the last column are dropped
    out[rows[:, None].expand(-1, k)[keep], pos[keep]] = drafts[keep]
    return out


def _case(seed, n_rows=6, cols=90, vocab=5):
    """Small vocabularies make repeats (and matches of every length) likely; known lengths
    from 1 (nothing to match) to the table's end (drafts clamped to the last column)."""
    rng = random.Random(seed)
    token_ids = torch.tensor([[rng.randrange(vocab) for _ in range(cols)] for _ in range(n_rows + 2)])
    rows = torch.tensor(rng.sample(range(n_rows + 2), n_rows))
    known = torch.tensor([1, 2, cols, cols - 1] + [rng.randrange(3, cols) for _ in range(n_rows - 4)])
    return token_ids, rows, known


@pytest.mark.parametrize("n_min,n_max", [(1, 3), (2, 2), (1, 5), (3, 7)])
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("seed", [0, 1])
def test_ngram_kernel_matches_reference(n_min, n_max, k, seed):
    token_ids, rows, known = _case(seed)
    for width in (int(known.max()), token_ids.shape[1]):  # the host bound, tight or loose
        got = token_ids.clone()
        ngram.ngram_propose_triton(got, rows, known, width, k, n_min, n_max)
        assert torch.equal(got, _reference(token_ids, rows, known, width, k, n_min, n_max))


def test_ngram_kernel_prefers_the_longest_then_the_latest_match():
    #              0  1  2  3  4  5  6  7  8  9 10 11
    row = torch.tensor([[7, 1, 2, 9, 3, 1, 2, 8, 4, 7, 1, 2]])
    got = row.clone()
    # last 3 tokens (7 1 2) occur at 0 -> continue with 9 3 1; a 2-gram (1 2) matches later (5)
    ngram.ngram_propose_triton(torch.nn.functional.pad(got, (0, 3)), torch.tensor([0]), torch.tensor([12]), 12, 3, 1, 3)
    padded = torch.nn.functional.pad(row, (0, 3))
    ngram.ngram_propose_triton(padded, torch.tensor([0]), torch.tensor([12]), 12, 3, 1, 3)
    assert padded[0, 12:].tolist() == [9, 3, 1]
    padded = torch.nn.functional.pad(row, (0, 3))
    ngram.ngram_propose_triton(padded, torch.tensor([0]), torch.tensor([12]), 12, 3, 1, 2)
    assert padded[0, 12:].tolist() == [8, 4, 7]  # n <= 2: the latest "1 2" (at 5)


def test_ngram_kernel_refuses_bad_lengths():
    t = torch.zeros(2, 8, dtype=torch.int64)
    with pytest.raises(ValueError, match="n-gram lengths"):
        ngram.ngram_propose_triton(t, torch.tensor([0]), torch.tensor([4]), 8, 2, 3, 2)
    with pytest.raises(ValueError, match="n-gram lengths"):
        ngram.ngram_propose_triton(t, torch.tensor([0]), torch.tensor([4]), 8, 2, 1, 17)


delegate_all(globals(), __file__)  # parent process: each test reports its child run


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("n_min,n_max", [(1, 3), (2, 5)])
def test_gpu_ngram_kernel_matches_reference(n_min, n_max):
    from kernels.ngram import ngram_propose_triton

    token_ids, rows, known = _case(5, n_rows=40, cols=2049, vocab=7)
    ref = _reference(token_ids, rows, known, 2049, 4, n_min, n_max)
    got = token_ids.cuda()
    ngram_propose_triton(got, rows.cuda(), known.cuda(), 2049, 4, n_min, n_max)
    assert torch.equal(got.cpu(), ref)
