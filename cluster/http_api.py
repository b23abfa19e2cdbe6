"""The OpenAI-compatible HTTP API (aiohttp): /v1/completions, /v1/chat/completions,
/v1/models, /health, /metrics, /version, /tokenize, /detokenize, and /v1/debug/kv for
KV-block accounting.

Every error is OpenAI's error JSON; a client never sees a traceback or a file path (an
unexpected error is logged here under an error id that the client's message names). A
client that goes away cancels its handler (``handler_cancellation``), which aborts its
requests and frees their KV blocks. Prompts are bounded in size, rendered and tokenized
by the ``PromptPreprocessor`` thread, never on this event loop.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import uuid
from typing import Any

import msgspec
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from cluster.async_engine import AsyncEngine
from cluster.generation_config import GenerationDefaults
from cluster.request_stream import EngineUnavailable, Overloaded, RequestStream
from cluster.input_processor import InvalidRequestError
from cluster.metrics import CONTENT_TYPE
from cluster.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    TokenText,
    chat_logprobs,
    chat_messages,
    chat_params,
    chat_template_kwargs,
    clip,
    completion_logprobs,
    completion_params,
    decode_request,
    echo_only,
    echoed_logprobs,
    max_tokens_field,
    model_card,
    new_id,
    now,
    parse_completion_prompts,
    usage,
)
from cluster.prompt_preprocessor import PromptPreprocessor
from cluster.sse_stream import StreamContext, stream_response
from cluster.tool_calls import ToolRequestError, plan_tools
from metadata.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)
_encode = msgspec.json.Encoder().encode
_PROMPT_FIELDS = {"prompt", "prompt_token_ids"}
_THREAD_DECODE_BYTES = 1 << 20  # bodies above this are JSON-decoded off the event loop


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    prompt: str
    model: str | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    tokens: list[int]
    model: str | None = None


def server_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("syncless")
    except PackageNotFoundError:
        return "unknown"


def engine_error(exc: BaseException, prompt_param: str = "prompt") -> APIError | None:
    """The API error for an engine-side exception (None: not an engine error)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        field = exc.field
        if field in _PROMPT_FIELDS:
            field = prompt_param
        return APIError(400, str(exc), field)
    if isinstance(exc, Overloaded):
        return APIError(429, str(exc))
    if isinstance(exc, EngineUnavailable):
        return APIError(503, str(exc))
    return None


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=_encode(data), status=status, content_type="application/json")


def _error_response(err: APIError) -> web.Response:
    return _json(err.body(), err.status)


class OpenAIServer:
    """The HTTP routes over an engine. ``engine`` needs: ``add_request(id, prompt, params,
    strict_field) -> RequestStream``, ``abort``, ``debug_state``, ``tokenizer``, ``info``,
    ``healthy``, ``dead`` (the front-end interface; a data-parallel router can provide it too)."""

    def __init__(
        self,
        engine: AsyncEngine,
        model_name: str,
        api_key: str | None = None,
        metrics=None,
        aliases: tuple[str, ...] = (),
        *,
        preprocessor: PromptPreprocessor | None = None,
        max_logprobs: int = 20,
        generation: GenerationDefaults | None = None,
        tool_parser: str | None = None,
    ):
        self.engine = engine
        self.model_name = model_name
        self.accepted_names = {model_name, *aliases}
        self.api_key = api_key
        self.metrics = metrics
        self.max_logprobs = max_logprobs
        self.tool_parser = tool_parser  # (--enable-auto-tool-choice: tool_choice="auto" is served)
        self.generation = generation  # the model's generation config: defaults of omitted fields
        self.created = now()
        self._pre = preprocessor
        self._tt: TokenText | None = None
        self._tt_ids: TokenText | None = None

    @property
    def preprocessor(self) -> PromptPreprocessor:
        if self._pre is None:
            self._pre = PromptPreprocessor(self.engine.tokenizer, self.engine.info["max_model_len"])
        return self._pre

    @property
    def token_text(self) -> TokenText:
        if self._tt is None:
            self._tt = TokenText(self.engine.tokenizer)
        return self._tt

    def _token_text(self, as_ids: bool | None) -> TokenText:
        if not as_ids:
            return self.token_text
        if self._tt_ids is None:
            self._tt_ids = TokenText(self.engine.tokenizer, as_ids=True)
        return self._tt_ids

    # ----------------------------------------------------------------- app
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors, self._auth], client_max_size=64 << 20)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/version", self.version)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/debug/kv", self.debug_kv)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except APIError as err:
            status = err.status
            resp = _error_response(err)
            if getattr(err, "close_connection", False):
                resp.force_close()
            return resp
        except web.HTTPException as exc:
            status = exc.status
            if exc.status < 400:
                raise
            msg = {
                404: f"no route for {request.method} {request.path}",
                405: f"method {request.method} is not allowed on {request.path}",
            }.get(exc.status, exc.reason)
            return _error_response(APIError(exc.status, msg))
        except (asyncio.CancelledError, ConnectionResetError):
            status = 499
            raise
        except RecursionError:
            status = 400
            return _error_response(APIError(400, "the request is nested too deeply"))
        except Exception as exc:
            err = engine_error(exc)
            if err is None:  # a bug: the details stay in the server's log
                error_id = uuid.uuid4().hex[:12]
                logger.exception("internal error %s on %s %s", error_id, request.method, request.path)
                err = APIError(500, f"internal server error (error id {error_id}; the server log has the details)")
            status = err.status
            return _error_response(err)
        finally:
            if self.metrics is not None:
                route = request.match_info.route.resource
                self.metrics.count_request(route.canonical if route is not None else "unmatched", status)

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if self.api_key and request.path.startswith("/v1/"):
            header = request.headers.get("Authorization", "")
            if not header:
                raise APIError(401, "missing API key: send the header 'Authorization: Bearer <key>'")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
                raise APIError(401, "invalid API key")
        return await handler(request)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.accepted_names:
            raise APIError(
                404,
                f"the model '{clip(model)}' does not exist; this server serves '{self.model_name}'",
                "model",
                "model_not_found",
            )

    # ------------------------------------------------------------ simple routes
    async def health(self, request: web.Request) -> web.Response:
        if self.engine.dead:
            raise APIError(503, f"the engine failed: {self.engine.dead}")
        if not self.engine.healthy:
            raise APIError(503, "the server is shutting down")
        return _json({"status": "ok"})

    async def version(self, request: web.Request) -> web.Response:
        return _json({"version": server_version()})

    async def tokenize(self, request: web.Request) -> web.Response:
        req = await self._decode(request, TokenizeRequest)
        self._check_model(req.model)
        try:
            ids = await self.preprocessor.tokenize(req.prompt, req.add_special_tokens)
        except InvalidRequestError as exc:
            raise engine_error(exc) from None
        return _json({"count": len(ids), "max_model_len": self.engine.info.get("max_model_len"), "tokens": ids})

    async def detokenize(self, request: web.Request) -> web.Response:
        req = await self._decode(request, DetokenizeRequest)
        self._check_model(req.model)
        vocab = self.engine.info.get("vocab_size") or 0
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {clip(str(bad[0]), 30)} is outside the vocabulary [0, {vocab})", "tokens")
        if len(req.tokens) > self.engine.info.get("max_model_len", 0) * 4:
            raise APIError(400, f"tokens: at most {self.engine.info['max_model_len'] * 4} ids", "tokens")
        return _json({"prompt": await self.preprocessor.detokenize(req.tokens)})

    async def _decode(self, request: web.Request, typ: type):
        """The body decoded into ``typ`` (400 for a body that is unreadable, mis-encoded or invalid)."""
        try:
            body = await request.read()
        except RequestPayloadError as exc:  # e.g. a body marked gzip that is not gzip
            detail = str(exc).strip().splitlines()[-1].strip() if str(exc).strip() else type(exc).__name__
            err = APIError(400, f"cannot read the request body: {clip(detail, 200)}")
            err.close_connection = True  # the rest of the body is unreadable: this connection ends
            raise err from None
        except web.HTTPRequestEntityTooLarge:
            raise APIError(413, f"the request body is larger than {request.client_max_size} bytes") from None
        if len(body) > _THREAD_DECODE_BYTES:
            return await asyncio.get_running_loop().run_in_executor(None, decode_request, body, typ)
        return decode_request(body, typ)

    async def prometheus(self, request: web.Request) -> web.Response:
        body = self.metrics.render() if self.metrics is not None else b""
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    async def models(self, request: web.Request) -> web.Response:
        return _json({"object": "list", "data": [model_card(self.model_name, self.engine.info, self.created)]})

    async def model(self, request: web.Request) -> web.Response:
        self._check_model(request.match_info["model"])
        return _json(model_card(self.model_name, self.engine.info, self.created))

    async def debug_kv(self, request: web.Request) -> web.Response:
        return _json(await self.engine.debug_state())

    # ------------------------------------------------------------- generation
    async def _add_all(
        self, base_id: str, prompts: list, params, prompt_param: str, strict_field: str | None
    ) -> list[RequestStream]:
        streams: list[RequestStream] = []
        try:
            for i, p in enumerate(prompts):
                rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
                streams.append(await self.engine.add_request(rid, p, params, strict_field))
        except BaseException as exc:
            for s in streams:
                s.close()
            err = engine_error(exc, prompt_param)
            if err is not None:
                raise err from None
            raise
        return streams

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = await self._decode(request, CompletionRequest)
        self._check_model(req.model)
        params = completion_params(req, self.max_logprobs, self.generation)
        prompts = parse_completion_prompts(req.prompt)
        try:
            cut = params.truncate_prompt_tokens is not None
            prompts = [await self.preprocessor.prompt(p, truncating=cut) for p in prompts]
        except InvalidRequestError as exc:
            raise engine_error(exc) from None
        rid = req.request_id or new_id("cmpl")
        streams = await self._add_all(rid, prompts, params, "prompt", max_tokens_field(req))
        ctx = StreamContext(
            self,
            rid,
            "text_completion",
            params.n,
            req.stream_options,
            req.echo,
            self._token_text(req.return_tokens_as_token_ids),
        )
        ctx.echo_only = echo_only(req)
        try:
            if req.stream:
                return await stream_response(request, ctx, streams, self._completion_chunk, chat=False)
            outs = await _results(streams)
        finally:
            for s in streams:
                s.close()
        choices, n_out = [], 0
        for i, (s, out) in enumerate(zip(streams, outs)):
            for o in out.outputs:
                lp, tokens, lps, o_text = None, o.token_ids, o.logprobs, o.text
                if ctx.echo_only:
                    tokens, lps, o_text = [], [] if lps is not None else None, ""
                if params.logprobs is not None and lps is not None:
                    offset, before = echoed_logprobs(ctx.tt, s.prompt_token_ids, out.prompt_logprobs)
                    lp, _ = completion_logprobs(tokens, lps, ctx.tt, offset, before)
                text = (self._prompt_text(s) + o_text) if req.echo else o_text
                choices.append(
                    {
                        "index": i * params.n + o.index,
                        "text": text,
                        "logprobs": lp,
                        "finish_reason": o.finish_reason,
                        "stop_reason": o.stop_reason,
                    }
                )
                n_out += len(tokens)
        n_prompt = sum(len(s.prompt_token_ids) for s in streams)
        return _json(
            {
                "id": rid,
                "object": "text_completion",
                "created": ctx.created,
                "model": self.model_name,
                "choices": choices,
                "usage": usage(n_prompt, n_out),
            }
        )

    async def chat(self, request: web.Request) -> web.StreamResponse:
        req = await self._decode(request, ChatCompletionRequest)
        self._check_model(req.model)
        params = chat_params(req, self.max_logprobs, self.generation)
        try:
            tools = plan_tools(req.tools, req.tool_choice, self.tool_parser, req.parallel_tool_calls)
        except ToolRequestError as exc:
            raise APIError(400, str(exc), exc.field) from None
        if tools.constraint is not None:  # a forced call: the output follows its schema
            if params.structured_outputs is not None:
                raise APIError(400, "a forced tool_choice cannot be combined with response_format", "tool_choice")
            params.structured_outputs = StructuredOutputsParams(json=tools.constraint)
        kwargs = chat_template_kwargs(req)
        if tools.template_tools is not None:
            kwargs["tools"] = tools.template_tools
        try:
            prompt = await self.preprocessor.chat(
                chat_messages(req),
                add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
                continue_final_message=req.continue_final_message,
                kwargs=kwargs,
            )
        except InvalidRequestError as exc:
            raise engine_error(exc, "messages") from None
        rid = req.request_id or new_id("chatcmpl")
        streams = await self._add_all(rid, [prompt], params, "messages", max_tokens_field(req))
        ctx = StreamContext(
            self,
            rid,
            "chat.completion.chunk",
            params.n,
            req.stream_options,
            False,
            self._token_text(req.return_tokens_as_token_ids),
        )
        ctx.top_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        ctx.tools = tools if tools.mode is not None else None
        try:
            if req.stream:
                return await stream_response(request, ctx, streams, self._chat_chunk, chat=True)
            (out,) = await _results(streams)
        finally:
            for s in streams:
                s.close()
        choices = []
        for o in out.outputs:
            lp = None
            if ctx.top_logprobs is not None and o.logprobs is not None:
                lp = chat_logprobs(o.token_ids, o.logprobs, ctx.tt, ctx.top_logprobs)
            message, finish = {"role": "assistant", "content": o.text}, o.finish_reason
            if ctx.tools is not None:
                message, finish = ctx.tools.message(o.text, finish)
            choices.append(
                {
                    "index": o.index,
                    "message": message,
                    "logprobs": lp,
                    "finish_reason": finish,
                    "stop_reason": o.stop_reason,
                }
            )
        n_out = sum(len(o.token_ids) for o in out.outputs)
        return _json(
            {
                "id": rid,
                "object": "chat.completion",
                "created": ctx.created,
                "model": self.model_name,
                "choices": choices,
                "usage": usage(len(streams[0].prompt_token_ids), n_out),
            }
        )

    def _prompt_text(self, s: RequestStream) -> str:
        if s.prompt is not None:
            return s.prompt
        return self.engine.tokenizer.decode(s.prompt_token_ids, skip_special_tokens=False)

    # -------------------------------------------------------------- streaming
    def _completion_chunk(
        self, ctx: StreamContext, i: int, s: RequestStream, index: int, token_ids, text: str, lps, finish, stop_reason
    ) -> dict[str, Any]:
        key = (i, index)
        if ctx.echo_only:  # (the one generated token is dropped)
            token_ids, text, lps = [], "", [] if lps is not None else None
        if ctx.echo and key not in ctx.started:
            text = self._prompt_text(s) + text
        lp = None
        if lps is not None:
            offset, before = ctx.offsets.get(key, 0), None
            if key not in ctx.started:
                offset, before = echoed_logprobs(ctx.tt, s.prompt_token_ids, s.prompt_logprobs if ctx.echo else None)
            lp, ctx.offsets[key] = completion_logprobs(token_ids, lps, ctx.tt, offset, before)
        ctx.started.add(key)
        choice = {
            "index": i * ctx.n + index,
            "text": text,
            "logprobs": lp,
            "finish_reason": finish,
            "stop_reason": stop_reason,
        }
        return ctx.chunk([choice])

    def _chat_chunk(
        self, ctx: StreamContext, i: int, s: RequestStream, index: int, token_ids, text: str, lps, finish, stop_reason
    ) -> dict[str, Any]:
        lp = None
        if lps is not None and ctx.top_logprobs is not None:
            lp = chat_logprobs(token_ids, lps, ctx.tt, ctx.top_logprobs)
        delta = {"content": text} if (text or finish is None) else {}
        if ctx.tools is not None:  # content before any call as it comes, the calls at the end
            ts = ctx.tool_streams.setdefault(index, ctx.tools.stream())
            content, calls = ts.feed(text, final=finish is not None)
            delta = {"content": content} if (content or (finish is None and not calls)) else {}
            if calls:
                delta["tool_calls"] = calls
            finish = ctx.tools.finish_reason(finish, ts.num_calls)
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish, "stop_reason": stop_reason}
        return ctx.chunk([choice])


async def _results(streams: list[RequestStream]):
    try:
        return await asyncio.gather(*(s.result() for s in streams))
    except EngineUnavailable as exc:
        raise APIError(503, str(exc)) from None
