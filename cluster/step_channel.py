"""The driver's end of one worker's step channel (``workers.step_channel``).

``send`` writes a plan's bytes and returns a future for that step's ``StepResult``; a
reader thread decodes the results as they arrive and resolves the futures in turn. The
worker sends results in the order the plans arrived, so each result must carry the step
id of the oldest waiting plan (or -1, the error result of a plan the worker could not
decode); one that does not is a protocol error and ends the channel rather than resolve
another step's future. When the connection ends (the worker's process died, its host
vanished and the keepalive probes or the unacknowledged-data timeout gave up, a send
failed part-way through a frame) every future still waiting fails with ``ChannelClosed``,
and so does every later ``send``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import socket
import threading

from metadata.wire import decode_result
from workers.step_channel import MAX_FRAME_BYTES, ChannelClosed, recv_frame, send_frame, tune


class StepChannel:
    """Plans to one worker, its results back, in order."""

    def __init__(self, host: str, port: int, token: bytes, rank: int, connect_timeout_s: float = 30.0):
        self.rank = rank
        self._sock = socket.create_connection((host, port), timeout=connect_timeout_s)
        self._sock.settimeout(None)
        tune(self._sock)
        send_frame(self._sock, token)
        # (step id, future) per plan sent, oldest first
        self._pending: collections.deque[tuple[int, concurrent.futures.Future]] = collections.deque()
        self._lock = threading.Lock()  # guards _pending and closed (held briefly: the reader takes it)
        self._send_lock = threading.Lock()  # serialises senders, so futures queue in the frames' order
        self.closed: str | None = None  # why the channel ended
        self._reader = threading.Thread(target=self._read, name=f"step-results-{rank}", daemon=True)
        self._reader.start()

    def send(self, data: bytes, step_id: int) -> concurrent.futures.Future:
        """Ship one plan (``step_id`` is its ``StepPlan.step_id``); the future resolves to the
        worker's ``StepResult`` for it. A plan too large for a frame raises ``ValueError`` and
        leaves the channel as it was; a failed send ends the channel (``ChannelClosed``)."""
        if len(data) > MAX_FRAME_BYTES:
            raise ValueError(f"a plan of {len(data)} bytes exceeds the step channel's frames ({MAX_FRAME_BYTES})")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._send_lock:
            with self._lock:
                if self.closed is not None:
                    raise ChannelClosed(self.closed)
                self._pending.append((step_id, fut))
            try:
                send_frame(self._sock, data)
                return fut
            except BaseException as exc:  # part of the frame may be out: the stream is unusable
                with self._lock:
                    if self._pending and self._pending[-1][1] is fut:
                        self._pending.pop()
                    if self.closed is None:
                        self.closed = f"sending a plan failed: {type(exc).__name__}: {exc}"
                    why = self.closed
                self._shutdown()
                self._fail(why)
                if isinstance(exc, Exception):
                    raise ChannelClosed(why) from exc
                raise

    def _read(self) -> None:
        try:
            while True:
                result = decode_result(recv_frame(self._sock))
                with self._lock:
                    if not self._pending:
                        raise ChannelClosed(f"protocol error: result for step {result.step_id} with no step in flight")
                    expected, fut = self._pending[0]
                    if result.step_id not in (expected, -1):
                        raise ChannelClosed(
                            f"protocol error: result for step {result.step_id} where step {expected} was expected"
                        )
                    self._pending.popleft()
                fut.set_result(result)
        except Exception as exc:  # noqa: BLE001 - the end of the stream, a broken connection, bad bytes
            self._fail(f"{type(exc).__name__}: {exc}" if not isinstance(exc, ChannelClosed) else str(exc))
            self._shutdown()  # (tells the worker, and stops a sender waiting on a stuck socket)

    def _shutdown(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _fail(self, why: str) -> None:
        with self._lock:
            if self.closed is None:
                self.closed = why
            pending, self._pending = list(self._pending), collections.deque()
        for _, fut in pending:
            fut.set_exception(ChannelClosed(self.closed))

    def close(self) -> None:
        self._shutdown()
        self._sock.close()
        self._fail("the driver closed the channel")
