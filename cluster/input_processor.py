"""Validates and tokenizes incoming requests before they reach the scheduler."""

from __future__ import annotations

import random
from typing import Any

from cluster.request import Request
from metadata.sampling_params import SamplingParams, SamplingParamsError
from metadata.wire import SamplingOptions

# A text prompt longer than this many characters per token of max_model_len cannot fit, so it is
# refused before it is tokenized (tokenizing megabytes blocks for seconds).
MAX_CHARS_PER_TOKEN = 32


def check_prompt_size(prompt: str | list, max_model_len: int, field: str = "prompt") -> None:
    """Refuse, before any tokenizing, a prompt that cannot fit ``max_model_len`` tokens."""
    if isinstance(prompt, str) and len(prompt) > max_model_len * MAX_CHARS_PER_TOKEN:
        raise InvalidRequestError(
            f"{field} has {len(prompt)} characters, more than max_model_len ({max_model_len} tokens) can hold "
            f"(at most {max_model_len * MAX_CHARS_PER_TOKEN} characters)",
            field,
        )
    if isinstance(prompt, list) and len(prompt) >= max_model_len:
        raise InvalidRequestError(
            f"prompt has {len(prompt)} tokens, but max_model_len is {max_model_len} "
            "(the prompt must leave room for at least one output token)",
            field,
        )


class InvalidRequestError(ValueError):
    """The request is malformed; ``field`` names the offending input."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class InputProcessor:
    def __init__(
        self,
        tokenizer,
        eos_token_ids: tuple[int, ...],
        vocab_size: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        chunked_prefill: bool,
        seed: int,
        default_params: SamplingParams | None = None,
        extra_stop_ids: tuple[int, ...] = (),
    ):
        """``default_params``: what a request without sampling params runs with (the engine's
        defaults, or those the model's generation config names: ``cluster.generation_config``);
        ``extra_stop_ids``: the generation config's EOS ids past the model's own (stop tokens of
        every request that does not ignore EOS)."""
        self.default_params = default_params if default_params is not None else SamplingParams()
        self.extra_stop_ids = tuple(t for t in extra_stop_ids if t not in eos_token_ids)
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self._rng = random.Random(seed)
        self._grammars = None

    @property
    def grammars(self):
        """The structured-output compiler (``cluster.structured_output``), made on first use."""
        if self._grammars is None:
            from cluster.structured_output import GrammarBackend

            self._grammars = GrammarBackend(self.tokenizer, self.vocab_size)
        return self._grammars

    def tokenize(self, prompt: Any, truncating: bool = False) -> tuple[str | None, list[int]]:
        """``truncating``: the caller keeps only the prompt's tail (``truncate_prompt_tokens``), so
        a token list longer than ``max_model_len`` is not refused here."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty", "prompt")
            check_prompt_size(prompt, self.max_model_len)
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
            if not ids:
                raise InvalidRequestError(f"prompt {prompt[:80]!r} tokenizes to no tokens", "prompt")
            return prompt, list(ids)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            extra = set(prompt) - {"prompt_token_ids", "prompt"}
            if extra:
                raise InvalidRequestError(f"unknown prompt keys {sorted(extra)}", "prompt")
            text = prompt.get("prompt")
        elif isinstance(prompt, dict) and "prompt" in prompt:
            return self.tokenize(prompt["prompt"], truncating)
        elif isinstance(prompt, list):
            ids, text = prompt, None
        else:
            raise InvalidRequestError(
                "a prompt must be a string, a list of token ids or {'prompt_token_ids': [...]}", "prompt"
            )
        if isinstance(ids, list) and not truncating:
            check_prompt_size(ids, self.max_model_len)
        if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
            raise InvalidRequestError("prompt_token_ids must be a list of integers", "prompt_token_ids")
        if not ids:
            raise InvalidRequestError("prompt must not be empty", "prompt_token_ids")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", "prompt_token_ids"
            )
        return text, list(ids)

    def make_requests(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams | None,
        kv_capacity: int | None = None,
        strict_field: str | None = None,
    ) -> list[Request]:
        """``kv_capacity``: tokens the whole KV cache holds; a sequence never grows past it
        (it could never be scheduled), so it bounds the length like ``max_model_len``.

        A ``max_tokens`` past that room is cut to it (the sequence ends with
        ``finish_reason="length"``), as vLLM's offline ``LLM`` does, unless ``strict_field``
        names the request field the client set it with: then the request is refused, as
        OpenAI's and vLLM's servers refuse it (an API client asked for that many tokens;
        an implicit default is still cut)."""
        if params is None:
            params = self.default_params
        elif not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling_params must be a SamplingParams", "sampling_params")
        try:
            params.validate()
        except SamplingParamsError as exc:
            raise InvalidRequestError(str(exc), str(exc).split(" ")[0]) from None
        text, ids = self.tokenize(prompt, params.truncate_prompt_tokens is not None)
        if params.truncate_prompt_tokens is not None:  # -1: the most that leave room for one output token
            fits = min(self.max_model_len, kv_capacity or self.max_model_len) - 1
            ids = ids[-(fits if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens) :]
        n = len(ids)
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {n} tokens, but max_model_len is {self.max_model_len} "
                "(the prompt must leave room for at least one output token)",
                "prompt",
            )
        limit = self.max_model_len
        if kv_capacity is not None and kv_capacity < limit:
            limit = kv_capacity
            if n >= limit:
                raise InvalidRequestError(
                    f"prompt has {n} tokens, but the KV cache holds only {kv_capacity} tokens "
                    "(num_kv_blocks x block_size); raise num_kv_blocks or kv_cache_memory_bytes",
                    "prompt",
                )
        if not self.chunked_prefill and n > self.max_num_batched_tokens:
            raise InvalidRequestError(
                f"prompt has {n} tokens > max_num_batched_tokens {self.max_num_batched_tokens} "
                "and chunked prefill is disabled",
                "prompt",
            )
        room = limit - n
        if strict_field is not None and params.max_tokens is not None and params.max_tokens > room:
            where = (
                f"This model's maximum context length is {self.max_model_len} tokens"
                if limit == self.max_model_len
                else f"The KV cache holds only {limit} tokens (num_kv_blocks x block_size)"
            )
            raise InvalidRequestError(
                f"{where}. However, you requested {n + params.max_tokens} tokens ({n} in the "
                f"prompt, {params.max_tokens} in the completion). Please reduce the length of the "
                f"prompt or {strict_field} (at most {room} here).",
                strict_field,
            )
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        bad_stop = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_stop:
            raise InvalidRequestError(f"stop token id {bad_stop[0]} is outside the vocabulary", "stop_token_ids")
        bias = params.logit_bias or {}
        bad_bias = [t for t in bias if t >= self.vocab_size]
        if bad_bias:
            raise InvalidRequestError(f"logit_bias token id {bad_bias[0]} is outside the vocabulary", "logit_bias")
        allowed = list(dict.fromkeys(params.allowed_token_ids or ()))
        bad_allowed = [t for t in allowed if t >= self.vocab_size]
        if bad_allowed:
            raise InvalidRequestError(
                f"allowed_token_ids: token id {bad_allowed[0]} is outside the vocabulary", "allowed_token_ids"
            )
        banned, bad_seqs = [], []
        if params.bad_words:  # (sequences the model can never output are dropped)
            from cluster.bad_words import bad_word_sequences

            seqs = [s for s in bad_word_sequences(self.tokenizer, params.bad_words) if max(s) < self.vocab_size]
            banned = sorted({s[0] for s in seqs if len(s) == 1})
            bad_seqs = [s for s in seqs if len(s) > 1]
        compiled = None
        if params.structured_outputs is not None:
            from cluster.structured_output import GrammarError

            try:
                compiled = self.grammars.compile(params.structured_outputs)
            except GrammarError as exc:
                raise InvalidRequestError(str(exc), "structured_outputs") from None
        eos, extra = ((), ()) if params.ignore_eos else (self.eos_token_ids, self.extra_stop_ids)
        grammars = None  # (one matcher a sequence)
        if compiled is not None:
            grammars = [self.grammars.matcher(compiled, eos + extra) for _ in range(params.n)]
        if bad_seqs:  # (around the structured-output matcher, if any)
            from cluster.bad_words import BadWordsMatcher

            inner = grammars or [None] * params.n
            grammars = [BadWordsMatcher(bad_seqs, self.vocab_size, g) for g in inner]
        if grammars and not grammars[0].can_start():
            raise InvalidRequestError(
                "structured_outputs: no token of this model's vocabulary can begin the constrained output",
                "structured_outputs",
            )
        stop_ids = [*params.stop_token_ids, *eos, *extra]
        out = []
        for i in range(params.n):
            seed = params.seed + i if params.seed is not None else self._rng.getrandbits(63)
            seed &= (1 << 63) - 1
            opts = SamplingOptions(
                temperature=float(params.temperature),
                top_p=float(params.top_p),
                top_k=params.top_k,
                min_p=float(params.min_p),
                seed=seed,
                repetition_penalty=float(params.repetition_penalty),
                presence_penalty=float(params.presence_penalty),
                frequency_penalty=float(params.frequency_penalty),
                min_tokens=params.min_tokens,
                min_tokens_stop_ids=stop_ids,
                num_logprobs=-1 if params.logprobs is None else params.logprobs,
                num_prompt_logprobs=-1 if params.prompt_logprobs is None else params.prompt_logprobs,
                logit_bias_ids=list(bias),
                logit_bias_values=[float(v) for v in bias.values()],
                allowed_token_ids=allowed,
                banned_token_ids=banned,
            )
            out.append(
                Request(
                    request_id=f"{request_id}#{i}" if params.n > 1 else request_id,
                    parent_id=request_id,
                    index=i,
                    prompt=text,
                    prompt_token_ids=ids,
                    params=params,
                    priority=params.priority,
                    options=opts,
                    max_tokens=max_tokens,
                    eos_token_ids=eos,
                    extra_stop_ids=extra,
                    logprobs=[] if params.logprobs is not None else None,
                    prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
                    grammar=grammars[i] if grammars else None,
                )
            )
        return out
