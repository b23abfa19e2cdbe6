"""Sampling: the device sampler against a numpy reference, and end to end through the engine.

Unit part: ``workers.sampler.sample`` on a tiny vocabulary, many independently
seeded rows, empirical frequencies compared with a plain-numpy reference of the
processed distribution (penalties -> min_tokens -> temperature -> top-k -> top-p
-> min-p). Tokens outside the reference support must never appear.

Engine part: seeded reproducibility (alone / in a batch / after preemption /
n > 1), logprobs against transformers' log_softmax, min_tokens, stop token ids,
max_tokens and ignore_eos.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from kernels.reference import uniform_noise
from workers.sampler import PenaltyBatch, SamplingBatch, sample

V = 8
N = 40000  # rows (independent seeds) per statistical check


# --------------------------------------------------------------------------- reference
def ref_probs(logits, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, rep=1.0, presence=0.0,
              frequency=0.0, output_counts=None, prompt_mask=None, forbid=None) -> np.ndarray:
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


def run_sampler(logits, n=N, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, penalties=None,
                forbid=None, seed0=0, position=7) -> np.ndarray:
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
            repetition=torch.full((n,), rep), presence=torch.full((n,), presence),
            frequency=torch.full((n,), frequency),
            output_counts=torch.tensor(counts, dtype=torch.int32).repeat(n, 1),
            prompt_mask=torch.tensor(pmask, dtype=torch.bool).repeat(n, 1),
        )
    return make


@pytest.mark.parametrize(
    "rep,presence,frequency",
    [(1.8, 0.0, 0.0), (0.6, 0.0, 0.0), (1.0, 1.2, 0.0), (1.0, 0.0, 0.7), (1.0, -0.8, 0.0),
     (1.5, 0.5, 0.4)],
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
    batch = SamplingBatch(temperature=temps, top_p=torch.ones(n), top_k=torch.zeros(n, dtype=torch.int64),
                          min_p=torch.zeros(n), seeds=torch.arange(n), positions=torch.zeros(n, dtype=torch.int64),
                          all_greedy=False, any_top_k_top_p=False, any_min_p=False)
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
            temperature=torch.full((n,), 1.2), top_p=torch.full((n,), 0.95),
            top_k=torch.full((n,), 40, dtype=torch.int64), min_p=torch.full((n,), 0.01),
            seeds=seeds[idx], positions=pos[idx], all_greedy=False, any_top_k_top_p=True, any_min_p=True,
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
    batch = SamplingBatch(temperature=torch.zeros(n), top_p=torch.ones(n), top_k=torch.zeros(n, dtype=torch.int64),
                          min_p=torch.zeros(n), seeds=torch.arange(n), positions=torch.zeros(n, dtype=torch.int64),
                          all_greedy=True, any_top_k_top_p=False, any_min_p=False, max_num_logprobs=4)
    out = sample(logits, batch)
    ref = logits.double().log_softmax(-1)
    assert torch.allclose(out.sampled_logprob.double(), ref.max(-1).values, atol=1e-5)
    assert out.sampled_rank.tolist() == [1, 1, 1]
    top = ref.topk(4, dim=-1)
    assert torch.equal(out.top_ids, top.indices)
    assert torch.allclose(out.top_logprobs.double(), top.values, atol=1e-5)


# =========================================================================== engine
from cluster import LLM, SamplingParams  # noqa: E402

BLOCK = 8
NUM_BLOCKS = 14  # 112 token slots: a batch of long requests must preempt
MAX_NEW = 20


class HF:
    """transformers' own model: step-by-step greedy with optional masks, and logits."""

    def __init__(self, model_dir):
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    @torch.no_grad()
    def logits(self, ids: list[int]) -> torch.Tensor:
        return self.model(torch.tensor([ids])).logits[0].double()

    def greedy(self, prompt, steps, forbid=None, min_tokens=0, stop_ids=()):
        out = []
        for _ in range(steps):
            lg = self.logits(prompt + out)[-1]
            if forbid and len(out) < min_tokens:
                lg[list(forbid)] = -math.inf
            tok = int(lg.argmax())
            out.append(tok)
            if tok in stop_ids and len(out) >= min_tokens:
                break
        return out


def _prompt(seed, length):
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(length)]


@pytest.fixture(scope="module")
def base_ckpt(ckpt_dir):
    return ckpt_dir("llama")


@pytest.fixture(scope="module")
def eos_setup(base_ckpt, ckpt_dir):
    """A checkpoint with the same weights whose EOS is a token greedy decoding of P0 emits at k >= 2."""
    hf = HF(base_ckpt)
    p0 = _prompt(0, 6)
    g = hf.greedy(p0, MAX_NEW)
    k = next(i for i in range(2, MAX_NEW) if g[i] not in g[:i])
    eos = g[k]
    model = ckpt_dir("llama", eos_token_id=eos)
    return dict(model=model, hf=hf, p0=p0, g0=g, k=k, eos=eos)


@pytest.fixture(scope="module")
def llm(ray_local, eos_setup):
    engine = LLM(model=str(eos_setup["model"]), block_size=BLOCK, num_kv_blocks=NUM_BLOCKS,
                 max_num_batched_tokens=64, max_model_len=256)
    yield engine
    engine.engine.scheduler.blocks.check_all_free()
    engine.shutdown()


def cont(tok, prompt, out):
    """The text ``out`` adds after ``prompt`` (what a detokenizer must stream)."""
    return tok.decode(prompt + out, skip_special_tokens=True)[len(tok.decode(prompt, skip_special_tokens=True)):]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    p = {"prompt_token_ids": _prompt(1, 9)}
    sp = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=MAX_NEW, ignore_eos=True)
    alone = llm.generate([p], sp)[0].outputs[0].token_ids
    again = llm.generate([p], sp)[0].outputs[0].token_ids
    assert alone == again and len(alone) == MAX_NEW
    assert llm.engine.scheduler.blocks.num_free == NUM_BLOCKS

    # in a batch of other requests, some of them with other options; the target is added
    # last, so it is the preemption victim when the 14 blocks run out
    others = [{"prompt_token_ids": _prompt(10 + i, 14 + 3 * i)} for i in range(4)]
    other_params = [
        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=5, seed=7, max_tokens=MAX_NEW, ignore_eos=True),
        SamplingParams(temperature=1.0, repetition_penalty=1.3, max_tokens=MAX_NEW, ignore_eos=True),
        SamplingParams(temperature=1.2, min_p=0.05, frequency_penalty=0.5, max_tokens=MAX_NEW, ignore_eos=True),
    ]
    before = llm.engine.scheduler.num_preemptions
    outs = llm.generate(others + [p], other_params + [sp], use_tqdm=False)
    assert outs[-1].outputs[0].token_ids == alone
    assert llm.engine.scheduler.num_preemptions > before, "the batch should have forced preemption"
    assert outs[-1].metrics.num_preemptions > 0, "the seeded request itself should have been preempted"

    # the greedy member of the batch equals transformers
    hf = HF(llm.engine.model_dir)
    assert outs[0].outputs[0].token_ids == hf.greedy(others[0]["prompt_token_ids"], MAX_NEW)

    other_seed = llm.generate([p], SamplingParams(temperature=1.0, top_p=0.95, seed=1235, max_tokens=MAX_NEW,
                                                  ignore_eos=True))[0].outputs[0].token_ids
    assert other_seed != alone
    unseeded = _tokens(llm.generate([p, p], SamplingParams(temperature=1.0, max_tokens=MAX_NEW, ignore_eos=True)))
    assert unseeded[0] != unseeded[1]


def test_n_greater_than_one(llm):
    p = {"prompt_token_ids": _prompt(2, 7)}
    sp = SamplingParams(n=3, temperature=1.0, seed=99, max_tokens=10, ignore_eos=True)
    a = llm.generate([p], sp)[0]
    b = llm.generate([p], sp)[0]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    seqs = [c.token_ids for c in a.outputs]
    assert seqs == [c.token_ids for c in b.outputs]
    assert len({tuple(s) for s in seqs}) == 3, "the n samples of one request must differ"
    assert all(len(s) == 10 for s in seqs)
    greedy = llm.generate([p], SamplingParams(n=2, temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids == HF(llm.engine.model_dir).greedy(
        p["prompt_token_ids"], 10)


def test_logprobs_match_transformers(llm):
    hf = HF(llm.engine.model_dir)
    prompts = [_prompt(3, 5), _prompt(4, 17)]
    k = 5
    outs = llm.generate([{"prompt_token_ids": q} for q in prompts],
                        [SamplingParams(temperature=0, max_tokens=8, logprobs=k, ignore_eos=True),
                         SamplingParams(temperature=0.9, seed=3, max_tokens=8, logprobs=0, ignore_eos=True)])
    for q, out, kk in zip(prompts, outs, (k, 0)):
        c = out.outputs[0]
        assert len(c.logprobs) == len(c.token_ids) == 8
        ref = hf.logits(q + c.token_ids).log_softmax(-1)[len(q) - 1 : -1]
        total = 0.0
        for i, (tok, lp) in enumerate(zip(c.token_ids, c.logprobs)):
            assert tok in lp
            assert lp[tok] == pytest.approx(float(ref[i, tok]), abs=2e-4)
            total += lp[tok]
            top = ref[i].topk(kk)
            expected = {int(t): float(v) for t, v in zip(top.indices, top.values)}
            assert set(lp) == set(expected) | {tok}
            for t, v in expected.items():
                assert lp[t] == pytest.approx(v, abs=2e-4)
        assert c.cumulative_logprob == pytest.approx(total, abs=1e-6)
        if kk:
            assert c.token_ids == hf.greedy(q, 8)
    no_lp = llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0, max_tokens=3))[0]
    assert no_lp.outputs[0].logprobs is None and no_lp.outputs[0].cumulative_logprob is None


def test_eos_ignore_eos_and_min_tokens(llm, eos_setup):
    p0, g0, k, eos, hf = (eos_setup[x] for x in ("p0", "g0", "k", "eos", "hf"))
    assert llm.engine.eos_token_ids == (eos,)
    p = {"prompt_token_ids": p0}
    c = llm.generate([p], SamplingParams(temperature=0, max_tokens=MAX_NEW))[0].outputs[0]
    assert c.token_ids == g0[: k + 1] and c.finish_reason == "stop" and c.stop_reason is None

    c = llm.generate([p], SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))[0].outputs[0]
    assert c.token_ids == g0 and c.finish_reason == "length"

    m = k + 3
    c = llm.generate([p], SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=m))[0].outputs[0]
    expected = hf.greedy(p0, MAX_NEW, forbid={eos}, min_tokens=m, stop_ids={eos})
    assert c.token_ids == expected
    assert eos not in c.token_ids[:m]
    assert len(c.token_ids) >= m
    assert c.finish_reason == ("stop" if expected[-1] == eos else "length")


def test_stop_token_ids_and_min_tokens(llm, eos_setup):
    p0, g0, hf = eos_setup["p0"], eos_setup["g0"], eos_setup["hf"]
    j = next(i for i in range(1, MAX_NEW) if g0[i] not in g0[:i])
    stop_tok = g0[j]
    p = {"prompt_token_ids": p0}
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, stop_token_ids=[stop_tok], ignore_eos=True)
    c = llm.generate([p], sp)[0].outputs[0]
    assert c.token_ids == g0[: j + 1] and c.finish_reason == "stop" and c.stop_reason == stop_tok
    tok = llm.get_tokenizer()
    assert c.text == cont(tok, p0, c.token_ids[:-1])  # the stop token's text is not part of the output
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, stop_token_ids=[stop_tok], ignore_eos=True,
                        include_stop_str_in_output=True)
    c = llm.generate([p], sp)[0].outputs[0]
    assert c.text == cont(tok, p0, c.token_ids)

    m = j + 2
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, stop_token_ids=[stop_tok], ignore_eos=True, min_tokens=m)
    c = llm.generate([p], sp)[0].outputs[0]
    assert c.token_ids == hf.greedy(p0, MAX_NEW, forbid={stop_tok}, min_tokens=m, stop_ids={stop_tok})
    assert stop_tok not in c.token_ids[:m]


def test_max_tokens_and_stop_strings(llm, eos_setup):
    p0, g0 = eos_setup["p0"], eos_setup["g0"]
    tok = llm.get_tokenizer()
    p = {"prompt_token_ids": p0}
    for n in (1, 2, 7):
        c = llm.generate([p], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].outputs[0]
        assert c.token_ids == g0[:n] and c.finish_reason == "length"
        assert c.text == cont(tok, p0, g0[:n])
    full = cont(tok, p0, g0)
    # a stop string made of the end of token 4's text and the start of token 5's
    a, b = cont(tok, p0, g0[:5]), cont(tok, p0, g0[:6])
    stop = a[-2:] + b[len(a):len(a) + 2]
    first = full.find(stop)
    assert first >= 0
    n_tok = next(i for i in range(1, MAX_NEW + 1) if stop in cont(tok, p0, g0[:i]))
    for include in (False, True):
        sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, stop=[stop, "no such stop"],
                            include_stop_str_in_output=include)
        c = llm.generate([p], sp)[0].outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason == stop
        assert c.token_ids == g0[:n_tok]
        assert c.text == full[: first + (len(stop) if include else 0)]


def test_penalties_end_to_end_match_transformers(llm):
    """Greedy decoding under repetition/presence/frequency penalties, alone and in a preempting batch:
    the worker's prompt masks and output counts must follow the sequence (also after recompute)."""
    hf = HF(llm.engine.model_dir)
    cases = [dict(repetition_penalty=1.6), dict(presence_penalty=1.5), dict(frequency_penalty=1.2),
             dict(repetition_penalty=0.7, frequency_penalty=-0.5),
             dict(repetition_penalty=1.3, presence_penalty=0.8, frequency_penalty=0.6)]
    prompts = [_prompt(40 + i, 6 + 5 * i) for i in range(len(cases))]

    def expected(prompt, kw):
        out = []
        for _ in range(MAX_NEW):
            lg = hf.logits(prompt + out)[-1].numpy()
            counts = np.bincount(out, minlength=len(lg)) if out else np.zeros(len(lg))
            pmask = np.zeros(len(lg), bool)
            pmask[prompt] = True
            p = ref_probs(lg, temperature=0, rep=kw.get("repetition_penalty", 1.0),
                          presence=kw.get("presence_penalty", 0.0), frequency=kw.get("frequency_penalty", 0.0),
                          output_counts=counts, prompt_mask=pmask)
            out.append(int(np.argmax(p)))
        return out

    want = [expected(p, kw) for p, kw in zip(prompts, cases)]
    plain = hf.greedy(prompts[0], MAX_NEW)
    assert want[0] != plain, "the penalty should change this greedy continuation"
    params = [SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, **kw) for kw in cases]
    alone = [llm.generate([{"prompt_token_ids": p}], sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    assert alone == want
    before = llm.engine.scheduler.num_preemptions
    batch = _tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
    assert batch == want
    assert llm.engine.scheduler.num_preemptions > before
