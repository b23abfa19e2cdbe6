"""The gRPC API (grpc.aio, same event loop as HTTP): ``syncless.v1.Generation`` plus
the standard ``grpc.health.v1.Health`` service.

Status codes: validation -> INVALID_ARGUMENT (the message names the field),
overload -> RESOURCE_EXHAUSTED, engine failure or shutdown -> UNAVAILABLE,
unknown model -> NOT_FOUND, missing/wrong API key -> UNAUTHENTICATED, a bug -> INTERNAL
with an error id (the details stay in the server log). A cancelled call aborts its request.
Text prompts are bounded and tokenized by the ``PromptPreprocessor`` thread.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import uuid

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from cluster.async_engine import AsyncEngine
from cluster.request_stream import EngineUnavailable, Overloaded
from cluster.input_processor import InvalidRequestError
from cluster.openai_protocol import MAX_REQUEST_ID_CHARS, clip, valid_request_id
from cluster.prompt_preprocessor import PromptPreprocessor
from cluster.generation_config import NO_GENERATION_DEFAULTS, GenerationDefaults
from cluster.proto import pb2, pb2_grpc
from metadata.sampling_params import SamplingParams, SamplingParamsError

logger = logging.getLogger(__name__)
SERVICE_NAME = "syncless.v1.Generation"

_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "max_tokens",
    "min_tokens",
    "include_stop_str_in_output",
    "ignore_eos",
    "logprobs",
    "prompt_logprobs",
    "skip_special_tokens",
    "truncate_prompt_tokens",
    "priority",
)


def sampling_from_proto(sp, defaults: GenerationDefaults | None = None) -> SamplingParams:
    """The fields ``sp`` sets; the rest from ``defaults`` (the model's generation config), else
    the engine's."""
    kw = {}
    for name in _FIELDS:
        if sp.HasField(name):
            kw[name] = getattr(sp, name)
    if sp.HasField("unlimited_tokens") and sp.unlimited_tokens:
        if "max_tokens" in kw:
            raise InvalidRequestError("max_tokens: set either max_tokens or unlimited_tokens", "max_tokens")
        kw["max_tokens"] = None
    if sp.stop:
        kw["stop"] = list(sp.stop)
    if sp.stop_token_ids:
        kw["stop_token_ids"] = list(sp.stop_token_ids)
    if sp.logit_bias:
        kw["logit_bias"] = dict(sp.logit_bias)
    if sp.allowed_token_ids:
        kw["allowed_token_ids"] = list(sp.allowed_token_ids)
    if sp.bad_words:
        kw["bad_words"] = list(sp.bad_words)
    if sp.HasField("structured_outputs"):
        so = sp.structured_outputs
        fields = ("json", "regex", "grammar", "json_object", "disable_any_whitespace")
        given = {k: getattr(so, k) for k in fields if so.HasField(k)}
        kw["structured_outputs"] = {**given, **({"choice": list(so.choice)} if so.choice else {})}
    try:
        return (defaults or NO_GENERATION_DEFAULTS).params(**kw)
    except SamplingParamsError as exc:
        raise InvalidRequestError(str(exc), str(exc).split(" ")[0]) from None


class _Malformed:
    """A request body that is not the method's protobuf message (answered INVALID_ARGUMENT)."""

    def __init__(self, message: str):
        self.message = message


def _lenient(cls):
    def parse(data: bytes):
        try:
            return cls.FromString(data)
        except Exception:  # noqa: BLE001 - protobuf's DecodeError and friends
            return _Malformed(f"the request is not a valid {cls.DESCRIPTOR.full_name} message")

    return parse


def _add_generation_service(servicer: "GenerationService", server) -> None:
    """``pb2_grpc.add_GenerationServicer_to_server`` with deserializers that never raise: gRPC's own
    answer to an undecodable body is INTERNAL, ours INVALID_ARGUMENT."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate,
            request_deserializer=_lenient(pb2.GenerateRequest),
            response_serializer=pb2.GenerateResponse.SerializeToString,
        ),
        "Abort": grpc.unary_unary_rpc_method_handler(
            servicer.Abort,
            request_deserializer=_lenient(pb2.AbortRequest),
            response_serializer=pb2.AbortResponse.SerializeToString,
        ),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetModelInfo,
            request_deserializer=_lenient(pb2.GetModelInfoRequest),
            response_serializer=pb2.ModelInfo.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


class _Health(HealthServicer):
    """Health whose status follows the engine (NOT_SERVING once it dies or drains)."""

    def __init__(self, engine: AsyncEngine):
        super().__init__()
        self.engine = engine

    def _status(self):
        return (
            health_pb2.HealthCheckResponse.SERVING
            if self.engine.healthy
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )

    async def Check(self, request, context):
        if request.service not in ("", SERVICE_NAME):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=self._status())

    async def refresh(self) -> None:
        for svc in ("", SERVICE_NAME):
            await self.set(svc, self._status())


class GenerationService(pb2_grpc.GenerationServicer):
    def __init__(
        self,
        engine: AsyncEngine,
        model_name: str,
        api_key: str | None = None,
        aliases: tuple[str, ...] = (),
        preprocessor: PromptPreprocessor | None = None,
        generation: GenerationDefaults | None = None,
    ):
        self.engine = engine
        self.model_name = model_name
        self.accepted_names = {model_name, *aliases}
        self.api_key = api_key
        self._pre = preprocessor
        self.generation = generation  # the model's generation config: defaults of unset fields

    @property
    def preprocessor(self) -> PromptPreprocessor:
        if self._pre is None:
            self._pre = PromptPreprocessor(self.engine.tokenizer, self.engine.info["max_model_len"])
        return self._pre

    async def _check_auth(self, context, request=None) -> None:
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        if not self.api_key:
            return
        md = dict(context.invocation_metadata() or ())
        token = md.get("x-api-key")
        auth = md.get("authorization", "")
        if token is None and auth:
            scheme, _, rest = auth.partition(" ")
            token = rest.strip() if scheme.lower() == "bearer" else None
        if token is None and not auth:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED, "missing API key: send metadata 'authorization: Bearer <key>'"
            )
        if token is None or not hmac.compare_digest(token.encode(), self.api_key.encode()):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid API key")

    async def _fail(self, context, exc: BaseException):
        if isinstance(exc, InvalidRequestError):
            msg = clip(str(exc), 1000)
            if exc.field and not msg.startswith(exc.field):
                msg = f"{exc.field}: {msg}"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, msg)
        if isinstance(exc, Overloaded):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        if isinstance(exc, EngineUnavailable):
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        error_id = uuid.uuid4().hex[:12]
        logger.error("internal error %s in Generate", error_id, exc_info=exc)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal server error (error id {error_id})")

    async def Generate(self, request, context):
        await self._check_auth(context, request)
        if request.model and request.model not in self.accepted_names:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"model: '{clip(request.model)}' does not exist; this server serves '{self.model_name}'",
            )
        if request.request_id and not valid_request_id(request.request_id):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request_id: must be 1 to {MAX_REQUEST_ID_CHARS} printable ASCII characters",
            )
        which = request.WhichOneof("prompt")
        if which is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt: set text or token_ids")
        prompt = request.text if which == "text" else {"prompt_token_ids": list(request.token_ids.ids)}
        rid = request.request_id or f"grpc-{uuid.uuid4().hex}"
        try:
            params = sampling_from_proto(request.sampling, self.generation)
            prompt = await self.preprocessor.prompt(prompt, truncating=params.truncate_prompt_tokens is not None)
            # a max_tokens the client set past the context is refused, the default is cut
            stream = await self.engine.add_request(
                rid, prompt, params, "max_tokens" if request.sampling.HasField("max_tokens") else None
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - _fail answers every kind
            await self._fail(context, exc)
            return
        n_out = 0
        finished: set[int] = set()
        first = True
        try:
            try:
                async for d in stream:
                    n_out += len(d.token_ids)
                    msg = self._response(rid, d.index, d.token_ids, d.text, d.logprobs, d.finish_reason, d.stop_reason)
                    if first:
                        msg.prompt_token_ids.extend(stream.prompt_token_ids)
                        if d.prompt_logprobs is not None:
                            self._add_logprobs(msg.prompt_logprobs, stream.prompt_token_ids[1:], d.prompt_logprobs[1:])
                        first = False
                    if d.finish_reason:
                        finished.add(d.index)
                        if len(finished) == params.n:  # the request's last response
                            self._usage(msg, stream, n_out)
                    yield msg
            except EngineUnavailable as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            # sequences the server ended without a delta (aborted): one closing response each
            outs = stream.output.outputs if stream.output else []
            pending = [o for o in outs if o.index not in finished]
            for j, o in enumerate(pending):
                msg = self._response(rid, o.index, [], "", None, o.finish_reason or "abort", None)
                if first:
                    msg.prompt_token_ids.extend(stream.prompt_token_ids)
                    first = False
                if j == len(pending) - 1:
                    self._usage(msg, stream, n_out)
                yield msg
        finally:
            stream.close()

    def _usage(self, msg, stream, n_out: int) -> None:
        p = len(stream.prompt_token_ids)
        msg.usage.prompt_tokens = p
        msg.usage.completion_tokens = n_out
        msg.usage.total_tokens = p + n_out

    @staticmethod
    def _response(rid, index, token_ids, text, logprobs, finish, stop_reason):
        msg = pb2.GenerateResponse(
            request_id=rid, index=index, token_ids=token_ids, text=text, finish_reason=finish or ""
        )
        if isinstance(stop_reason, str):
            msg.stop_str = stop_reason
        elif isinstance(stop_reason, int):
            msg.stop_token_id = stop_reason
        GenerationService._add_logprobs(msg.logprobs, token_ids, logprobs or ())
        return msg

    @staticmethod
    def _add_logprobs(field, token_ids, logprobs) -> None:
        for tid, lp in zip(token_ids, logprobs):
            entry = field.add(token_id=tid, logprob=lp.get(tid, 0.0))
            for t, v in lp.items():
                entry.top.add(token_id=t, logprob=v)

    async def Abort(self, request, context):
        await self._check_auth(context, request)
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: must not be empty")
        return pb2.AbortResponse(aborted=self.engine.abort(request.request_id))

    async def GetModelInfo(self, request, context):
        await self._check_auth(context, request)
        i = self.engine.info
        return pb2.ModelInfo(
            model_name=self.model_name,
            model_path=i["model_path"],
            architecture=i["architecture"],
            vocab_size=i["vocab_size"],
            max_model_len=i["max_model_len"],
            block_size=i["block_size"],
            num_kv_blocks=i["num_kv_blocks"],
            eos_token_ids=i["eos_token_ids"],
            tensor_parallel_size=i["tensor_parallel_size"],
            device=i["device"],
        )


async def start_grpc(
    engine: AsyncEngine,
    model_name: str,
    host: str,
    port: int,
    api_key: str | None,
    aliases: tuple[str, ...] = (),
    preprocessor: PromptPreprocessor | None = None,
    generation: GenerationDefaults | None = None,
):
    """Start the gRPC server; returns (server, bound port, health servicer)."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    service = GenerationService(engine, model_name, api_key, aliases, preprocessor, generation)
    _add_generation_service(service, server)
    health = _Health(engine)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    bound = server.add_insecure_port(addr)
    if bound == 0:
        raise OSError(f"cannot bind the gRPC server to {addr}")
    await server.start()
    await health.refresh()
    return server, bound, health
