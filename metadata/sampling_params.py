"""User-facing sampling parameters (vLLM-compatible names), validated on construction."""

from __future__ import annotations

import math
import re

import msgspec

_INT_FIELDS = ("n", "top_k", "min_tokens")
_OPT_INT_FIELDS = ("seed", "max_tokens", "logprobs", "prompt_logprobs")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_BOOL_FIELDS = ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens")
MAX_CACHE_SALT_LEN = 1024
MAX_INT32 = (1 << 31) - 1  # top_k, min_tokens and max_tokens become device int tensors
MAX_STOP_STRINGS = 64
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries in one request's logit_bias
MAX_ALLOWED_TOKEN_IDS = 65536  # entries in one request's allowed_token_ids
MAX_BAD_WORDS, MAX_BAD_WORD_CHARS = 256, 256  # bad_words: words and characters a word


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names it."""


MAX_GRAMMAR_CHARS = 1 << 16  # a schema, regex or grammar's text
MAX_CHOICES = 1024
MAX_GRAMMAR_NESTING = 64  # brackets deep
MAX_GRAMMAR_COUNT = 4096  # {n,m} repetition bounds and schema lengths / item counts
_REPEATS = re.compile(r"\{\s*(\d{1,12})\s*(?:,\s*(\d{0,12})\s*)?\}")  # {n}, {n,}, {n,m}
_LENGTHS = re.compile(r'"(?:max|min)(?:Length|Items|Properties)"\s*:\s*(\d{1,12})')


def _largest_count(text: str) -> int:
    """The largest repetition bound or schema length / item count ``text`` names."""
    counts = [int(n) for m in _REPEATS.findall(text) for n in m if n]
    counts += [int(n) for n in _LENGTHS.findall(text)]
    return max(counts, default=0)


def _nesting(text: str) -> int:
    """The deepest bracket nesting of ``text`` (any of ``[{(``)."""
    depth = top = 0
    for ch in text:
        if ch in "[{(":
            depth += 1
            top = max(top, depth)
        elif ch in "]})":
            depth -= 1
    return top


class StructuredOutputsParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A constraint on the output (vLLM's names): exactly one of a JSON schema (``json``, text
    or a mapping), a ``regex``, a ``choice`` of strings, an EBNF ``grammar``, or any JSON
    object (``json_object=True``)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    """JSON (``json``, ``json_object``) with fixed whitespace, one space after each colon and comma
    (vLLM's option): by default any whitespace is allowed, which a weak model can spend
    ``max_tokens`` on."""

    KINDS = ("json", "regex", "choice", "grammar", "json_object")

    def given(self) -> list[str]:
        """The constraint fields set (exactly one once validated)."""
        return [k for k in self.KINDS if getattr(self, k) not in (None, False)]

    def validate(self) -> None:
        given = self.given()
        if len(given) != 1:
            raise SamplingParamsError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, json_object"
                f" (got {', '.join(given) or 'none'})"
            )
        kind = given[0]
        value = getattr(self, kind)
        if kind == "choice":
            if not isinstance(value, list) or not 0 < len(value) <= MAX_CHOICES:
                raise SamplingParamsError(f"structured_outputs choice must be a list of 1 to {MAX_CHOICES} strings")
            if any(not isinstance(c, str) or not c or len(c) > MAX_GRAMMAR_CHARS for c in value):
                raise SamplingParamsError("structured_outputs choice must be a list of non-empty strings")
        elif kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
            raise SamplingParamsError(f"structured_outputs {kind} must be a non-empty string")
        elif kind == "json" and (not isinstance(value, (str, dict)) or (isinstance(value, str) and not value.strip())):
            raise SamplingParamsError("structured_outputs json must be a JSON schema (an object or its text)")
        elif kind == "json_object" and value is not True:
            raise SamplingParamsError("structured_outputs json_object must be true")
        if not isinstance(self.disable_any_whitespace, bool):
            raise SamplingParamsError("structured_outputs disable_any_whitespace must be true or false")
        text = value if isinstance(value, str) else msgspec.json.encode(value).decode() if kind == "json" else ""
        if len(text) > MAX_GRAMMAR_CHARS:
            raise SamplingParamsError(f"structured_outputs {kind} must be at most {MAX_GRAMMAR_CHARS} characters")
        # (what makes a compilation explode: deep nesting, huge repetition counts)
        if _nesting(text) > MAX_GRAMMAR_NESTING:
            raise SamplingParamsError(f"structured_outputs {kind} nests deeper than {MAX_GRAMMAR_NESTING} levels")
        big = _largest_count(text) if kind != "choice" else 0
        if big > MAX_GRAMMAR_COUNT:
            raise SamplingParamsError(
                f"structured_outputs {kind} holds a repetition count or length of {big}, above {MAX_GRAMMAR_COUNT}"
            )


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 disables
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    """Per prompt token after the first: its logprob, rank and the top this-many (vLLM's
    ``prompt_logprobs``); such a request computes its whole prompt (no prefix-cache hit)."""
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    """Added to the named tokens' logits before penalties and sampling (each in [-100, 100], as
    OpenAI bounds them); logprobs stay those of the unbiased logits (vLLM's default)."""
    allowed_token_ids: list[int] | None = None
    """Sample only among these token ids (vLLM's ``allowed_token_ids``; applied with ``logit_bias``,
    before penalties); logprobs stay those of the unrestricted logits."""
    bad_words: list[str] | None = None
    """Words the output never contains (vLLM's ``bad_words``: ``cluster.bad_words``)."""
    truncate_prompt_tokens: int | None = None
    """Keep only the prompt's last this-many tokens (left truncation, as vLLM); -1: the most that
    leave room for one output token (``max_model_len - 1``, or fewer where the KV cache holds
    fewer tokens)."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrained decoding (``StructuredOutputsParams``; a mapping of its fields is taken too)."""
    priority: int = 0
    """Scheduling priority under ``scheduling_policy='priority'`` (lower is served first); vLLM
    takes it beside the params (``LLM.generate(..., priority=[...])``, the HTTP extra), and
    those set it here."""
    cache_salt: str | None = None
    """Prefix-cache isolation: requests share cached KV blocks only with requests of the same salt."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            raise SamplingParamsError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise SamplingParamsError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = msgspec.convert(self.structured_outputs, StructuredOutputsParams)
            except msgspec.ValidationError as exc:
                raise SamplingParamsError(f"structured_outputs: {exc}") from None
        self.validate()

    def validate(self) -> None:
        def bad(name: str, cond: str, value: object) -> SamplingParamsError:
            shown = repr(value)
            if len(shown) > 80:  # never echo a huge input back
                shown = shown[:77] + "..."
            return SamplingParamsError(f"{name} must be {cond}, got {shown}")

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        for name in _INT_FIELDS:
            if not is_int(getattr(self, name)):
                raise bad(name, "an integer", getattr(self, name))
        for name in _OPT_INT_FIELDS:
            v = getattr(self, name)
            if v is not None and not is_int(v):
                raise bad(name, "an integer or None", v)
        for name in _FLOAT_FIELDS:
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool)) or not math.isfinite(v):
                raise bad(name, "a finite number", v)
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "true or false", getattr(self, name))
        if not isinstance(self.stop, list) or not isinstance(self.stop_token_ids, list):
            raise bad("stop", "a list of strings (and stop_token_ids a list of ids)", self.stop)
        if not 1 <= self.n <= 128:
            raise bad("n", "in [1, 128]", self.n)
        if self.temperature != 0 and not 1e-5 <= self.temperature <= 1e4:
            raise bad("temperature", "0 (greedy) or in [1e-05, 10000]", self.temperature)
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "in (0, 1]", self.top_p)
        if not 0 <= self.top_k <= MAX_INT32:
            raise bad("top_k", f"in [1, {MAX_INT32}], or 0 / -1 to disable", self.top_k)
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "in [0, 1]", self.min_p)
        if self.seed is not None and not 0 <= self.seed < (1 << 63):
            raise bad("seed", "in [0, 2**63)", self.seed)
        if not 1e-3 <= self.repetition_penalty <= 1e3:
            raise bad("repetition_penalty", "in [0.001, 1000] (1: off)", self.repetition_penalty)
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", "in [-2, 2]", self.presence_penalty)
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", "in [-2, 2]", self.frequency_penalty)
        if self.max_tokens is not None and (
            isinstance(self.max_tokens, bool)
            or not isinstance(self.max_tokens, int)
            or not 1 <= self.max_tokens <= MAX_INT32
        ):
            raise bad("max_tokens", f"an integer in [1, {MAX_INT32}]", self.max_tokens)
        if not 0 <= self.min_tokens <= MAX_INT32:
            raise bad("min_tokens", f"in [0, {MAX_INT32}]", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", "in [0, 20]", self.logprobs)
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise bad("prompt_logprobs", "in [0, 20]", self.prompt_logprobs)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"at most {MAX_STOP_STRINGS} strings", f"<{len(self.stop)} strings>")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids", f"<{len(self.stop_token_ids)} ids>")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "a list of non-empty strings", self.stop)
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_INT32 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of token ids >= 0", self.stop_token_ids)
        if self.logit_bias is not None:
            self._validate_logit_bias(bad)
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids:
                raise bad("allowed_token_ids", "a non-empty list of token ids", ids)
            if len(ids) > MAX_ALLOWED_TOKEN_IDS:
                raise bad("allowed_token_ids", f"at most {MAX_ALLOWED_TOKEN_IDS} ids", f"<{len(ids)} ids>")
            if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_INT32 for t in ids):
                raise bad("allowed_token_ids", "a list of token ids >= 0", ids)
        if self.bad_words is not None:
            w = self.bad_words
            if not isinstance(w, (list, tuple)) or len(w) > MAX_BAD_WORDS:
                raise bad("bad_words", f"a list of at most {MAX_BAD_WORDS} strings", w)
            if any(not isinstance(x, str) or not x.strip() or len(x) > MAX_BAD_WORD_CHARS for x in w):
                raise bad("bad_words", f"non-blank strings of at most {MAX_BAD_WORD_CHARS} characters", w)
        if isinstance(self.priority, bool) or not isinstance(self.priority, int) or abs(self.priority) > MAX_INT32:
            raise bad("priority", f"an integer in [-{MAX_INT32}, {MAX_INT32}]", self.priority)
        t = self.truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or not (t == -1 or 1 <= t <= MAX_INT32)):
            raise bad("truncate_prompt_tokens", "an integer >= 1, or -1 (as many as fit)", t)
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise bad("structured_outputs", "a StructuredOutputsParams", self.structured_outputs)
            self.structured_outputs.validate()
            if self.min_tokens:  # (a complete constraint allows only EOS, which min_tokens forbids)
                raise bad("min_tokens", "0 with structured_outputs", self.min_tokens)
        if self.cache_salt is not None and (
            not isinstance(self.cache_salt, str) or not 0 < len(self.cache_salt) <= MAX_CACHE_SALT_LEN
        ):
            raise bad(
                "cache_salt",
                f"a non-empty string of at most {MAX_CACHE_SALT_LEN} characters, or None",
                self.cache_salt if not isinstance(self.cache_salt, str) else f"<{len(self.cache_salt)} chars>",
            )

    def _validate_logit_bias(self, bad) -> None:
        lb = self.logit_bias
        if not isinstance(lb, dict):
            raise bad("logit_bias", "a mapping of token ids to biases", lb)
        if len(lb) > MAX_LOGIT_BIAS:
            raise bad("logit_bias", f"at most {MAX_LOGIT_BIAS} entries", f"<{len(lb)} entries>")
        for t, v in lb.items():
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_INT32:
                raise bad("logit_bias", "keyed by token ids >= 0", t)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
                raise SamplingParamsError(f"logit_bias must be numbers in [-100, 100], got {v!r:.40} for {t}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
