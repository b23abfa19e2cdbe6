"""The driver's end of one worker's step channel (``workers.step_channel``).

``send`` writes a plan's bytes and returns a future for that step's ``StepResult``; a
reader thread decodes the results as they arrive (in step order) and resolves the futures
in turn. When the connection ends (the worker's process died, or its host vanished and the
keepalive probes gave up) every future still waiting fails with ``ChannelClosed``, and so
does every later ``send``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import socket
import threading

from metadata.wire import decode_result
from workers.step_channel import ChannelClosed, recv_frame, send_frame, tune


class StepChannel:
    """Plans to one worker, its results back, in order."""

    def __init__(self, host: str, port: int, token: bytes, rank: int, connect_timeout_s: float = 30.0):
        self.rank = rank
        self._sock = socket.create_connection((host, port), timeout=connect_timeout_s)
        self._sock.settimeout(None)
        tune(self._sock)
        send_frame(self._sock, token)
        self._pending: collections.deque[concurrent.futures.Future] = collections.deque()
        self._lock = threading.Lock()
        self.closed: str | None = None  # why the channel ended
        self._reader = threading.Thread(target=self._read, name=f"step-results-{rank}", daemon=True)
        self._reader.start()

    def send(self, data: bytes) -> concurrent.futures.Future:
        """Ship one plan; the future resolves to the worker's ``StepResult`` for it."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:  # the order of the futures is the order of the frames
            if self.closed is not None:
                raise ChannelClosed(self.closed)
            self._pending.append(fut)
            try:
                send_frame(self._sock, data)
            except OSError as exc:
                self._pending.pop()
                self.closed = f"sending a plan failed: {exc}"
                raise ChannelClosed(self.closed) from None
        return fut

    def _read(self) -> None:
        try:
            while True:
                result = decode_result(recv_frame(self._sock))
                with self._lock:
                    fut = self._pending.popleft() if self._pending else None
                if fut is None:
                    raise ChannelClosed(f"a result for step {result.step_id} arrived with no step in flight")
                fut.set_result(result)
        except Exception as exc:  # noqa: BLE001 - the end of the stream, a broken connection, bad bytes
            self._fail(f"{type(exc).__name__}: {exc}" if not isinstance(exc, ChannelClosed) else str(exc))

    def _fail(self, why: str) -> None:
        with self._lock:
            if self.closed is None:
                self.closed = why
            pending, self._pending = list(self._pending), collections.deque()
        for fut in pending:
            fut.set_exception(ChannelClosed(self.closed))

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._fail("the driver closed the channel")
