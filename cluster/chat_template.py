"""Chat templates rendered in a jinja2 sandbox with limits.

Templates are code: the model's own, the operator's (``--chat-template``) and, only
where the operator opts in (``--trust-request-chat-template``), a client's. All of
them render in an ``ImmutableSandboxedEnvironment`` (no attribute writes, no access to
internals) that also bounds what one render may cost: string/list repetition and
concatenation, ``**`` and integer arguments of calls (``'a' * 10**9``,
``'x'.center(10**9)``) are refused past ``max_chars``, the output is cut off at
``max_chars``, and a render that runs longer than ``max_seconds`` is stopped at its
next expression. The variables and helpers match transformers' ``apply_chat_template``
(messages, add_generation_prompt, the tokenizer's special tokens, ``raise_exception``,
``tojson``, ``strftime_now``, ``namespace``), so the rendered text is the same.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_CHARS = 4 << 20  # the largest string or list a template may build, and its output
MAX_SECONDS = 2.0
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(ValueError):
    """The template failed, broke a limit, or the conversation does not fit it."""


_budget = threading.local()  # .deadline: when the render in progress on this thread must stop


class LimitedSandbox(ImmutableSandboxedEnvironment):
    """An immutable sandbox whose renders are bounded in size and time."""

    intercepted_binops = frozenset({"*", "**", "+"})
    max_chars = MAX_CHARS

    def _tick(self) -> None:
        if time.monotonic() > getattr(_budget, "deadline", float("inf")):
            raise SecurityError(f"the chat template ran longer than {MAX_SECONDS:g} s")

    def call_binop(self, context, operator, left, right):
        self._tick()
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > 64:
            raise SecurityError("the chat template raises to a power above 64")
        elif operator == "*":
            for seq, k in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(k, int) and len(seq) * k > self.max_chars:
                    raise SecurityError(f"the chat template builds a value longer than {self.max_chars} items")
        elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            if len(left) + len(right) > self.max_chars:
                raise SecurityError(f"the chat template builds a value longer than {self.max_chars} items")
        return super().call_binop(context, operator, left, right)

    def call(self, context, obj, /, *args, **kwargs):
        self._tick()
        for a in (*args, *kwargs.values()):
            if isinstance(a, int) and not isinstance(a, bool) and abs(a) > self.max_chars:
                raise SecurityError(f"the chat template passes {a} to a call (the limit is {self.max_chars})")
        return super().call(context, obj, *args, **kwargs)

    def getattr(self, obj, attribute):
        self._tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        self._tick()
        return super().getitem(obj, argument)


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask tag): renders its body."""

    tags = frozenset({"generation"})

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore names (no way towards internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


def _raise_exception(message):
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The template compiled in a ``LimitedSandbox`` (cached: templates repeat)."""
    env = LimitedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        namespace=_Namespace,
        dict=lambda *a, **k: dict(*a, **k),
    )
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise ChatTemplateError(f"the chat template does not compile: {exc}") from None


def render_chat_template(
    source: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    continue_final_message: bool = False,
    special_tokens: dict[str, str] | None = None,
    kwargs: dict[str, Any] | None = None,
    max_chars: int = MAX_CHARS,
    max_seconds: float = MAX_SECONDS,
) -> str:
    """Render ``messages`` like transformers' ``apply_chat_template(tokenize=False)``, within limits."""
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be set")
    template = compile_template(source)
    chat = [dict(m) for m in messages]
    final = None
    if continue_final_message:
        final = chat[-1].get("content")
        if not isinstance(final, str):
            raise ChatTemplateError("continue_final_message: the final message has no text to continue")
        if "content" not in source:
            raise ChatTemplateError("continue_final_message: the chat template does not read 'content'")
        chat[-1]["content"] = final + _CONTINUE_TAG
    variables = {**(special_tokens or {}), **(kwargs or {})}
    variables.update(
        messages=chat,
        tools=variables.get("tools"),
        documents=variables.get("documents"),
        add_generation_prompt=add_generation_prompt,
    )
    parts: list[str] = []
    size = 0
    _budget.deadline = deadline = time.monotonic() + max_seconds
    try:
        for piece in template.generate(**variables):
            size += len(piece)
            if size > max_chars:
                raise ChatTemplateError(f"the chat template renders more than {max_chars} characters")
            if time.monotonic() > deadline:
                raise ChatTemplateError(f"the chat template ran longer than {max_seconds:g} s")
            parts.append(piece)
    except ChatTemplateError:
        raise
    except SecurityError as exc:
        raise ChatTemplateError(f"the chat template was stopped: {exc}") from None
    except (
        TemplateError,
        TypeError,
        ValueError,
        KeyError,
        IndexError,
        AttributeError,
        ZeroDivisionError,
        OverflowError,
        RecursionError,
        MemoryError,
    ) as exc:
        raise ChatTemplateError(f"cannot apply the chat template: {type(exc).__name__}: {exc}") from None
    finally:
        _budget.deadline = float("inf")
    text = "".join(parts)
    if final is not None:
        tag = _CONTINUE_TAG.strip()
        if final.strip() not in text or tag not in text:
            raise ChatTemplateError("continue_final_message: the chat template drops part of the final message")
        loc = text.rindex(tag)
        text = text[:loc] if text[loc : loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:loc].rstrip()
    return text
