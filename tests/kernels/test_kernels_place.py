"""The placement kernel (``kernels.place``) under the Triton interpreter against its torch
reference: tokens, prompt bits, resumed outputs' counts (repeats accumulate), lengths."""

import random

import pytest
import torch

from kernels.place import place_requests_reference
from tests.interpreted import INTERPRETED, delegate_all

if INTERPRETED:
    from kernels import place
else:
    place = None  # only the child touches triton


def _state(rows=6, cols=40, vocab=30):
    g = torch.Generator().manual_seed(rows)
    return (
        torch.randint(0, vocab, (rows, cols), generator=g),  # token_ids (stale values)
        torch.randint(0, 9, (rows,), generator=g, dtype=torch.int32),  # num_computed
        torch.randint(0, 9, (rows,), generator=g, dtype=torch.int32),  # prompt_len
        torch.rand(rows, vocab, generator=g) < 0.3,  # prompt_mask (stale bits: a stray write shows)
        torch.randint(0, 4, (rows, vocab), generator=g, dtype=torch.int32),  # output_counts
        torch.randint(-(2**40), 2**40, (10, rows), generator=g),  # option_table (stale words)
    )


def _placement(seed, n_req, vocab=30, block=None):
    """Requests with prompts and (for some) outputs to recompute, in add_many's layout:
    every prompt token first, then every output token."""
    rng = random.Random(seed)
    rows = rng.sample(range(6), n_req)
    plens = [rng.randrange(1, 15) for _ in rows]
    olens = [rng.choice([0, 0, 3, 9]) for _ in rows]
    tok, trow, tcol = [], [], []
    for r, p in zip(rows, plens):
        tok += [rng.randrange(vocab) for _ in range(p)]
        trow += [r] * p
        tcol += list(range(p))
    for r, p, o in zip(rows, plens, olens):
        tok += [rng.choice([1, 2, 3]) for _ in range(o)]  # a small choice: repeated output tokens
        trow += [r] * o
        tcol += list(range(p, p + o))
    cached = [rng.randrange(0, p + 1) for p in plens]
    words = [rng.randrange(-(2**62), 2**62) for _ in range(10 * n_req)]  # float bits, seeds...
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    return t(tok), t(trow), t(tcol), sum(plens), t(rows), t(cached), t(plens), t(words)


def _check(args, block):
    want, got = _state(), _state()
    before = got[4].sum()
    place_requests_reference(*want, *args)
    place.place_requests_triton(*got, *args, block=block)
    names = ("token_ids", "num_computed", "prompt_len", "prompt_mask", "output_counts", "option_table")
    for name, a, b in zip(names, want, got):
        assert torch.equal(a, b), name
    assert got[4].sum() - before == args[0].shape[0] - args[3]  # every output token counted once


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("n_req", [1, 4, 6])
@pytest.mark.parametrize("block", [4, 16])  # (4: the lengths loop runs twice for 6 requests)
def test_place_kernel_matches_reference(seed, n_req, block):
    _check(_placement(seed, n_req), block)


def test_place_kernel_without_prompt_tokens_or_any_token():
    tok, trow, tcol, tp, rows, cached, plen, words = _placement(4, 3)
    outs = slice(tp, None)
    _check((tok[outs], trow[outs], tcol[outs], 0, rows, cached, plen, words), 4)  # only resumed outputs
    empty = torch.empty(0, dtype=torch.int64)
    _check((empty, empty, empty, 0, rows, cached, plen, words), 4)  # lengths and options only


delegate_all(globals(), __file__)  # parent process: each test reports its child run


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_place_kernel_matches_reference():
    from kernels.place import place_requests_triton

    from kernels import place

    for seed, block in ((3, 16), (5, 16), (3, 256)):  # several token programs; a repeat launches directly
        args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in _placement(seed, 6)]
        want = [x.cuda() for x in _state()]
        got = [x.cuda() for x in _state()]
        place_requests_reference(*want, *args)
        place_requests_triton(*got, *args, block=block)
        for a, b in zip(want, got):
            assert torch.equal(a, b)
    assert place._place_kernel.hits > 0
