"""Sampling: the device sampler against a numpy reference (engine part: test_sampling_engine.py).

Unit part: ``workers.sampler.sample`` on a tiny vocabulary, many independently
seeded rows, empirical frequencies compared with a plain-numpy reference of the
processed distribution (penalties -> min_tokens -> temperature -> top-k -> top-p
-> min-p). Tokens outside the reference support must never appear.

``ref_probs`` is shared with the engine tests in ``tests/engine/test_sampling_engine.py``.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch

from kernels.reference import uniform_noise
from workers.sampler import PenaltyBatch, SamplingBatch, sample

V = 8
N = 40000  # rows (independent seeds) per statistical check


# --------------------------------------------------------------------------- reference
def ref_probs(
    logits,
    *,
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    min_p=0.0,
    rep=1.0,
    presence=0.0,
    frequency=0.0,
    output_counts=None,
    prompt_mask=None,
    forbid=None,
) -> np.ndarray:
    """The processed next-token distribution, plain numpy (float64), HF/vLLM semantics."""
    x = np.asarray(logits, dtype=np.float64).copy()
    counts = np.zeros(len(x)) if output_counts is None else np.asarray(output_counts, dtype=np.float64)
    pmask = np.zeros(len(x), bool) if prompt_mask is None else np.asarray(prompt_mask, bool)
    seen = (counts > 0) | pmask
    x = np.where(seen, np.where(x > 0, x / rep, x * rep), x)
    x = x - frequency * counts - presence * (counts > 0)
    if forbid is not None:
        x[list(forbid)] = -np.inf
    if temperature == 0:
        p = np.zeros(len(x))
        p[int(np.argmax(x))] = 1.0
        return p
    x = x / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.ones(len(x), bool)
    if top_k:
        keep[order[top_k:]] = False
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    if top_p < 1.0:
        # smallest prefix (by probability) whose mass reaches top_p
        cum = np.cumsum(q[order])
        n_keep = int(np.searchsorted(cum, top_p - 1e-12) + 1)
        keep2 = np.zeros(len(x), bool)
        keep2[order[:n_keep]] = True
        q = np.where(keep2, q, 0.0)
        q /= q.sum()
    if min_p > 0:
        q = np.where(q >= min_p * q.max(), q, 0.0)
        q /= q.sum()
    return q


def run_sampler(
    logits, n=N, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, penalties=None, forbid=None, seed0=0, position=7
) -> np.ndarray:
    """Sample ``n`` rows of the same logits, each with its own seed; returns token ids."""
    lg = torch.tensor(logits, dtype=torch.float32).repeat(n, 1)
    mask = None
    if forbid is not None:
        mask = torch.zeros(n, V, dtype=torch.bool)
        mask[:, list(forbid)] = True
    batch = SamplingBatch(
        temperature=torch.full((n,), float(temperature)),
        top_p=torch.full((n,), float(top_p)),
        top_k=torch.full((n,), int(top_k), dtype=torch.int64),
        min_p=torch.full((n,), float(min_p)),
        seeds=torch.arange(seed0, seed0 + n, dtype=torch.int64) * 7919 + 13,
        positions=torch.full((n,), position, dtype=torch.int64),
        all_greedy=temperature == 0,
        any_top_k_top_p=top_k > 0 or top_p < 1.0,
        any_min_p=min_p > 0,
        penalties=penalties(n) if penalties else None,
        min_tokens_mask=mask,
    )
    return sample(lg, batch).token_ids.numpy()


def assert_matches(tokens: np.ndarray, ref: np.ndarray) -> None:
    freq = np.bincount(tokens, minlength=V) / len(tokens)
    outside = (ref == 0) & (freq > 0)
    assert not outside.any(), f"sampled tokens {np.nonzero(outside)[0].tolist()} outside the support {ref}"
    # ~5 sigma of a binomial frequency at N samples
    tol = 5 * np.sqrt(ref * (1 - ref) / len(tokens)) + 1e-3
    assert np.all(np.abs(freq - ref) <= tol), f"empirical {np.round(freq, 4)} vs reference {np.round(ref, 4)}"


LOGITS = [2.0, 1.4, 1.1, 0.6, 0.2, -0.3, -1.0, -2.2]


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=1.0),
        dict(temperature=0.5),
        dict(temperature=2.0),
        dict(temperature=1.0, top_k=3),
        dict(temperature=1.3, top_k=1),
        dict(temperature=1.0, top_p=0.6),
        dict(temperature=0.7, top_p=0.9),
        dict(temperature=1.0, top_k=5, top_p=0.7),
        dict(temperature=1.0, min_p=0.3),
        dict(temperature=1.5, min_p=0.1, top_k=6),
        dict(temperature=1.0, top_k=4, top_p=0.8, min_p=0.5),
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()),
)
def test_filters_match_reference(kw):
    assert_matches(run_sampler(LOGITS, **kw), ref_probs(LOGITS, **kw))


def test_each_filter_actually_filters():
    """Sanity of the check itself: each filter changes the distribution it is tested on."""
    base = ref_probs(LOGITS)
    for kw in (dict(top_k=3), dict(top_p=0.6), dict(min_p=0.3), dict(temperature=0.5)):
        assert np.abs(ref_probs(LOGITS, **kw) - base).max() > 0.05, kw


def test_top_p_boundary_excludes_the_token_after_the_mass_is_reached():
    """probs 0.5, 0.25, 0.125, 0.125 and top_p = 0.75: the first two already reach 0.75."""
    logits = np.log([0.5, 0.25, 0.125, 0.125, 1e-30, 1e-30, 1e-30, 1e-30]).tolist()
    toks = run_sampler(logits, n=4000, top_p=0.75)
    assert set(np.unique(toks).tolist()) <= {0, 1}
    assert_matches(toks, ref_probs(logits, top_p=0.75))


def test_top_p_one_keeps_tiny_tail():
    """top_p = 1 together with top_k must not drop tokens whose mass rounds away."""
    logits = [30.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0]
    lg = torch.tensor(logits)[None]
    from workers.sampler import _top_k_top_p

    out = _top_k_top_p(lg, torch.tensor([8]), torch.tensor([1.0]))
    assert torch.isfinite(out).all()


def _penalties(counts, pmask, rep, presence, frequency):
    def make(n):
        return PenaltyBatch(
            repetition=torch.full((n,), rep),
            presence=torch.full((n,), presence),
            frequency=torch.full((n,), frequency),
            output_counts=torch.tensor(counts, dtype=torch.int32).repeat(n, 1),
            prompt_mask=torch.tensor(pmask, dtype=torch.bool).repeat(n, 1),
        )

    return make


@pytest.mark.parametrize(
    "rep,presence,frequency",
    [(1.8, 0.0, 0.0), (0.6, 0.0, 0.0), (1.0, 1.2, 0.0), (1.0, 0.0, 0.7), (1.0, -0.8, 0.0), (1.5, 0.5, 0.4)],
)
def test_penalties_match_reference(rep, presence, frequency):
    counts = [3, 0, 1, 0, 2, 0, 0, 0]
    pmask = [False, True, False, False, False, True, False, False]
    logits = [1.5, 1.2, -0.5, 0.9, 0.3, -0.4, 0.1, -1.0]
    kw = dict(rep=rep, presence=presence, frequency=frequency, output_counts=counts, prompt_mask=pmask)
    ref = ref_probs(logits, **kw)
    assert np.abs(ref - ref_probs(logits)).max() > 0.03  # the penalty matters here
    toks = run_sampler(logits, penalties=_penalties(counts, pmask, rep, presence, frequency))
    assert_matches(toks, ref)


def test_greedy_with_penalties_and_forbidden_ids():
    counts = [5, 0, 0, 0, 0, 0, 0, 0]
    pmask = [False] * V
    toks = run_sampler(LOGITS, n=4, temperature=0.0, penalties=_penalties(counts, pmask, 1.0, 0.0, 1.0))
    assert toks.tolist() == [int(np.argmax(ref_probs(LOGITS, temperature=0, frequency=1.0, output_counts=counts)))] * 4
    toks = run_sampler(LOGITS, n=4, temperature=0.0, forbid={0, 1})
    assert toks.tolist() == [2] * 4
    toks = run_sampler(LOGITS, temperature=1.0, forbid={0, 3})
    assert_matches(toks, ref_probs(LOGITS, forbid={0, 3}))


def test_mixed_greedy_and_random_rows():
    n = 6
    lg = torch.tensor(LOGITS).repeat(n, 1)
    temps = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    batch = SamplingBatch(
        temperature=temps,
        top_p=torch.ones(n),
        top_k=torch.zeros(n, dtype=torch.int64),
        min_p=torch.zeros(n),
        seeds=torch.arange(n),
        positions=torch.zeros(n, dtype=torch.int64),
        all_greedy=False,
        any_top_k_top_p=False,
        any_min_p=False,
    )
    toks = sample(lg, batch).token_ids
    assert toks[[0, 2, 4]].tolist() == [0, 0, 0]


def test_seeded_draws_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 64, generator=g)
    seeds = torch.tensor([11, 22, 33, 44, 55])
    pos = torch.tensor([3, 9, 9, 100, 4])

    def batch(idx):
        n = len(idx)
        return SamplingBatch(
            temperature=torch.full((n,), 1.2),
            top_p=torch.full((n,), 0.95),
            top_k=torch.full((n,), 40, dtype=torch.int64),
            min_p=torch.full((n,), 0.01),
            seeds=seeds[idx],
            positions=pos[idx],
            all_greedy=False,
            any_top_k_top_p=True,
            any_min_p=True,
        )

    full = sample(logits, batch(list(range(5)))).token_ids
    for i in range(5):
        alone = sample(logits[[i]], batch([i])).token_ids
        assert alone.item() == full[i].item()
    perm = [4, 2, 0, 3, 1]
    assert sample(logits[perm], batch(perm)).token_ids.tolist() == full[perm].tolist()


def test_noise_is_uniform_and_depends_on_seed_and_position():
    u = uniform_noise(torch.arange(2000, dtype=torch.int64), torch.zeros(2000, dtype=torch.int64), 16)
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01
    hist = torch.histc(u.flatten(), bins=10, min=0, max=1) / u.numel()
    assert float((hist - 0.1).abs().max()) < 0.01
    a = uniform_noise(torch.tensor([5]), torch.tensor([3]), 16)
    assert torch.equal(a, uniform_noise(torch.tensor([5]), torch.tensor([3]), 16))
    assert not torch.equal(a, uniform_noise(torch.tensor([6]), torch.tensor([3]), 16))
    assert not torch.equal(a, uniform_noise(torch.tensor([5]), torch.tensor([4]), 16))
    # seeds that differ only in the high 32 bits differ too
    assert not torch.equal(a, uniform_noise(torch.tensor([5 + (1 << 40)]), torch.tensor([3]), 16))
    # consecutive positions of one seed are not correlated
    seq = uniform_noise(torch.full((4000,), 9), torch.arange(4000), 2)[:, 0].double()
    corr = torch.corrcoef(torch.stack([seq[:-1], seq[1:]]))[0, 1]
    assert abs(float(corr)) < 0.05


def test_logprobs_of_the_sampler():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 32, generator=g)
    n = 3
    batch = SamplingBatch(
        temperature=torch.zeros(n),
        top_p=torch.ones(n),
        top_k=torch.zeros(n, dtype=torch.int64),
        min_p=torch.zeros(n),
        seeds=torch.arange(n),
        positions=torch.zeros(n, dtype=torch.int64),
        all_greedy=True,
        any_top_k_top_p=False,
        any_min_p=False,
        max_num_logprobs=4,
    )
    out = sample(logits, batch)
    ref = logits.double().log_softmax(-1)
    assert torch.allclose(out.sampled_logprob.double(), ref.max(-1).values, atol=1e-5)
    assert out.sampled_rank.tolist() == [1, 1, 1]
    top = ref.topk(4, dim=-1)
    assert torch.equal(out.top_ids, top.indices)
    assert torch.allclose(out.top_logprobs.double(), top.values, atol=1e-5)
