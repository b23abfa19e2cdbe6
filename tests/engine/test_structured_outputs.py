"""Structured outputs end to end on the byte-level demo model (``cluster.demo_model``): greedy
decoding under a JSON schema, a regex and a choice equals transformers' argmax of the same
logits under the same xgrammar mask, token for token, beside an unconstrained request, under
sync and async scheduling; sampled outputs satisfy their constraint; bad constraints are
refused naming themselves."""

from __future__ import annotations

import json
import re

import pytest
import torch

from cluster import LLM, SamplingParams
from cluster.input_processor import InvalidRequestError
from metadata.sampling_params import SamplingParamsError

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "blue"]}},
    "required": ["ok", "tag"],
}
CONSTRAINTS = [{"json": SCHEMA}, {"regex": "[0-9]{2}-[a-z]{3}"}, {"choice": ["yes", "no", "maybe"]}]
PROMPT = "Answer: "


@pytest.fixture(scope="module")
def demo():
    from cluster.demo_model import ensure_demo_model

    return ensure_demo_model()


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(ray_local, demo, request):
    engine = LLM(model=str(demo), block_size=16, num_kv_blocks=64, max_model_len=256, async_scheduling=request.param)
    yield engine
    engine.engine.scheduler.blocks.check_all_free()
    engine.shutdown()


def _reference(demo, constraint, max_tokens):
    """transformers' greedy tokens, each the argmax of its logits under xgrammar's mask."""
    import transformers
    import xgrammar as xgr

    tok = transformers.AutoTokenizer.from_pretrained(demo)
    model = transformers.AutoModelForCausalLM.from_pretrained(demo, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab), max_threads=1)
    if "json" in constraint:
        compact = constraint.get("disable_any_whitespace", False)
        compiled = compiler.compile_json_schema(json.dumps(constraint["json"]), any_whitespace=not compact)
    elif "regex" in constraint:
        compiled = compiler.compile_regex(constraint["regex"])
    else:
        compiled = compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in constraint["choice"]))
    matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=[model.config.eos_token_id])
    mask = xgr.allocate_token_bitmask(1, vocab)
    ids, out = tok.encode(PROMPT), []
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([ids + out])).logits[0, -1:].float()
        matcher.fill_next_token_bitmask(mask)
        xgr.apply_token_bitmask_inplace(logits, mask)
        t = int(logits.argmax())
        out.append(t)
        assert matcher.accept_token(t)
        if matcher.is_terminated():
            break
    return out


def test_greedy_under_constraints_matches_transformers(llm, demo):
    params = [SamplingParams(temperature=0, max_tokens=48, structured_outputs=c) for c in CONSTRAINTS]
    params.append(SamplingParams(temperature=0, max_tokens=8))  # unconstrained, in the same steps
    outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    for c, out in zip(CONSTRAINTS, outs):
        assert out.outputs[0].token_ids == _reference(demo, c, 48), c
    # (greedy JSON on these random weights runs on in whitespace the schema allows: no stop)
    assert outs[0].outputs[0].text.startswith('{"ok":')
    assert [o.outputs[0].finish_reason for o in outs[1:]] == ["stop", "stop", "length"]
    assert re.fullmatch("[0-9]{2}-[a-z]{3}", outs[1].outputs[0].text)
    assert outs[2].outputs[0].text in ("yes", "no", "maybe")
    assert len(outs[3].outputs[0].token_ids) == 8


def test_compact_json_matches_transformers(llm, demo):
    """``disable_any_whitespace``: greedy JSON under xgrammar's fixed-whitespace schema equals
    transformers' under the same mask, and (where the default runs on in whitespace) ends."""
    compact = {"json": SCHEMA, "disable_any_whitespace": True}
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=48, structured_outputs=compact))[0]
    assert out.outputs[0].token_ids == _reference(demo, compact, 48)
    assert out.outputs[0].finish_reason == "stop" and json.loads(out.outputs[0].text)["tag"] in ("red", "blue")
    assert out.outputs[0].text == json.dumps(json.loads(out.outputs[0].text))  # one space after : and ,


def test_sampled_outputs_satisfy_their_constraint(llm):
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=200, structured_outputs=CONSTRAINTS[s % 3], n=2)
        for s in range(6)
    ]
    for s, out in enumerate(llm.generate([PROMPT] * 6, params, use_tqdm=False)):
        for o in out.outputs:
            assert o.finish_reason == "stop", (s, o.text)
            if s % 3 == 0:
                assert json.loads(o.text)["tag"] in ("red", "blue")
            elif s % 3 == 1:
                assert re.fullmatch("[0-9]{2}-[a-z]{3}", o.text)
            else:
                assert o.text in ("yes", "no", "maybe")


def test_bad_words_narrow_a_constraint(llm):
    """Bad words around a constraint: outputs satisfy the regex and hold neither word."""
    params = [
        SamplingParams(
            temperature=1.0, seed=s, max_tokens=40, n=2, structured_outputs=CONSTRAINTS[1], bad_words=["-a", "7", "1"]
        )
        for s in range(4)
    ]
    texts = [o.text for out in llm.generate([PROMPT] * 4, params, use_tqdm=False) for o in out.outputs]
    assert all(re.fullmatch("[0-9]{2}-[b-z][a-z]{2}", t) and not {"7", "1"} & set(t) for t in texts), texts


def test_allowed_token_ids_narrow_a_constraint(llm):
    """A row with a constraint and ``allowed_token_ids`` samples where both allow (the AND of
    the two masks), beside a row with the ids alone."""
    tok = llm.get_tokenizer()
    chars = "12-abc"
    ids = [tok.convert_tokens_to_ids(c) for c in chars] + list(llm.engine.eos_token_ids)
    params = [
        SamplingParams(
            temperature=1.0, seed=s, max_tokens=40, n=2, structured_outputs=CONSTRAINTS[1], allowed_token_ids=ids
        )
        for s in range(3)
    ]
    params.append(SamplingParams(temperature=1.0, seed=9, max_tokens=12, ignore_eos=True, allowed_token_ids=ids[:3]))
    outs = llm.generate([PROMPT] * 4, params, use_tqdm=False)
    texts = [o.text for out in outs[:3] for o in out.outputs]
    assert all(re.fullmatch("[12]{2}-[abc]{3}", t) for t in texts), texts
    assert len(set(texts)) > 1
    assert set(outs[3].outputs[0].text) <= set("12-") and len(outs[3].outputs[0].token_ids) == 12


@pytest.mark.parametrize(
    "constraint,error,text",
    [
        ({"regex": "[0-9"}, InvalidRequestError, "regex does not compile"),
        ({"json": {"type": "objekt"}}, InvalidRequestError, "json does not compile"),
        ({"choice": []}, SamplingParamsError, "choice must be a list of 1 to"),
        ({"regex": "a", "choice": ["b"]}, SamplingParamsError, "exactly one of"),
    ],
)
def test_bad_constraints_are_refused(llm, constraint, error, text):
    with pytest.raises(error, match=text):
        llm.engine.add_request("bad", PROMPT, SamplingParams(max_tokens=4, structured_outputs=constraint))
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize(
    "kw,text",
    [
        (dict(structured_outputs={"json": " "}), "a JSON schema"),
        (dict(structured_outputs={"regex": "[a-z ]{1,60000}"}), "above 4096"),
        (dict(structured_outputs={"json": {"type": "string", "maxLength": 100000}}), "above 4096"),
        (dict(structured_outputs={"json": json.loads('{"a":' * 70 + "1" + "}" * 70)}), "deeper than 64"),
        (dict(structured_outputs={"choice": ["a"]}, min_tokens=2), "min_tokens must be 0 with structured_outputs"),
    ],
)
def test_constraints_that_would_stall_or_break_are_refused(kw, text):
    with pytest.raises(SamplingParamsError, match=text):
        SamplingParams(max_tokens=4, **kw)
