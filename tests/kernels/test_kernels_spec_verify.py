"""The speculative verify and commit kernels (``kernels.spec_verify``) under the Triton
interpreter against ``kernels.reference.verify_slots_reference`` /
``accept_commit_reference``, and on the GPU at a real vocabulary."""

import pytest
import torch

from kernels.reference import accept_commit_reference, verify_slots_reference
from tests.interpreted import INTERPRETED, delegate_all

if INTERPRETED:
    from kernels import spec_verify
else:
    spec_verify = None  # only the child touches triton


def _case(seed, R=7, K=3, V=50, probs=False, draft_model=False, device="cpu"):
    """Rows with 0..K drafts; greedy and sampled rows; drafts that are often the argmax, so
    both outcomes of every slot occur; a logits table with extra rows and a spread spec_idx."""
    g = torch.Generator().manual_seed(seed)
    n_logits = R * (K + 1) + 3
    logits = torch.randn(n_logits, V, generator=g) * 3
    if probs:
        logits = logits.softmax(-1) * (torch.rand(n_logits, V, generator=g) > 0.3)  # unnormalised, zeros
    perm = torch.randperm(n_logits, generator=g)[: R * K].view(R, K)
    n_ids = R * (K + 1) + 5
    input_ids = torch.randint(0, V, (n_ids,), generator=g)
    draft_idx = torch.randperm(n_ids, generator=g)[: R * K].view(R, K)
    argmax = logits[perm.reshape(-1)].argmax(-1).view(R, K)
    take = torch.rand(R, K, generator=g) < 0.6
    input_ids[draft_idx[take]] = argmax[take]
    num_drafts = torch.tensor([i % (K + 1) for i in range(R)])
    temperature = torch.where(torch.arange(R) % 3 == 0, 0.0, 0.5 + torch.rand(R, generator=g))
    seeds = torch.randint(0, 2**62, (R,), generator=g)
    positions = torch.randint(K, 500, (R,), generator=g)
    q = rows = None
    if draft_model:
        q = torch.randn(R + 2, K + 1, V, generator=g).softmax(-1)
        rows = torch.randperm(R + 2, generator=g)[:R]
    args = [logits, perm, input_ids, draft_idx, num_drafts, temperature, seeds, positions, q, rows]
    return [a.to(device) if a is not None else None for a in args]


def _check_slots(got, want, num_drafts):
    acc, rec, bonus = got
    acc_w, rec_w, bonus_w = want
    assert torch.equal(acc.cpu(), acc_w.cpu())
    rejected = acc_w.cpu() == 0
    assert torch.equal(rec.cpu()[rejected], rec_w.cpu()[rejected])
    assert (bonus is None) == (bonus_w is None)
    if bonus is not None:
        assert torch.equal(bonus.cpu(), bonus_w.cpu())


def _bonus_idx(logits, spec_idx):
    """Each row's bonus logits row: one its slots do not use (as a verify step lays them out)."""
    used = set(spec_idx.reshape(-1).tolist())
    return torch.tensor([i for i in range(logits.shape[0]) if i not in used][: spec_idx.shape[0]])


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mode", ["ngram", "draft_model", "probs", "ngram+bonus", "draft_model+bonus"])
def test_verify_slots_kernel_matches_reference(seed, mode):
    args = _case(seed, probs=mode == "probs", draft_model=mode.startswith("draft_model"))
    kw = {"probs": mode == "probs"}
    if mode.endswith("+bonus"):
        kw["bonus_idx"] = _bonus_idx(args[0], args[1])
    got = spec_verify.verify_slots_triton(*args, **kw, block=16)  # several vocabulary tiles
    want = verify_slots_reference(*args, **kw)
    _check_slots(got, want, args[4])
    acc = want[0]
    assert bool((acc == 1).any()) and bool((acc[:, 0] == 0).any())  # both outcomes occur


def test_verify_slots_kernel_recovers_from_an_empty_residual():
    """A draft model whose distribution equals the target's leaves an empty residual; a
    rejection is then impossible (accepted with probability one) and the reference falls
    back to p: the kernel too."""
    logits, idx, ids, didx, nd, t, seeds, pos, _, _ = _case(3)
    t = torch.full_like(t, 1.0)
    R, K = idx.shape
    p = logits[idx.reshape(-1)].softmax(-1).view(R, K, -1)
    got = spec_verify.verify_slots_triton(logits, idx, ids, didx, nd, t, seeds, pos, p, torch.arange(R), block=16)
    want = verify_slots_reference(logits, idx, ids, didx, nd, t, seeds, pos, p, torch.arange(R))
    _check_slots(got, want, nd)


def _commit_case(seed, R=6, K=3, counts=True):
    g = torch.Generator().manual_seed(seed)
    accept = (torch.rand(R, K, generator=g) < 0.7).to(torch.int8)
    recovered = torch.randint(0, 40, (R, K), generator=g)
    input_ids = torch.randint(0, 40, (R * K + 4,), generator=g)
    draft_idx = torch.randperm(R * K + 4, generator=g)[: R * K].view(R, K)
    num_drafts = torch.tensor([i % (K + 1) for i in range(R)])
    bonus = torch.randint(0, 40, (R,), generator=g)
    cols = 30
    # one row ends exactly at the table's end: its last tokens would fall past it
    positions = torch.tensor([cols - 1] + [int(x) for x in torch.randint(K, cols - K - 1, (R - 1,), generator=g)])
    rows = torch.randperm(R + 2, generator=g)[:R]
    table = torch.randint(0, 40, (R + 2, cols), generator=g)
    computed = torch.randint(0, 9, (R + 2,), generator=g, dtype=torch.int32)
    out_counts = torch.randint(0, 3, (R + 2, 40), generator=g, dtype=torch.int32) if counts else None
    return [accept, recovered, input_ids, draft_idx, num_drafts, bonus, positions, rows, table, computed, out_counts]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("counts", [True, False])
def test_accept_commit_kernel_matches_reference(seed, counts):
    args = _commit_case(seed, counts=counts)
    mine = [a.clone() if a is not None else None for a in args]
    got = spec_verify.accept_commit_triton(*mine)
    want = accept_commit_reference(*args)
    for g_, w in zip(got, want):
        assert torch.equal(g_, w)
    for i in (8, 9, 10):  # the token table, num_computed, output_counts
        if args[i] is not None:
            assert torch.equal(mine[i], args[i]), i


def test_accept_commit_reference_semantics():
    """A row with drafts 5 6 7 accepting the first two emits 5 6 and its recovered slot-2
    token; a row accepting all three emits them plus the bonus; one with no drafts the bonus."""
    accept = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.int8)
    recovered = torch.tensor([[0, 0, 9], [0, 0, 0], [0, 0, 0]])
    input_ids = torch.tensor([5, 6, 7, 5, 6, 7, 1, 1, 1])
    draft_idx = torch.arange(9).view(3, 3)
    nd = torch.tensor([3, 3, 0])
    bonus = torch.tensor([11, 12, 13])
    positions = torch.tensor([10, 10, 7])  # sampled positions: first new tokens at 7, 7, 7
    table = torch.zeros(3, 12, dtype=torch.int64)
    computed = torch.zeros(3, dtype=torch.int32)
    counts = torch.zeros(3, 20, dtype=torch.int32)
    tokens, n_acc, known = accept_commit_reference(
        accept, recovered, input_ids, draft_idx, nd, bonus, positions, torch.arange(3), table, computed, counts
    )
    assert n_acc.tolist() == [2, 3, 0]
    assert tokens[0, :3].tolist() == [5, 6, 9] and tokens[1].tolist() == [5, 6, 7, 12] and tokens[2, 0] == 13
    assert table[0, 7:10].tolist() == [5, 6, 9] and table[1, 7:11].tolist() == [5, 6, 7, 12]
    assert computed.tolist() == [9, 10, 7] and known.tolist() == [10, 11, 8]
    assert counts[0, 9] == 1 and counts[0, 7] == 0  # the rejected draft is not counted
    assert counts.sum(1).tolist() == [3, 4, 1]


delegate_all(globals(), __file__)  # parent process: each test reports its child run


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["ngram", "draft_model", "probs"])
def test_gpu_verify_and_commit_match_reference(mode):
    from kernels.spec_verify import accept_commit_triton, verify_slots_triton

    args = _case(4, R=64, K=4, V=151_936, probs=mode == "probs", draft_model=mode == "draft_model")
    kw = {"probs": mode == "probs"}
    got = verify_slots_triton(*[a.cuda() if a is not None else None for a in args], **kw)
    want = verify_slots_reference(*args, **kw)
    _check_slots(got, want, args[4])
    c = _commit_case(5, R=64, K=4)
    c[0], c[1] = want[0], torch.where(want[1] >= 0, want[1], 0) % 40
    mine = [a.cuda() if a is not None else None for a in c]
    for g_, w in zip(accept_commit_triton(*mine), accept_commit_reference(*c)):
        assert torch.equal(g_.cpu(), w)
    for i in (8, 9, 10):
        assert torch.equal(mine[i].cpu(), c[i]), i
