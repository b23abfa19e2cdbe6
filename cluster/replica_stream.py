"""The client side of one request group on the data-parallel front end: a ``RequestStream``
that also carries where ``cluster.dp_engine.DataParallelEngine`` routed it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cluster.request_stream import RequestStream

if TYPE_CHECKING:
    from cluster.dp_engine import DataParallelEngine
    from cluster.replica_wire import ReplicaRequest


class ReplicaStream(RequestStream):
    """A ``RequestStream`` of the data-parallel front end, with its routing state."""

    failure = "the replica failed"

    def __init__(self, engine: DataParallelEngine, request_id: str, wire: ReplicaRequest, hashes: list[bytes]):
        super().__init__(engine, request_id)
        self.wire = wire
        self.hashes = hashes
        self.replica = -1
        self.streamed = False  # a token reached the client: the request can no longer move
        self.moves = 0
        self.failed_on: str | None = None  # set when its replica failed it before it streamed
        self.sending = False  # an add to a replica is in flight (``_send`` handles its failure)
