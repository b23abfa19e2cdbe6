"""Server-sent events for the OpenAI-compatible API: one response's chunks, merged from the
request's ``n`` sequence streams as they arrive."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import msgspec
from aiohttp import web

from cluster.request_stream import EngineUnavailable, RequestStream
from cluster.openai_protocol import APIError, TokenText, now, usage

logger = logging.getLogger(__name__)
_encode = msgspec.json.Encoder().encode


class StreamContext:
    """What every chunk of one streamed response shares."""

    def __init__(self, server, rid: str, obj: str, n: int, stream_options, echo: bool, tt: TokenText):
        self.server = server
        self.tt = tt
        self.rid = rid
        self.object = obj
        self.n = n
        self.stream_options = stream_options
        self.echo = echo
        self.created = now()
        self.top_logprobs: int | None = None
        self.echo_only = False  # (openai_protocol.echo_only: generated tokens are dropped)
        self.tools = None  # a cluster.tool_calls.ToolPlan whose output is read for tool calls
        self.tool_streams: dict = {}  # index -> its streamed reader (ToolPlan.stream)
        self.started: set = set()
        self.offsets: dict = {}

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.rid,
            "object": self.object,
            "created": self.created,
            "model": self.server.model_name,
            "choices": choices,
        }


async def stream_response(
    request: web.Request, ctx: StreamContext, streams: list[RequestStream], make, chat: bool
) -> web.StreamResponse:
    """Server-sent events of ``streams`` (one request's ``n`` sequences), one chunk a delta built
    by ``make``; errors after the first byte end the stream with an error event."""
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Request-Id": ctx.rid}
    )
    await resp.prepare(request)

    n_prompt = sum(len(s.prompt_token_ids) for s in streams)
    so = ctx.stream_options
    every_chunk = so is not None and so.include_usage and so.continuous_usage_stats
    n_out = 0

    async def send(obj: dict[str, Any], counted: bool = True) -> None:
        if every_chunk and counted:  # (vLLM's continuous_usage_stats: the usage so far)
            obj["usage"] = usage(n_prompt, n_out)
        await resp.write(b"data: " + _encode(obj) + b"\n\n")

    if chat:
        for idx in range(ctx.n):
            await send(
                ctx.chunk(
                    [
                        {
                            "index": idx,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                )
            )
    finished: set[tuple[int, int]] = set()
    merged = merge_streams(streams)
    try:
        async for i, d in merged:
            n_out += 0 if ctx.echo_only else len(d.token_ids)
            if d.finish_reason:
                finished.add((i, d.index))
            await send(
                make(ctx, i, streams[i], d.index, d.token_ids, d.text, d.logprobs, d.finish_reason, d.stop_reason)
            )
        for i, s in enumerate(streams):  # sequences the server aborted (shutdown) end too
            for o in s.output.outputs if s.output else []:
                if (i, o.index) not in finished:
                    await send(make(ctx, i, s, o.index, [], "", None, o.finish_reason or "abort", None))
        if so is not None and so.include_usage:
            chunk = ctx.chunk([])
            chunk["usage"] = usage(n_prompt, n_out)
            await send(chunk, counted=False)
    except EngineUnavailable as exc:
        await send(APIError(503, str(exc)).body(), counted=False)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        error_id = uuid.uuid4().hex[:12]
        logger.exception("internal error %s while streaming %s", error_id, ctx.rid)
        await send(APIError(500, f"internal server error (error id {error_id})").body(), counted=False)
    finally:
        await merged.aclose()
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def merge_streams(streams: list[RequestStream]):
    """(stream index, delta) from all streams as they arrive."""
    if len(streams) == 1:
        async for d in streams[0]:
            yield 0, d
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for d in s:
                q.put_nowait((i, d))
            q.put_nowait((i, None))
        except BaseException as exc:  # noqa: BLE001 - re-raised by the consumer
            q.put_nowait((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await q.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
