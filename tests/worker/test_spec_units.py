"""Speculative decoding building blocks: rejection sampler statistics, n-gram proposers."""

from __future__ import annotations

import pytest
import torch

from cluster.spec_scheduling import ngram_lookup
from workers.rejection_sampler import SpecRows, verify_and_commit
from kernels.ops import exponential_race
from kernels.reference import uniform_noise
from kernels.reference import ngram_drafts_reference as ngram_drafts

V, K = 6, 3


def _verify(logits, drafts, num_drafts, draft_probs, temperature, seeds, positions, bonus):
    """``verify_and_commit`` of rows given as ``logits [R, K, V]``, ``drafts [R, K]`` and
    ``positions``: each row's first draft position. Returns ``(tokens, num_accepted)``."""
    R = logits.shape[0]
    idx = torch.arange(R * K).view(R, K)
    rows = SpecRows(
        logits=logits.reshape(R * K, V),
        spec_idx=idx,
        input_ids=drafts.reshape(-1),
        draft_idx=idx,
        num_drafts=num_drafts,
        positions=positions + num_drafts,
        temperature=temperature,
        top_k=torch.zeros(R, dtype=torch.int64),
        top_p=torch.ones(R),
        min_p=torch.zeros(R),
        seeds=seeds,
        draft_probs=draft_probs,
        draft_rows=torch.arange(R) if draft_probs is not None else None,
        any_top_k_top_p=False,
        any_min_p=False,
    )
    table = torch.zeros(R, 64, dtype=torch.int64)
    computed = torch.zeros(R, dtype=torch.int32)
    _, tokens, n_acc, known = verify_and_commit(rows, bonus, torch.arange(R), table, computed, None)
    assert torch.equal(known, positions + n_acc + 1)
    return tokens, n_acc


def _sample_many(R, probs_q, target_logits, bonus_logits, use_draft_probs):
    """R independent rows with the same target/draft distributions, different seeds."""
    seeds = torch.arange(R, dtype=torch.int64) * 7919 + 11
    pos = torch.full((R,), 40, dtype=torch.int64)
    # drafts drawn from q (independent stream), as a draft model would
    drafts = torch.stack(
        [exponential_race(probs_q[j].expand(R, V), seeds ^ 0xABCDEF, pos + j) for j in range(K)], dim=1
    )
    logits = target_logits.expand(R, K, V).clone()
    draft_probs = probs_q.expand(R, K, V).clone() if use_draft_probs else None
    bonus = exponential_race(bonus_logits.softmax(-1).expand(R, V), seeds, pos + K)
    return _verify(logits, drafts, torch.full((R,), K), draft_probs, torch.ones(R), seeds, pos, bonus), drafts


def _tv(samples: torch.Tensor, p: torch.Tensor) -> float:
    emp = torch.bincount(samples, minlength=V).double() / max(len(samples), 1)
    return 0.5 * float((emp - p.double()).abs().sum())


@pytest.mark.parametrize("use_draft_probs", [True, False], ids=["draft_model", "point_mass"])
def test_rejection_sampler_follows_target_distribution(use_draft_probs):
    g = torch.Generator().manual_seed(0)
    target_logits = torch.randn(K, V, generator=g) * 1.5
    bonus_logits = torch.randn(V, generator=g)
    q = torch.randn(K, V, generator=g).softmax(-1)  # a draft far from the target
    p = target_logits.softmax(-1)
    R = 40000
    (tokens, n_acc), drafts = _sample_many(R, q, target_logits, bonus_logits, use_draft_probs)
    # slot 0 is always emitted: it must follow the target's first-slot distribution
    assert _tv(tokens[:, 0], p[0]) < 0.015
    # given slot 0 accepted, slot 1 follows the target's second-slot distribution
    sel = n_acc >= 1
    assert sel.sum() > 2000
    assert _tv(tokens[sel, 1], p[1]) < 0.03
    # all accepted: the bonus token follows the bonus distribution
    full = n_acc == K
    assert full.sum() > 300
    assert _tv(tokens[full, K], bonus_logits.softmax(-1)) < 0.07
    # the acceptance rate matches the theory: sum_x min(p, q) (point mass: E_q[p(d)])
    expect = float(torch.minimum(p[0], q[0]).sum()) if use_draft_probs else float((p[0] * q[0]).sum())
    assert abs(float((n_acc >= 1).double().mean()) - expect) < 0.015
    assert bool(((tokens[:, :1] == drafts[:, :1])[:, 0] | (n_acc == 0)).all())


def test_a_broken_rule_fails_the_distribution_check():
    """Accepting every draft would output the draft distribution: the TV check catches it."""
    g = torch.Generator().manual_seed(1)
    target_logits = torch.randn(K, V, generator=g) * 1.5
    q = torch.randn(K, V, generator=g).softmax(-1)
    R = 40000
    seeds = torch.arange(R, dtype=torch.int64)
    drafts = exponential_race(q[0].expand(R, V), seeds ^ 0xABCDEF, torch.zeros(R, dtype=torch.int64))
    assert _tv(drafts, target_logits.softmax(-1)[0]) > 0.05


def test_greedy_verification_matches_argmax_chain():
    g = torch.Generator().manual_seed(2)
    R = 64
    logits = torch.randn(R, K, V, generator=g)
    argmax = logits.argmax(-1)
    drafts = argmax.clone()
    # corrupt a random slot per row (or none)
    bad = torch.randint(0, K + 1, (R,), generator=g)
    for r in range(R):
        if bad[r] < K:
            drafts[r, bad[r]] = (argmax[r, bad[r]] + 1) % V
    num = torch.randint(0, K + 1, (R,), generator=g)
    bonus = torch.randint(0, V, (R,), generator=g)
    zeros = torch.zeros(R, dtype=torch.int64)
    tokens, n_acc = _verify(logits, drafts, num, None, torch.zeros(R), zeros, zeros, bonus)
    for r in range(R):
        k = int(num[r])
        a = 0
        while a < k and drafts[r, a] == argmax[r, a]:
            a += 1
        assert int(n_acc[r]) == a
        want = [int(x) for x in argmax[r, :a]] + [int(argmax[r, a]) if a < k else int(bonus[r])]
        assert tokens[r, : a + 1].tolist() == want


def test_device_ngram_matches_host_lookup():
    g = torch.Generator().manual_seed(3)
    for trial in range(200):
        L = int(torch.randint(2, 30, (1,), generator=g))
        toks = torch.randint(0, 4, (L,), generator=g).tolist()
        hist = torch.tensor(toks + [99] * 5)[None, :]
        dev = ngram_drafts(hist, torch.tensor([L]), 3, 1, 3)[0].tolist()
        host = ngram_lookup(toks, 3, 1, 3)
        if host:  # host may return fewer than k near the end; the device pads with known tokens
            assert dev[: len(host)] == host, (toks, dev, host)
        else:
            assert dev == [toks[-1]] * 3


def test_uniform_noise_streams_differ():
    seeds = torch.arange(8, dtype=torch.int64)
    pos = torch.zeros(8, dtype=torch.int64)
    assert not torch.equal(uniform_noise(seeds, pos, 4), uniform_noise(seeds ^ 0x5EC00001, pos, 4))


def test_bonus_sampled_in_the_verify_equals_the_sampler():
    """Without penalties or logprobs a verify step samples its bonus tokens in the verify
    launch: the very tokens ``workers.sampler.sample`` draws from those logits."""
    from workers.sampler import SamplingBatch, sample

    g = torch.Generator().manual_seed(5)
    R = 16
    logits = torch.randn(R * (K + 1), V, generator=g)
    idx = torch.arange(R * (K + 1)).view(R, K + 1)
    drafts = torch.randint(0, V, (R * (K + 1),), generator=g)
    temperature = torch.where(torch.arange(R) % 2 == 0, 0.0, 0.7)
    seeds, pos = torch.arange(R) * 31 + 5, torch.randint(K, 90, (R,), generator=g)
    rows = SpecRows(
        logits=logits, spec_idx=idx[:, :K], input_ids=drafts, draft_idx=idx[:, :K], num_drafts=torch.full((R,), K),
        positions=pos, temperature=temperature, top_k=torch.zeros(R, dtype=torch.int64), top_p=torch.ones(R),
        min_p=torch.zeros(R), seeds=seeds, draft_probs=None, draft_rows=None, any_top_k_top_p=False, any_min_p=False,
    )  # fmt: skip
    table, computed = torch.zeros(R, 128, dtype=torch.int64), torch.zeros(R, dtype=torch.int32)
    bonus, tokens, n_acc, _ = verify_and_commit(rows, None, torch.arange(R), table, computed, None, idx[:, K])
    batch = SamplingBatch(
        temperature=temperature, top_p=torch.ones(R), top_k=torch.zeros(R, dtype=torch.int64), min_p=torch.zeros(R),
        seeds=seeds, positions=pos, all_greedy=False, any_top_k_top_p=False, any_min_p=False,
    )  # fmt: skip
    want = sample(logits[idx[:, K]], batch).token_ids
    assert torch.equal(bonus, want)
    assert bool((temperature[bonus != logits[idx[:, K]].argmax(-1)] > 0).all())  # sampled rows really drew
    full = n_acc == K
    assert torch.equal(tokens[full, K], want[full])


def test_greedy_rows_beside_top_k_rows_verify_against_the_logits():
    """A batch with top-k rows verifies through probabilities; its greedy rows still check the
    argmax of the logits: two logits 1e-8 apart give one float32 probability, and a greedy
    row must still pick the larger logit, as plain greedy decoding does."""
    R = 2
    logits = torch.full((R * K, V), -5.0)
    logits[:, 1] = 1e-8  # the argmax; token 0 gets the same probability
    logits[:, 0] = 0.0
    idx = torch.arange(R * K).view(R, K)
    drafts = torch.ones(R * K, dtype=torch.int64)
    rows = SpecRows(
        logits=logits, spec_idx=idx, input_ids=drafts, draft_idx=idx, num_drafts=torch.full((R,), K),
        positions=torch.full((R,), 9), temperature=torch.tensor([0.0, 0.8]),
        top_k=torch.tensor([0, V]), top_p=torch.ones(R), min_p=torch.zeros(R), seeds=torch.arange(R),
        draft_probs=None, draft_rows=None, any_top_k_top_p=True, any_min_p=False,
    )  # fmt: skip
    table, computed = torch.zeros(R, 32, dtype=torch.int64), torch.zeros(R, dtype=torch.int32)
    _, tokens, n_acc, _ = verify_and_commit(
        rows, torch.zeros(R, dtype=torch.int64), torch.arange(R), table, computed, None
    )
    assert int(n_acc[0]) == K and tokens[0, :K].tolist() == [1] * K
