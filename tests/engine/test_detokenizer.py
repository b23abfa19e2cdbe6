"""Incremental detokenization equals ``tokenizer.decode`` of the full output.

Uses the demo model's byte-level tokenizer (``cluster.demo_model``): one token per
byte, so multi-byte UTF-8 characters span several tokens and random outputs
contain incomplete and invalid sequences. Also the tests' word-level tokenizer,
whose decoder inserts spaces between tokens (the continuation of the prompt).
"""

from __future__ import annotations

import random

import pytest

from cluster.detokenizer import IncrementalDetokenizer, find_stop

TEXTS = [
    "plain ascii text",
    "héllo wörld — ça va? ñandú",
    "中文字符，日本語のテキスト",
    "emoji 🙂🚀👩‍👩‍👧 and flags 🇫🇷",
    "mixed: a€b£c¥d𝄞e",
    "\u0301combining first, then é (e + \u0301)",
]


@pytest.fixture(scope="module")
def demo_tok():
    from transformers import AutoTokenizer

    from cluster.demo_model import ensure_demo_model

    return AutoTokenizer.from_pretrained(ensure_demo_model())


@pytest.fixture(scope="module")
def word_tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from tests.checkpoints import write_tokenizer

    d = tmp_path_factory.mktemp("wordtok")
    write_tokenizer(d, 64)
    return AutoTokenizer.from_pretrained(d)


def stream(tok, prompt_ids, out_ids, skip=True, final=True):
    """Feed ``out_ids`` one at a time; returns (deltas, detokenizer)."""
    d = IncrementalDetokenizer(tok, prompt_ids, skip)
    deltas = []
    for i, t in enumerate(out_ids):
        deltas.append(d.add(t, final=final and i == len(out_ids) - 1))
    return deltas, d


@pytest.mark.parametrize("text", TEXTS)
def test_valid_utf8_streams_exactly(demo_tok, text):
    prompt = demo_tok.encode("prompt ü: ")
    out = demo_tok.encode(text)
    assert len(out) > len(text) or text.isascii()  # multi-byte characters span tokens
    deltas, d = stream(demo_tok, prompt, out)
    assert "".join(deltas) == d.text == demo_tok.decode(out) == text
    # no partial character is ever streamed
    assert all("\ufffd" not in x for x in deltas)
    # each delta ends on a character boundary: the streamed text is always a prefix
    acc = ""
    for x in deltas:
        acc += x
        assert text.startswith(acc)


def test_random_bytes_equal_lossy_decode(demo_tok):
    """Arbitrary byte tokens (invalid and truncated sequences, special tokens mixed in)."""
    rng = random.Random(0)
    utf8_pool = [demo_tok.encode(c) for c in "é中🙂€ñ𝄞"]
    special = [256, 257, 258]
    for trial in range(300):
        out: list[int] = []
        while len(out) < rng.randrange(1, 40):
            r = rng.random()
            if r < 0.35:
                out += rng.choice(utf8_pool)
            elif r < 0.45:
                out += rng.choice(utf8_pool)[: rng.randrange(1, 3)]  # truncated sequence
            elif r < 0.5:
                out.append(rng.choice(special))
            else:
                out.append(rng.randrange(0, 256))
        prompt = demo_tok.encode(rng.choice(TEXTS))
        for skip in (True, False):
            deltas, d = stream(demo_tok, prompt, out, skip=skip)
            expected = demo_tok.decode(out, skip_special_tokens=skip)
            assert d.text == "".join(deltas) == expected, (trial, out)
            # streamed text is always a prefix of the final text
            acc = ""
            for x in deltas:
                acc += x
                assert expected.startswith(acc), (trial, out)


def test_flush_releases_held_bytes(demo_tok):
    prompt = demo_tok.encode("x")
    out = demo_tok.encode("中")
    deltas, d = stream(demo_tok, prompt, out[:2], final=False)
    assert d.text == "" and deltas == ["", ""]
    assert d.flush() == "\ufffd" == demo_tok.decode(out[:2])
    assert d.text == "\ufffd"


def test_word_level_decoder_spacing(word_tok):
    rng = random.Random(1)
    for _ in range(50):
        prompt = [rng.randrange(3, 64) for _ in range(rng.randrange(1, 9))]
        out = [rng.randrange(0, 64) for _ in range(rng.randrange(1, 12))]
        deltas, d = stream(word_tok, prompt, out)
        full = word_tok.decode(prompt + out, skip_special_tokens=True)
        head = word_tok.decode(prompt, skip_special_tokens=True)
        assert d.text == "".join(deltas) == full[len(head) :]


def test_find_stop():
    assert find_stop("hello world", 5, ["wor"]) == (6, "wor")
    assert find_stop("hello world", 3, ["wor"]) == (6, "wor")  # its last char is new
    assert find_stop("hello world", 2, ["wor"]) is None  # it ended before the new text
    assert find_stop("abcabc", 3, ["bc", "ca"]) == (2, "ca")  # earliest one
    assert find_stop("aXbXc", 5, ["X"]) == (1, "X")
    assert find_stop("no stop", 7, []) is None


# ----------------------------------------------------------------- through the engine
@pytest.fixture(scope="module")
def demo_llm(ray_local):
    from cluster import LLM
    from cluster.demo_model import ensure_demo_model

    # the byte-level demo model explicitly (the default model is SmolLM2, a BPE tokenizer)
    llm = LLM(model=str(ensure_demo_model()), block_size=16, num_kv_blocks=64, max_model_len=256)
    yield llm
    llm.engine.scheduler.blocks.check_all_free()
    llm.shutdown()


def _drive(engine, reqs):
    """Add (id, prompt, params) requests, step to the end, collect the streamed deltas."""
    texts = {rid: "" for rid, _, _ in reqs}
    toks = {rid: [] for rid, _, _ in reqs}
    for rid, p, sp in reqs:
        engine.add_request(rid, p, sp)
    while engine.has_unfinished():
        for d in engine.step():
            texts[d.request_id] += d.text
            toks[d.request_id] += d.token_ids
    outs = {rid: engine.output(rid) for rid, _, _ in reqs}
    for rid in texts:
        engine.release(rid)
    return outs, texts, toks


def test_engine_streams_what_decode_gives(demo_llm):
    from cluster import SamplingParams

    tok = demo_llm.get_tokenizer()
    eng = demo_llm.engine
    reqs = [
        (f"d{i}", t, SamplingParams(temperature=1.0, seed=i, max_tokens=48, ignore_eos=True))
        for i, t in enumerate(TEXTS)
    ]
    outs, texts, toks = _drive(eng, reqs)
    for rid, _, _ in reqs:
        c = outs[rid].outputs[0]
        assert toks[rid] == c.token_ids and len(c.token_ids) == 48
        assert c.text == texts[rid] == tok.decode(c.token_ids, skip_special_tokens=True)


def test_engine_stop_string_in_byte_level_text(demo_llm):
    from cluster import SamplingParams

    tok = demo_llm.get_tokenizer()
    eng = demo_llm.engine
    base = SamplingParams(temperature=1.0, seed=11, max_tokens=60, ignore_eos=True)
    outs, _, _ = _drive(eng, [("s0", TEXTS[2], base)])
    full = outs["s0"].outputs[0].text
    ids = outs["s0"].outputs[0].token_ids
    # a 2-character stop string from the middle of the output, without replacement chars
    start = next(i for i in range(len(full) // 3, len(full) - 2) if "\ufffd" not in full[i : i + 2])
    stop = full[start : start + 2]
    first = full.find(stop)
    n_tok = next(i for i in range(1, len(ids) + 1) if stop in tok.decode(ids[:i]))
    for include in (False, True):
        sp = SamplingParams(
            temperature=1.0, seed=11, max_tokens=60, ignore_eos=True, stop=stop, include_stop_str_in_output=include
        )
        outs, texts, toks = _drive(eng, [("s1", TEXTS[2], sp)])
        c = outs["s1"].outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason == stop
        assert c.token_ids == ids[:n_tok]
        expected = full[: first + (len(stop) if include else 0)]
        assert c.text == texts["s1"] == expected


def _llama2_style_tokenizer():
    """SentencePiece-style pieces ("▁" for a space) with byte fallback, decoded as Llama 2's
    tokenizer.json does: Replace, ByteFallback, Fuse, Strip."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["▁", "▁the", "▁cat", "s", "a", "é", "中", "▁sat", ".", "▁▁", "ed"]
    tok = Tokenizer(models.WordLevel(vocab={p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(["<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _bpe_suffix_tokenizer():
    """A decoder whose text depends on the neighbours (BPEDecoder: the end-of-word suffix reads
    as a space except on the last token)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(
        models.WordLevel(vocab={"<unk>": 0, "a</w>": 1, "b": 2, "c</w>": 3, "1": 4, "2": 5}, unk_token="<unk>")
    )
    tok.decoder = decoders.BPEDecoder(suffix="</w>")
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _fused_then_replaced_tokenizer():
    """A Replace acting on the fused text (after Fuse it sees one string): two spaces made one
    across a token boundary, so a token's text depends on its neighbour."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "a": 1, "b ": 2, " b": 3, "c": 4, " ": 5}, unk_token="<unk>"))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse(), decoders.Replace("  ", " ")])
    return PreTrainedTokenizerFast(tokenizer_object=tok)


# tokenizer -> whether its decoder is context-free (the lookup on)
TOKENIZERS = {
    "byte-level": True,
    "word-piece": True,
    "llama2-style": True,
    "bpe-suffix": False,
    "fused-then-replaced": False,
    "smollm2-gguf": True,
}


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def any_tok(request, demo_tok, word_tok):
    made = {
        "byte-level": lambda: demo_tok,
        "word-piece": lambda: word_tok,
        "llama2-style": _llama2_style_tokenizer,
        "bpe-suffix": _bpe_suffix_tokenizer,
        "fused-then-replaced": _fused_then_replaced_tokenizer,
    }
    if request.param in made:
        return request.param, made[request.param]()
    from cluster.model_source import default_model_path, load_tokenizer

    return request.param, load_tokenizer(default_model_path(), None)


def test_looked_up_token_texts_stream_as_window_decodes(any_tok):
    """The steady-state lookup (``TokenTexts.after``) gives every delta the window decode
    gives, token by token: random ids (special, byte and partial-character tokens among
    them), with and without skipping special tokens, final or not."""
    from cluster.detokenizer import TokenTexts

    name, any_tok = any_tok
    rng = random.Random(2)
    vocab = len(any_tok)
    texts = [any_tok.encode(t, add_special_tokens=False) for t in TEXTS + ["the cat sat. the cats", "a1 b2 c"]]
    for skip in (True, False):
        looked_up, decoded = TokenTexts(any_tok, skip), TokenTexts(any_tok, skip)
        decoded._after = None  # every token through the window decode
        for trial in range(60):
            out = list(rng.choice(texts)) if trial % 3 == 0 else []
            out += [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
            prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
            a = IncrementalDetokenizer(any_tok, prompt, skip, looked_up)
            b = IncrementalDetokenizer(any_tok, prompt, skip, decoded)
            for i, t in enumerate(out):
                final = i == len(out) - 1 and trial % 2 == 0
                assert a.add(t, final) == b.add(t, final), (skip, trial, out[: i + 1])
            assert a.flush() == b.flush() and a.text == b.text
    # the lookup is used where the decoder is context-free, never where it is not
    assert looked_up.context_free == TOKENIZERS[name]
    assert any(looked_up._after.values()) if TOKENIZERS[name] else looked_up._after is None


def test_a_custom_decoder_is_not_taken_for_context_free():
    """A decoder whose JSON cannot be read (a custom Python one) takes the window decode."""
    from types import SimpleNamespace

    from cluster.detokenizer import TokenTexts

    class Custom:
        def __getstate__(self):
            raise Exception("Custom PyDecoder cannot be serialized")

    tok = SimpleNamespace(backend_tokenizer=SimpleNamespace(decoder=Custom()))
    assert not TokenTexts(tok, True).context_free


def test_steady_decoding_decodes_each_distinct_token_a_few_times(demo_tok):
    from cluster.detokenizer import TokenTexts

    texts = TokenTexts(demo_tok, True)
    calls = []
    decode = texts.decode
    texts.decode = lambda ids: calls.append(ids) or decode(ids)
    out = demo_tok.encode("the same few words, the same few words " * 20)
    d = IncrementalDetokenizer(demo_tok, demo_tok.encode("x"), True, texts)
    assert "".join(d.add(t) for t in out) == demo_tok.decode(out)
    assert len(calls) <= 3 * len(set(out)) + 4 < len(out)  # window decodes would be one a token at least


def test_text_kept_as_pieces_reads_as_one_string(demo_tok):
    """``since`` and ``truncate`` over the pieces the text grew by equal slicing the whole."""
    rng = random.Random(3)
    for _ in range(200):
        d = IncrementalDetokenizer(demo_tok, [], True)
        whole = ""
        for _ in range(rng.randrange(0, 140)):  # (past the pieces joined every 64)
            piece = "".join(rng.choice("ab€🙂") for _ in range(rng.randrange(0, 4)))
            d._append(piece)
            whole += piece
            pos = rng.randrange(0, len(whole) + 2)
            assert d.since(pos) == whole[pos:] and d.length == len(whole)
        cut = rng.randrange(0, len(whole) + 1)
        d.truncate(cut)
        assert d.text == whole[:cut] and d.length == cut and d.since(0) == whole[:cut]
