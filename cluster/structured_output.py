"""Constrained decoding on the driver (xgrammar): a request's ``structured_outputs`` compiled
once (cached by its text), a matcher a sequence that follows it, and the bitmask of the
tokens allowed next, which rides in the step plan (``ScheduledRow.token_bitmask``) to the
sampler. The matcher advances only on confirmed tokens, so a constrained row samples only
when its previous token is known (``Request.num_placeholders`` 0): it skips every other
step under async scheduling, while the other rows run ahead as usual."""

from __future__ import annotations

import json
import threading

from metadata.sampling_params import StructuredOutputsParams


class GrammarError(ValueError):
    """A constraint that cannot be served (the input processor answers it as a bad request)."""


class RequestGrammar:
    """One sequence's matcher and its reused bitmask buffer."""

    def __init__(self, matcher, bitmask):
        self.matcher = matcher
        self._bitmask = bitmask  # int32 [1, ceil(vocab / 32)]

    def bitmask(self) -> bytes:
        """The tokens allowed next, one bit each (little-endian int32 words, bit i of word j: id 32 j + i)."""
        self.matcher.fill_next_token_bitmask(self._bitmask)
        return self._bitmask.numpy().tobytes()

    def can_start(self) -> bool:
        """Whether any token may come first (a constraint this vocabulary cannot spell: none)."""
        return any(self.bitmask())

    def accept(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()


class GrammarBackend:
    """xgrammar over one tokenizer and vocabulary (the model's logits width)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler = None
        self._lock = threading.Lock()  # (requests may be added from several threads)

    def _compiler_for_tokenizer(self):
        with self._lock:  # (made once; xgrammar's compiler itself is thread-safe)
            if self._compiler is None:
                import xgrammar

                if self.tokenizer is None:
                    raise GrammarError("structured outputs need the model's tokenizer")
                info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def compile(self, so: StructuredOutputsParams):
        """The compiled constraint (xgrammar caches compilations by their text); a schema, regex
        or grammar it cannot compile is a ``GrammarError`` naming what."""
        c = self._compiler_for_tokenizer()  # (it caches compilations by their text)
        kind = (so.given() or ["json"])[0]
        try:
            compact = so.disable_any_whitespace
            if so.json is not None:
                schema = so.json if isinstance(so.json, str) else json.dumps(so.json)
                return c.compile_json_schema(schema, any_whitespace=not compact)
            if so.json_object:  # (any JSON object; compact: the same as a schema)
                return (
                    c.compile_json_schema('{"type": "object"}', any_whitespace=False)
                    if compact
                    else c.compile_builtin_json_grammar()
                )
            if so.regex is not None:
                return c.compile_regex(so.regex)
            if so.choice is not None:  # each choice a quoted EBNF string
                return c.compile_grammar("root ::= " + " | ".join(json.dumps(x) for x in so.choice))
            return c.compile_grammar(so.grammar)
        except Exception as exc:  # noqa: BLE001 - xgrammar's errors vary by kind and version
            msg = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
            raise GrammarError(f"structured_outputs {kind} does not compile: {msg}") from None

    def matcher(self, compiled, stop_ids: tuple[int, ...]) -> RequestGrammar:
        """A fresh matcher; the grammar ends on one of ``stop_ids`` (the request's EOS ids)."""
        import xgrammar

        m = xgrammar.GrammarMatcher(compiled, override_stop_tokens=list(stop_ids) or None)
        return RequestGrammar(m, xgrammar.allocate_token_bitmask(1, self.vocab_size))
