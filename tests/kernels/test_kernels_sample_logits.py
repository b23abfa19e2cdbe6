"""``kernels.sample_logits`` against its torch reference (``sample_logits_reference``: divide,
softmax, the exponential race, greedy rows kept), under the Triton interpreter on small
shapes (run in an interpreted child pytest: see ``tests/interpreted.py``)."""

import pytest
import torch

from kernels.reference import exponential_noise, sample_logits_reference
from tests.interpreted import INTERPRETED, delegate_all

SLICE, BLOCK = 512, 128


def _draw(logits, temp, seeds, pos, greedy):
    from kernels.sample_logits import sample_logits_triton

    div = torch.where(temp > 0, temp, torch.ones_like(temp))
    return sample_logits_triton(logits, div, temp, seeds, pos, greedy, slice_size=SLICE, block=BLOCK)


def _reference(logits, temp, seeds, pos, greedy):
    div = torch.where(temp > 0, temp, torch.ones_like(temp))
    return sample_logits_reference(logits, div, temp, seeds, pos, greedy)


def _near_tie(logits, temp, seeds, pos, row, a, b) -> bool:
    """Whether tokens ``a`` and ``b`` of ``row`` score alike to float32 rounding (the only
    place the kernel and the reference may part)."""
    probs = (logits[row] / temp[row]).softmax(-1)
    score = probs / exponential_noise(seeds[row : row + 1], pos[row : row + 1], logits.shape[1])[0]
    return abs(score[a] - score[b]) <= 1e-5 * score.max()


def _case(rows=6, vocab=1500, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3
    temp = torch.tensor([0.0, 0.5, 1.0, 2.0, 0.0, 0.8][:rows])
    seeds = torch.tensor([3, 2**40 + 1, -5, 77, 9, 123456789][:rows], dtype=torch.int64)
    pos = torch.tensor([10, 0, 511, 7, 3, 2**31 + 4][:rows], dtype=torch.int64)
    greedy = torch.full((rows,), 7, dtype=torch.int64)  # passed through for greedy rows, not recomputed
    return logits, temp, seeds, pos, greedy


@pytest.mark.parametrize("vocab", [100, 512, 1500, 2049])
def test_matches_the_reference(vocab):
    for seed in range(3):
        case = _case(vocab=vocab, seed=seed)
        got, want = _draw(*case), _reference(*case)
        for r in range(got.shape[0]):
            if got[r] != want[r]:
                assert case[1][r] > 0 and _near_tie(*case[:4], r, int(got[r]), int(want[r])), (r, got, want)
        assert got[0] == 7 and got[4] == 7  # greedy rows: the argmax handed in


def test_a_rows_draw_does_not_depend_on_the_batch():
    logits, temp, seeds, pos, greedy = _case(vocab=1500)
    whole = _draw(logits, temp, seeds, pos, greedy)
    for r in range(logits.shape[0]):
        s = slice(r, r + 1)
        assert _draw(logits[s], temp[s], seeds[s], pos[s], greedy[s])[0] == whole[r]


def test_masked_tokens_and_masked_slices_never_win():
    logits, temp, seeds, pos, greedy = _case(vocab=1500)
    logits[:, :SLICE] = float("-inf")  # a whole slice masked (a min_tokens mask, a padded vocabulary)
    logits[:, 600:1400] = float("-inf")
    got = _draw(logits, temp, seeds, pos, greedy)
    sampled = temp > 0
    assert ((got[sampled] >= 1400) | ((got[sampled] >= SLICE) & (got[sampled] < 600))).all(), got
    assert torch.equal(got, _reference(logits, temp, seeds, pos, greedy))


def test_a_dominant_token_is_drawn_and_seeds_change_draws():
    logits, temp, seeds, pos, greedy = _case(vocab=1500)
    peaked = logits.clone()
    peaked[:, 1234] = 1e4
    assert (_draw(peaked, temp, seeds, pos, greedy)[temp > 0] == 1234).all()
    flat = torch.zeros(6, 1500)
    draws = {tuple(_draw(flat, temp, seeds + k, pos, greedy).tolist()) for k in range(4)}
    assert len(draws) == 4  # a uniform row's draw follows its seed


def test_kernels_are_interpreted():
    assert INTERPRETED


delegate_all(globals(), __file__)
