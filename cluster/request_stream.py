"""The consumer side of one request's output stream (``RequestStream``), the item that ends
it (``StreamEnd``) and the errors a stream or a submission raises: shared by the engine's
asyncio front (``cluster.async_engine``), its servers and the data-parallel front end."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from cluster.outputs import RequestOutput, StreamDelta


class Overloaded(RuntimeError):
    """Too many requests are waiting; the client should retry later (429 / RESOURCE_EXHAUSTED)."""


class EngineUnavailable(RuntimeError):
    """The engine died or is shutting down (503 / UNAVAILABLE)."""


@dataclass
class StreamEnd:
    """The last item of a stream's queue: the final output, or the error that ended it."""

    output: RequestOutput | None
    error: str | None = None


class RequestStream:
    """The deltas of one request group; iterate it, then read ``output``.

    Iteration raises ``EngineUnavailable`` if the engine fails the request.
    ``close()`` aborts the request if it has not finished.
    """

    failure = "the engine failed"  # the error of a delta that ends the request without a message

    def __init__(self, engine, request_id: str):
        self.engine = engine
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.arrival = time.monotonic()
        self.prompt: str | None = None
        self.prompt_token_ids: list[int] = []
        self.output: RequestOutput | None = None
        self.finished = False
        self.error: str | None = None
        self.last_token_time: dict[int, float] = {}
        self.prompt_logprobs: list | None = None  # (SamplingParams.prompt_logprobs: from the first delta)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> StreamDelta:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, StreamEnd):
            self.finished = True
            self.output = item.output
            if item.error:
                self.error = item.error
                raise EngineUnavailable(item.error)
            raise StopAsyncIteration
        if item.finish_reason == "error":
            self.error = item.error or self.failure
            raise EngineUnavailable(self.error)
        if item.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = item.prompt_logprobs
        return item

    async def result(self) -> RequestOutput:
        """Drain the stream; the final output."""
        async for _ in self:
            pass
        return self.output

    def close(self) -> None:
        if not self.finished:
            self.engine.abort(self.request_id)
