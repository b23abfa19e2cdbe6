"""OpenAI-compatible request parsing, validation and response shapes.

Requests are decoded strictly (``msgspec``): a wrong JSON type or an unknown
field is a 400 whose message and ``param`` name the field. Sampling fields map
onto ``SamplingParams`` (vLLM extras included) and range errors name the field.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any

import msgspec

from cluster.generation_config import NO_GENERATION_DEFAULTS, GenerationDefaults
from cluster.tool_calls import Tool, ToolCall, template_tool_calls
from metadata.sampling_params import MAX_INT32, SamplingParams, SamplingParamsError

_ERROR_TYPES = {
    400: ("invalid_request_error", None),
    401: ("authentication_error", "invalid_api_key"),
    404: ("not_found_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    500: ("server_error", "internal_error"),
    503: ("service_unavailable", "engine_unavailable"),
}
MAX_MESSAGE_CHARS = 1000  # error messages never echo more of the input than this
MAX_REQUEST_ID_CHARS = 256
_REQUEST_ID = re.compile(rf"[\x20-\x7e]{{1,{MAX_REQUEST_ID_CHARS}}}")


def clip(text: str, limit: int = 100) -> str:
    """``text`` cut to ``limit`` characters for an error message (the rest elided)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class APIError(Exception):
    """An error answered with OpenAI's error JSON: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        message = clip(message, MAX_MESSAGE_CHARS)
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code or _ERROR_TYPES.get(status, ("error", None))[1]

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": _ERROR_TYPES.get(self.status, ("error",))[0],
                "param": self.param,
                "code": self.code,
            }
        }


# ------------------------------------------------------------------ requests
class StreamOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # (vLLM extra: with include_usage, usage in every chunk)


class _SamplingFields(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    best_of: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None  # vLLM extras
    truncate_prompt_tokens: int | None = None
    bad_words: list[str] | None = None
    priority: int | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    request_id: str | None = None
    cache_salt: str | None = None  # prefix-cache isolation (vLLM extra)
    return_tokens_as_token_ids: bool | None = None  # logprob tokens as "token_id:N" (vLLM extra)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # json / regex / choice / grammar (vLLM extra)
    guided_json: Any = None  # vLLM's older names for structured_outputs' fields
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: Any
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # vLLM extra; refused unless --trust-request-chat-template
    tools: list[Tool] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None


def decode_request(body: bytes, typ: type) -> Any:
    if not body:
        raise APIError(400, "the request body is empty; expected a JSON object")
    try:
        req = msgspec.json.decode(body, type=typ)
    except msgspec.ValidationError as exc:
        raise _validation_error(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    if isinstance(req, _SamplingFields):
        check_common(req)
    return req


def valid_request_id(request_id: str) -> bool:
    """1 to 256 printable ASCII characters (it travels in headers and logs)."""
    return _REQUEST_ID.fullmatch(request_id) is not None


def check_common(req: _SamplingFields) -> None:
    """Checks every generation request passes before it reaches the engine."""
    if req.request_id is not None and not valid_request_id(req.request_id):
        raise APIError(
            400,
            f"request_id must be 1 to {MAX_REQUEST_ID_CHARS} printable ASCII characters (no control characters)",
            "request_id",
        )
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")


def _validation_error(msg: str) -> APIError:
    text, _, path = msg.partition(" - at `$")
    path = path.rstrip("`").lstrip(".")
    field = msg.split("`")[1] if "`" in text and ("unknown field" in text or "missing required" in text) else None
    if "unknown field" in text:
        where = f"{path}.{field}" if path else field
        return APIError(400, f"unrecognized request argument supplied: {where}", param=(path or field).split("[")[0])
    if "missing required field" in text:
        where = f"{path}.{field}" if path else field
        return APIError(400, f"{where}: a required field is missing", param=(path or field).split("[")[0])
    if path:
        return APIError(400, f"{path}: {text}", param=path.split("[")[0].split(".")[0])
    return APIError(400, f"invalid request: {text}")


def parse_completion_prompts(prompt: Any) -> list[Any]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""

    def ids_ok(x):
        return isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "prompt must not be empty", "prompt")
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            if any(not p for p in prompt):
                raise APIError(400, "prompt must not contain empty strings", "prompt")
            return list(prompt)
        if ids_ok(prompt):
            return [{"prompt_token_ids": list(prompt)}]
        if all(ids_ok(p) for p in prompt):
            return [{"prompt_token_ids": list(p)} for p in prompt]
    raise APIError(
        400,
        "prompt must be a non-empty string, a list of strings, a list of token ids or a list of token-id lists",
        "prompt",
    )


def _structured_outputs(req: _SamplingFields) -> dict[str, Any] | None:
    """OpenAI's ``response_format`` (json_object, json_schema) or vLLM's ``structured_outputs``."""
    rf = req.response_format
    kind = rf.get("type", "text") if rf else "text"
    guided = {k: getattr(req, "guided_" + k) for k in ("json", "regex", "choice", "grammar")}
    guided = {k: v for k, v in guided.items() if v is not None}
    if sum(map(bool, (kind != "text", req.structured_outputs, guided))) > 1:
        raise APIError(400, "set one of response_format, structured_outputs and guided_*", "response_format")
    if guided:
        return guided
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError(400, "response_format json_schema needs json_schema.schema (an object)", "response_format")
        return {"json": schema}
    if kind != "text":
        msg = f"response_format type must be 'text', 'json_object' or 'json_schema', got {clip(str(kind), 40)!r}"
        raise APIError(400, msg, "response_format")
    return req.structured_outputs or None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (token ids as JSON keys) keyed by int ids."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        if not key.isascii() or not key.isdigit() or len(key) > 10:
            shown = key if len(key) <= 40 else key[:37] + "..."
            raise APIError(400, f"logit_bias keys must be token ids (decimal integers), got {shown!r}", "logit_bias")
        out[int(key)] = value
    return out


def to_sampling_params(
    req: _SamplingFields,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    defaults: GenerationDefaults | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """The request's fields; those it leaves out take ``defaults`` (the model's generation
    config: ``cluster.generation_config``), else the engine's."""
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of is not supported (it must equal n when given)", "best_of")
    kw: dict[str, Any] = {
        "n": req.n,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "seed": req.seed,
        "repetition_penalty": req.repetition_penalty,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "min_tokens": req.min_tokens,
        "stop": req.stop,
        "stop_token_ids": req.stop_token_ids,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "ignore_eos": req.ignore_eos,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "skip_special_tokens": req.skip_special_tokens,
        "cache_salt": req.cache_salt,
        "logit_bias": _logit_bias(req.logit_bias),
        "allowed_token_ids": req.allowed_token_ids,
        "truncate_prompt_tokens": req.truncate_prompt_tokens,
        "bad_words": req.bad_words,
        "priority": req.priority,
        "structured_outputs": _structured_outputs(req),
    }
    kw = {k: v for k, v in kw.items() if v is not None}
    kw["max_tokens"] = max_tokens
    try:
        return (defaults or NO_GENERATION_DEFAULTS).params(**kw)
    except SamplingParamsError as exc:
        msg = str(exc)
        raise APIError(400, msg, msg.split(" ")[0]) from None


def completion_params(
    req: CompletionRequest, max_logprobs: int = 20, defaults: GenerationDefaults | None = None
) -> SamplingParams:
    if req.suffix:
        raise APIError(400, "suffix is not supported", "suffix")
    if req.logprobs is not None and not 0 <= req.logprobs <= max_logprobs:
        raise APIError(400, f"logprobs must be in [0, {max_logprobs}] (--max-logprobs), got {req.logprobs}", "logprobs")
    max_tokens = 16 if req.max_tokens is None else req.max_tokens  # (OpenAI's default, as vLLM keeps it)
    if echo_only(req):  # the prompt alone (with its logprobs): one token is generated and dropped
        max_tokens = 1
    # echo with logprobs: the prompt tokens' logprobs lead the choice's (as OpenAI and vLLM return them)
    prompt_lp = req.logprobs if req.echo else None
    return to_sampling_params(
        req, max_tokens=max_tokens, logprobs=req.logprobs, defaults=defaults, prompt_logprobs=prompt_lp
    )


def chat_params(
    req: ChatCompletionRequest, max_logprobs: int = 20, defaults: GenerationDefaults | None = None
) -> SamplingParams:
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", "top_logprobs")
        if not 0 <= req.top_logprobs <= max_logprobs:
            raise APIError(
                400,
                f"top_logprobs must be in [0, {max_logprobs}] (--max-logprobs), got {req.top_logprobs}",
                "top_logprobs",
            )
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    if max_tokens is not None and not 1 <= max_tokens <= MAX_INT32:
        raise APIError(400, f"{name} must be an integer in [1, {MAX_INT32}], got {max_tokens}", name)
    if max_tokens is None:  # the generation config's max_new_tokens, else up to the context
        max_tokens = (defaults or NO_GENERATION_DEFAULTS).sampling.get("max_tokens")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return to_sampling_params(req, max_tokens=max_tokens, logprobs=logprobs, defaults=defaults)


def echo_only(req: CompletionRequest) -> bool:
    """``echo`` with ``max_tokens=0``: the prompt alone comes back (with its logprobs), the
    legacy OpenAI way to score a text, which vLLM serves too."""
    return req.echo and req.max_tokens == 0


def max_tokens_field(req: CompletionRequest | ChatCompletionRequest) -> str | None:
    """The field the client set the output length with (None: the default applies). A set
    length past the context is refused, a default one is cut to it (as vLLM's server does)."""
    if getattr(req, "max_completion_tokens", None) is not None:
        return "max_completion_tokens"
    return "max_tokens" if req.max_tokens is not None else None


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The conversation as the plain dicts a chat template reads (text content parts joined)."""
    if not req.messages:
        raise APIError(400, "messages must not be empty", "messages")
    msgs = []
    for i, m in enumerate(req.messages):
        if not m.role:
            raise APIError(400, f"messages[{i}].role must not be empty", "messages")
        content = m.content
        if isinstance(content, list):
            parts = []
            for p in content:
                if p.type != "text" or p.text is None:
                    raise APIError(
                        400,
                        f"messages[{i}].content: only text content parts are supported (got type {clip(p.type, 40)!r})",
                        "messages",
                    )
                parts.append(p.text)
            content = "".join(parts)
        msg = {"role": m.role, "content": content or ""}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = template_tool_calls(m.tool_calls)
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        msgs.append(msg)
    return msgs


def chat_template_kwargs(req: ChatCompletionRequest) -> dict[str, Any]:
    """The extra template variables; a request's own template (``chat_template``) travels in them."""
    kwargs = dict(req.chat_template_kwargs or {})
    if req.chat_template is not None:
        kwargs["chat_template"] = req.chat_template
    return kwargs


# ----------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class TokenText:
    """Token id -> text of that token alone (for logprobs), cached; with ``as_ids`` the token is
    named ``"token_id:N"`` instead (vLLM's ``return_tokens_as_token_ids``: tokens that decode to
    the same text stay apart)."""

    def __init__(self, tokenizer, as_ids: bool = False):
        self.tok = tokenizer
        self.as_ids = as_ids
        self.cache: dict[int, str] = {}

    def __call__(self, tid: int) -> str:
        if self.as_ids:
            return f"token_id:{tid}"
        s = self.cache.get(tid)
        if s is None:
            s = self.tok.decode([tid], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            self.cache[tid] = s
        return s


def completion_logprobs(
    token_ids: list[int],
    lps: list[dict[int, float] | None],
    tt: TokenText,
    offset: int,
    before: dict[str, list] | None = None,
) -> tuple[dict[str, Any], int]:
    """OpenAI legacy logprobs object for these tokens; returns it and the next text offset.
    A None entry (a prompt's first token) has no logprob and no top logprobs. ``before``:
    an object of earlier tokens (the echoed prompt's) these continue."""
    out = before or {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, lp in zip(token_ids, lps):
        s = tt(tid)
        out["tokens"].append(s)
        out["token_logprobs"].append(lp.get(tid) if lp is not None else None)
        out["top_logprobs"].append({tt(t): v for t, v in lp.items()} if lp is not None else None)
        out["text_offset"].append(offset)
        offset += len(s)
    return out, offset


def echoed_logprobs(tt: TokenText, prompt_token_ids: list[int], prompt_lps) -> tuple[int, dict | None]:
    """The text offset and logprobs object a completion's own tokens continue: an echoed
    prompt's (``prompt_lps``: its prompt logprobs; None: nothing echoed, offset 0)."""
    if prompt_lps is None:
        return 0, None
    obj, offset = completion_logprobs(prompt_token_ids, prompt_lps, tt, 0)
    return offset, obj


def chat_logprobs(token_ids: list[int], lps: list[dict[int, float]], tt: TokenText, top: int) -> dict[str, Any]:
    content = []
    for tid, lp in zip(token_ids, lps):
        items = list(lp.items())
        tops = items[1:] if len(items) > top else items
        s = tt(tid)
        content.append(
            {
                "token": s,
                "logprob": lp.get(tid),
                "bytes": list(s.encode("utf-8")),
                "top_logprobs": [
                    {"token": tt(t), "logprob": v, "bytes": list(tt(t).encode("utf-8"))}
                    for t, v in sorted(tops, key=lambda kv: -kv[1])[:top]
                ],
            }
        )
    return {"content": content}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def model_card(name: str, info: dict[str, Any], created: int) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "syncless",
        "root": info.get("model_path"),
        "parent": None,
        "max_model_len": info.get("max_model_len"),
    }
