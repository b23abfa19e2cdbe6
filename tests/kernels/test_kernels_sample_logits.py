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


def test_every_rows_last_slice_picks_and_re_arms_its_counter():
    """One launch: each row's last slice to arrive picks (a row no slice picked would keep
    ``torch.empty``'s garbage, caught by the reference) and zeroes its arrival counter, so
    the next launch counts from 0 (a counter left at n would never pick again)."""
    from kernels.attention_splits import arrival_counters

    case = _case(vocab=1500)
    for _ in range(3):  # (the same counters, three launches)
        got, want = _draw(*case), _reference(*case)
        assert int(arrival_counters(case[0].device, 1, user="sampler").count_nonzero()) == 0
        for r in range(got.shape[0]):
            assert got[r] == want[r] or _near_tie(*case[:4], r, int(got[r]), int(want[r])), (r, got, want)


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


def _table_case(rows=6, vocab=1500, seed=0):
    """``_case``'s options written into an option table of 16 device rows (the words as
    ``workers.device_state.option_words`` lays them out), the rows placed out of order, and a
    token table to commit into."""
    from workers.device_state import DIVISOR_WORD, OPTION_WORDS, SEED_WORD, TEMPERATURE_WORD

    logits, temp, seeds, pos, greedy = _case(rows, vocab, seed)
    pos = pos % 40  # (positions inside the token table)
    dev_rows = torch.tensor([9, 2, 15, 0, 4, 11][:rows] + [0] * (-rows % 4), dtype=torch.int64)
    table = torch.full((OPTION_WORDS, 16), -1, dtype=torch.int64)
    div = torch.where(temp > 0, temp, torch.ones_like(temp))
    table[TEMPERATURE_WORD, dev_rows[:rows]] = temp.view(torch.int32).long()
    table[DIVISOR_WORD, dev_rows[:rows]] = div.view(torch.int32).long()
    table[SEED_WORD, dev_rows[:rows]] = seeds
    words = (table[DIVISOR_WORD], table[TEMPERATURE_WORD], table[SEED_WORD])
    return (logits, temp, seeds, pos, greedy), words, dev_rows, torch.full((16, 40), -3, dtype=torch.int64)


@pytest.mark.parametrize("pos_dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
@pytest.mark.parametrize("commit", [False, True], ids=["draw", "draw-and-commit"])
def test_options_read_from_the_table_draw_the_same_tokens(commit, pos_dtype):
    """Read in place at each row's device row, the options give the draws their gathered
    copies give; with ``commit`` every row's token also lands at its device row and position
    of the token table, and nothing else in the table changes. Positions may come as the
    step's int32 lengths."""
    from kernels.sample_logits import sample_logits_triton

    for seed in range(2):
        case, (div, temp_w, seed_w), dev_rows, tokens = _table_case(seed=seed)
        want = _draw(*case)
        got = sample_logits_triton(
            case[0], div, temp_w, seed_w, case[3].to(pos_dtype), case[4], slice_size=SLICE, block=BLOCK,
            option_rows=dev_rows, commit=tokens if commit else None,
        )  # fmt: skip
        assert torch.equal(got, want), (got, want)
        ref_tokens = torch.full_like(tokens, -3)
        ref = sample_logits_reference(
            case[0], div, temp_w, seed_w, case[3], case[4], option_rows=dev_rows, commit=ref_tokens if commit else None
        )
        assert torch.equal(ref, _reference(*case))
        if commit:
            expect = torch.full_like(tokens, -3)
            expect[dev_rows[:6], case[3]] = want
            assert torch.equal(tokens, expect) and torch.equal(ref_tokens, expect)
        else:
            assert (tokens == -3).all()


def test_commit_needs_the_rows():
    from kernels.sample_logits import sample_logits_triton

    case, (div, temp_w, seed_w), _, tokens = _table_case()
    with pytest.raises(ValueError, match="option_rows"):
        sample_logits_triton(*case[:1], div, temp_w, seed_w, case[3], case[4], commit=tokens)


def test_kernels_are_interpreted():
    assert INTERPRETED


delegate_all(globals(), __file__)
