"""The client side of one request group on the data-parallel front end: ``ReplicaStream``
queues the deltas ``cluster.dp_engine.DataParallelEngine`` dispatches to it and yields them
(the interface of ``cluster.async_engine.RequestStream``)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cluster.async_engine import EngineUnavailable
from cluster.outputs import RequestOutput, StreamDelta

if TYPE_CHECKING:
    from cluster.dp_engine import DataParallelEngine
    from cluster.replica_wire import ReplicaRequest


@dataclass
class StreamEnd:
    """The last item of a stream's queue: the final output, or the error that ended it."""

    output: RequestOutput | None
    error: str | None = None


class ReplicaStream:
    """The deltas of one request group (the interface of ``async_engine.RequestStream``)."""

    def __init__(self, engine: DataParallelEngine, request_id: str, wire: ReplicaRequest, hashes: list[bytes]):
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
        self.wire = wire
        self.hashes = hashes
        self.replica = -1
        self.streamed = False  # a token reached the client: the request can no longer move
        self.moves = 0
        self.failed_on: str | None = None  # set when its replica failed it before it streamed
        self.sending = False  # an add to a replica is in flight (``_send`` handles its failure)

    def __aiter__(self) -> ReplicaStream:
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
            self.error = item.error or "the replica failed"
            raise EngineUnavailable(self.error)
        return item

    async def result(self) -> RequestOutput:
        async for _ in self:
            pass
        return self.output

    def close(self) -> None:
        if not self.finished:
            self.engine.abort(self.request_id)
