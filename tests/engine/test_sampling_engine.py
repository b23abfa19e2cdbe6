"""Sampling end to end through the engine (unit part and ``ref_probs``: test_sampling.py).

Seeded reproducibility (alone / in a batch / after preemption / n > 1), logprobs
against transformers' log_softmax, min_tokens, stop token ids, max_tokens and
ignore_eos, penalties against a transformers-driven numpy reference.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from cluster import LLM, SamplingParams
from tests.worker.test_sampling import ref_probs

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
    engine = LLM(
        model=str(eos_setup["model"]),
        block_size=BLOCK,
        num_kv_blocks=NUM_BLOCKS,
        max_num_batched_tokens=64,
        max_model_len=256,
    )
    yield engine
    engine.engine.scheduler.blocks.check_all_free()
    engine.shutdown()


def cont(tok, prompt, out):
    """The text ``out`` adds after ``prompt`` (what a detokenizer must stream)."""
    return tok.decode(prompt + out, skip_special_tokens=True)[len(tok.decode(prompt, skip_special_tokens=True)) :]


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

    other_seed = (
        llm.generate([p], SamplingParams(temperature=1.0, top_p=0.95, seed=1235, max_tokens=MAX_NEW, ignore_eos=True))[
            0
        ]
        .outputs[0]
        .token_ids
    )
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
    assert (
        greedy.outputs[0].token_ids
        == greedy.outputs[1].token_ids
        == HF(llm.engine.model_dir).greedy(p["prompt_token_ids"], 10)
    )


def test_logprobs_match_transformers(llm):
    hf = HF(llm.engine.model_dir)
    prompts = [_prompt(3, 5), _prompt(4, 17)]
    k = 5
    outs = llm.generate(
        [{"prompt_token_ids": q} for q in prompts],
        [
            SamplingParams(temperature=0, max_tokens=8, logprobs=k, ignore_eos=True),
            SamplingParams(temperature=0.9, seed=3, max_tokens=8, logprobs=0, ignore_eos=True),
        ],
    )
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


def _check_prompt_logprobs(got, q, ref, k):
    """``got`` (a RequestOutput's prompt_logprobs) against transformers' ``ref`` log_softmax rows."""
    assert len(got) == len(q) and got[0] is None
    for i in range(1, len(q)):
        lp, tok = got[i], q[i]
        top = ref[i - 1].topk(k)
        expected = {int(t): float(v) for t, v in zip(top.indices, top.values)}
        expected[tok] = float(ref[i - 1, tok])
        assert set(lp) == set(expected), i
        for t, v in expected.items():
            assert lp[t] == pytest.approx(v, abs=2e-4), (i, t)


def test_prompt_logprobs_match_transformers(llm):
    """Prompt logprobs of every prompt token after the first, over prompts chunked across steps
    (64-token budget) beside a request without them, and again once the prompt is cached (a
    request asking for them computes its whole prompt anyway)."""
    hf = HF(llm.engine.model_dir)
    prompts = [_prompt(7, 100), _prompt(8, 23), _prompt(9, 2)]
    params = [
        SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0, logprobs=1, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=20, ignore_eos=True),
    ]
    plain = {"prompt_token_ids": _prompt(10, 40)}
    for _ in range(2):  # the second time every prompt is in the prefix cache
        outs = llm.generate(
            [{"prompt_token_ids": q} for q in prompts] + [plain], params + [SamplingParams(max_tokens=3)]
        )
        for q, out, sp in zip(prompts, outs, params):
            ref = hf.logits(q).log_softmax(-1)
            _check_prompt_logprobs(out.prompt_logprobs, q, ref, sp.prompt_logprobs)
            assert out.outputs[0].token_ids == hf.greedy(q, 2)
        assert outs[-1].prompt_logprobs is None


def test_logit_bias_matches_transformers(llm):
    """Greedy under a bias (forbidding plain greedy's first token, favouring others) equals
    transformers' argmax of the biased logits; logprobs stay the unbiased ones; sampled
    tokens stay among three favoured by +100, beside an unbiased greedy request."""
    hf = HF(llm.engine.model_dir)
    q = _prompt(11, 12)
    free = hf.greedy(q, 6)
    bias = {free[0]: -100.0, 7: 3.0, 9: 2.5, free[1]: 1.5}
    want = []
    for _ in range(6):
        lg = hf.logits(q + want)[-1]
        for t, b in bias.items():
            lg[t] += b
        want.append(int(lg.argmax()))
    favoured = {11: 100.0, 12: 100, 13: 99.5}
    params = [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias=bias, logprobs=0),
        SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True, logit_bias=favoured),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    ]
    biased, sampled, plain = llm.generate([{"prompt_token_ids": q}] * 3, params)
    assert want[0] != free[0]
    _check_steered(hf, q, want, biased, sampled, set(favoured))
    assert plain.outputs[0].token_ids == free


def _check_steered(hf, q, want, greedy, sampled, sample_ids):
    """The steered greedy row's tokens are ``want`` with the unsteered logits' logprobs; the
    sampled row stays among ``sample_ids`` and takes more than one of them."""
    got = greedy.outputs[0]
    assert got.token_ids == want
    raw = hf.logits(q + want).log_softmax(-1)[len(q) - 1 : -1]
    for i, (tok, lp) in enumerate(zip(want, got.logprobs)):
        assert lp[tok] == pytest.approx(float(raw[i, tok]), abs=2e-4)
    assert set(sampled.outputs[0].token_ids) <= sample_ids and len(set(sampled.outputs[0].token_ids)) > 1


def test_allowed_token_ids_match_transformers(llm):
    """Greedy among allowed ids (plain greedy's first token not among them), with a logit bias
    inside the set, equals transformers' argmax over the allowed ids; logprobs stay the
    unrestricted ones; sampled tokens stay in their set, beside an unrestricted greedy row."""
    hf = HF(llm.engine.model_dir)
    q = _prompt(21, 10)
    free = hf.greedy(q, 6)
    allowed = sorted({7, 9, 30, 31, free[1], free[2]} - {free[0]})
    bias = {30: 2.0}
    want = []
    for _ in range(6):
        lg = hf.logits(q + want)[-1]
        lg[30] += 2.0
        masked = torch.full_like(lg, -math.inf)
        masked[allowed] = lg[allowed]
        want.append(int(masked.argmax()))
    few = [11, 12, 13]
    params = [
        SamplingParams(
            temperature=0, max_tokens=6, ignore_eos=True, allowed_token_ids=allowed, logit_bias=bias, logprobs=0
        ),
        SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, allowed_token_ids=few),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    ]
    restricted, sampled, plain = llm.generate([{"prompt_token_ids": q}] * 3, params)
    assert set(want) <= set(allowed)
    _check_steered(hf, q, want, restricted, sampled, set(few))
    assert plain.outputs[0].token_ids == free


def test_bad_words_match_transformers(llm):
    """A one-token bad word is banned at every step; a bad word of several tokens only where the
    output ends with its other tokens. Greedy equals transformers' under the same bans, beside
    a row without bad words; sampled rows never output a bad word."""
    hf = HF(llm.engine.model_dir)
    q = _prompt(24, 9)
    free = hf.greedy(q, 10)
    pair, single = (free[0], free[1]), free[4]  # (this word-level vocabulary: "wN" is token N)
    words = [f"w{pair[0]} w{pair[1]}", f"w{single}"]
    want = []
    for _ in range(10):
        lg = hf.logits(q + want)[-1]
        lg[single] = -math.inf
        if want and want[-1] == pair[0]:
            lg[pair[1]] = -math.inf
        want.append(int(lg.argmax()))
    params = [
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, bad_words=words),
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=4, max_tokens=30, ignore_eos=True, n=3, bad_words=words),
    ]
    banned, plain, sampled = llm.generate([{"prompt_token_ids": q}] * 3, params)
    assert banned.outputs[0].token_ids == want and want[0] == pair[0] and want[1] != pair[1]
    assert plain.outputs[0].token_ids == free
    for o in sampled.outputs:
        assert single not in o.token_ids
        assert all(o.token_ids[i : i + 2] != list(pair) for i in range(len(o.token_ids) - 1))


def test_truncate_prompt_tokens_keeps_the_tail(llm):
    """``truncate_prompt_tokens=k`` serves the prompt's last k tokens (what the output reports
    and what greedy continues); -1 keeps as many as leave room for one output token (here the
    KV cache's 112 slots bind, not max_model_len), so a longer token list is served, not refused."""
    hf = HF(llm.engine.model_dir)
    q = _prompt(22, 40)
    cut, long_out = llm.generate(
        [{"prompt_token_ids": q}, {"prompt_token_ids": _prompt(23, 300)}],
        [
            SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, truncate_prompt_tokens=7),
            SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, truncate_prompt_tokens=-1),
        ],
    )
    assert cut.prompt_token_ids == q[-7:]
    assert cut.outputs[0].token_ids == hf.greedy(q[-7:], 5)
    assert long_out.prompt_token_ids == _prompt(23, 300)[-(BLOCK * NUM_BLOCKS - 1) :]
    assert len(long_out.outputs[0].token_ids) == 1 and long_out.outputs[0].finish_reason == "length"


def test_priorities_reach_the_engine(llm):
    """``LLM.generate(..., priority=[...])`` as vLLM takes it: one a prompt; this FCFS engine
    serves priority 0 and refuses another naming the policy to start with."""
    p = [{"prompt_token_ids": [5, 6]}] * 2
    outs = llm.generate(p, SamplingParams(max_tokens=2), priority=[0, 0])
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2]
    with pytest.raises(ValueError, match="priority 3: .*scheduling_policy='priority'"):
        llm.generate(p, SamplingParams(max_tokens=2), priority=[0, 3])
    with pytest.raises(ValueError, match="got 1 priorities for 2 prompts"):
        llm.generate(p, SamplingParams(max_tokens=2), priority=[0])


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [3, -1]}, "allowed_token_ids"),
        ({"allowed_token_ids": [3, 256]}, "allowed_token_ids: token id 256 is outside the vocabulary"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"bad_words": [" "]}, "bad_words"),
        ({"bad_words": "w5"}, "bad_words"),
    ],
)
def test_bad_allowed_ids_and_truncation_are_refused(llm, kw, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(max_tokens=2, **kw))


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
    sp = SamplingParams(
        temperature=0, max_tokens=MAX_NEW, stop_token_ids=[stop_tok], ignore_eos=True, include_stop_str_in_output=True
    )
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
    stop = a[-2:] + b[len(a) : len(a) + 2]
    first = full.find(stop)
    assert first >= 0
    n_tok = next(i for i in range(1, MAX_NEW + 1) if stop in cont(tok, p0, g0[:i]))
    for include in (False, True):
        sp = SamplingParams(
            temperature=0,
            max_tokens=MAX_NEW,
            ignore_eos=True,
            stop=[stop, "no such stop"],
            include_stop_str_in_output=include,
        )
        c = llm.generate([p], sp)[0].outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason == stop
        assert c.token_ids == g0[:n_tok]
        assert c.text == full[: first + (len(stop) if include else 0)]


def test_penalties_end_to_end_match_transformers(llm):
    """Greedy decoding under repetition/presence/frequency penalties, alone and in a preempting batch:
    the worker's prompt masks and output counts must follow the sequence (also after recompute)."""
    hf = HF(llm.engine.model_dir)
    cases = [
        dict(repetition_penalty=1.6),
        dict(presence_penalty=1.5),
        dict(frequency_penalty=1.2),
        dict(repetition_penalty=0.7, frequency_penalty=-0.5),
        dict(repetition_penalty=1.3, presence_penalty=0.8, frequency_penalty=0.6),
    ]
    prompts = [_prompt(40 + i, 6 + 5 * i) for i in range(len(cases))]

    def expected(prompt, kw):
        out = []
        for _ in range(MAX_NEW):
            lg = hf.logits(prompt + out)[-1].numpy()
            counts = np.bincount(out, minlength=len(lg)) if out else np.zeros(len(lg))
            pmask = np.zeros(len(lg), bool)
            pmask[prompt] = True
            p = ref_probs(
                lg,
                temperature=0,
                rep=kw.get("repetition_penalty", 1.0),
                presence=kw.get("presence_penalty", 0.0),
                frequency=kw.get("frequency_penalty", 0.0),
                output_counts=counts,
                prompt_mask=pmask,
            )
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
