"""The draft-token kernel (``kernels.draft_sample``) under the Triton interpreter against
``kernels.reference.draft_sample_reference``, and on the GPU at a real vocabulary."""

import pytest
import torch

from kernels.reference import draft_sample_reference, draft_step_inputs_reference
from tests.interpreted import INTERPRETED, delegate_all

if INTERPRETED:
    from kernels import draft_sample
else:
    draft_sample = None  # only the child touches triton


def _case(seed, n=9, V=70, k=3, device="cpu"):
    """Logits, temperatures (every third row greedy), seeds, positions, draft probs, rows,
    a token table (20 columns) and known lengths (one row at the table's end)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, V, generator=g) * 2
    logits[0, 5] = logits[0, 9] = logits[0].max() + 1  # a tie: the lowest id wins
    temperature = torch.where(torch.arange(n) % 3 == 0, 0.0, 0.3 + torch.rand(n, generator=g))
    seeds = torch.randint(-(2**62), 2**62, (n,), generator=g)
    positions = torch.randint(0, 1 << 33, (n,), generator=g)
    probs = torch.rand(n + 3, k, V, generator=g)
    rows = torch.randperm(n + 3, generator=g)[:n]
    table = torch.randint(0, V, (n + 3, 20), generator=g)
    known = torch.randint(1, 18, (n,), generator=g)
    known[1] = 19  # slot 0 lands on the last column, slot 2 past it
    return [x.to(device) for x in (logits, temperature, seeds, positions, probs, rows, table, known)]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("slot", [0, 2])
def test_draft_sample_kernel_matches_reference(seed, slot):
    logits, t, seeds, pos, probs, rows, table, known = _case(seed)
    mine, my_table, fresh = probs.clone(), table.clone(), table.clone()
    got = draft_sample.draft_sample_triton(logits, t, seeds, pos, mine, rows, slot, my_table, known, block=16)
    want = draft_sample_reference(logits, t, seeds, pos, probs, rows, slot, table, known)
    assert torch.equal(got, want) and torch.equal(my_table, table)
    inside = known + slot < 20
    assert torch.equal(table[rows[inside], known[inside] + slot], got[inside])
    assert torch.equal(table[rows[~inside]], fresh[rows[~inside]])  # past the end: nothing written
    torch.testing.assert_close(mine, probs, rtol=1e-5, atol=1e-7)  # p at [rows, slot] of sampled rows only
    assert int(got[0]) == 5
    hot = t > 0
    assert not torch.equal(mine[rows[hot], slot], _case(seed)[4][rows[hot], slot])  # really written


def test_draft_sample_kernel_greedy_only():
    logits, t, seeds, pos, _, rows, table, known = _case(3)
    got = draft_sample.draft_sample_triton(logits, t, seeds, pos, None, rows, 1, table, known, block=32)
    assert torch.equal(got, logits.argmax(-1))
    assert torch.equal(table[rows[2:], known[2:] + 1], got[2:])


def _inputs_case(seed, n=10, bs=4, n_blk=5):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 100, (n,), generator=g)
    pos = torch.randint(0, bs * n_blk + 6, (n,), generator=g)  # some past the table: last page
    pos[0] = 40  # at max_position: clamped
    table = torch.randint(0, 50, (n + 2, n_blk + 3), generator=g, dtype=torch.int32)[:n, :n_blk]  # strided
    capacity = torch.randint(0, bs * n_blk + 2, (n,), generator=g)
    return tokens, pos, table, capacity


@pytest.mark.parametrize("seed", [0, 1])
def test_draft_step_inputs_kernel_matches_reference(seed):
    tokens, pos, table, capacity = _inputs_case(seed)
    outs = []
    for fn, p in ((draft_sample.draft_step_inputs_triton, pos.clone()), (draft_step_inputs_reference, pos.clone())):
        out = (torch.zeros(10, dtype=torch.int64), torch.zeros(10, dtype=torch.int64))
        out += (torch.zeros(10, dtype=torch.int32), torch.zeros(10, dtype=torch.int64))
        fn(tokens, p, table, capacity, 4, 40, out)
        outs.append((*out, p))
    for a, b in zip(*outs):
        assert a.dtype == b.dtype and torch.equal(a, b)
    positions, ids, seq, slots, nxt = outs[1]
    assert torch.equal(positions, pos) and torch.equal(ids, tokens) and torch.equal(seq, (pos + 1).int())
    assert torch.equal(nxt, (pos + 1).clamp(max=40))
    assert bool((slots[pos >= capacity] == -1).all()) and bool((slots[pos < capacity] >= 0).all())


delegate_all(globals(), __file__)  # parent process: each test reports its child run


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_draft_sample_matches_reference():
    from kernels.draft_sample import draft_sample_triton

    args = _case(4, n=48, V=151_936, k=4)
    logits, t, seeds, pos, probs, rows, table, known = [x.cuda() for x in args]
    got = draft_sample_triton(logits.bfloat16(), t, seeds, pos, probs, rows, 1, table, known)
    want = draft_sample_reference(args[0].bfloat16(), *args[1:6], 1, *args[6:])
    assert torch.equal(got.cpu(), want) and torch.equal(table.cpu(), args[6])
    torch.testing.assert_close(probs.cpu(), args[4], rtol=1e-4, atol=1e-7)
