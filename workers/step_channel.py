"""The per-step channel between the driver and one worker: a TCP connection of its own.

Step plans and results do not travel as Ray actor calls. Each call costs Ray's Python on
both sides (task submission, the actor's event loop, return-value handling), and on the
worker that Python runs in another thread of the process, holding the GIL while the step
thread is launching a step: launches ran 20-60 % above their single-threaded time, and a
call's round trip cost more than a launch. Here the driver connects once to each worker
(address and a one-time token handed over through Ray at start-up) and the step traffic is
length-prefixed frames of msgspec bytes: plans one way, results the other. On the worker a
reader thread blocks in ``recv`` (no GIL held while it waits) and decodes each plan into
the step loop's queue; the step thread sends results itself as their copies complete.

Results go back strictly in the order the plans arrived, which is what the driver pairs
them by: the step loop may finish a step out of turn (a launch that fails reports at once,
while the step before it still waits for its copy), so a finished result waits until every
earlier one has been sent. A plan that cannot be decoded holds its place in that order
with an error result of step id -1.

Ray still places, starts, watches and stops the workers; a worker that dies closes its
connection, which the driver notices at once (``cluster.step_channel``). A host that
vanishes closes nothing: keepalive probes end an idle connection, and ``TCP_USER_TIMEOUT``
one whose sent data stays unacknowledged, within about 30 s (``tune``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import secrets
import socket
import struct
import threading

from metadata.wire import StepResult, decode_result, encode

logger = logging.getLogger(__name__)

_LEN = struct.Struct("<I")
MAX_FRAME_BYTES = 1 << 30  # a plan of many long prompts is MBs; anything near this is corrupt
TOKEN_BYTES = 32
USER_TIMEOUT_MS = 30_000  # sent data unacknowledged this long: the connection is dead


class ChannelClosed(ConnectionError):
    """The other end closed the connection (or it broke)."""


def send_frame(sock: socket.socket, payload: bytes) -> None:
    """One length-prefixed frame (the caller serialises concurrent senders)."""
    if len(payload) > MAX_FRAME_BYTES:
        raise ValueError(f"a frame of {len(payload)} bytes exceeds the channel's {MAX_FRAME_BYTES}")
    sock.sendall(_LEN.pack(len(payload)) + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ChannelClosed("the connection was closed")
        got += k
    return bytes(buf)


def recv_frame(sock: socket.socket) -> bytes:
    """The next frame's payload; ``ChannelClosed`` at the end of the stream."""
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > MAX_FRAME_BYTES:
        raise ChannelClosed(f"a frame header announces {n} bytes: not a step channel peer")
    return _recv_exact(sock, n) if n else b""


def recv_token(sock: socket.socket) -> bytes:
    """The opening frame, which must be a token: its length is checked before anything
    else is read, so a stray client (``GET / HTTP/1.1`` reads as a 517 MB frame) costs nothing."""
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n != TOKEN_BYTES:
        raise ChannelClosed(f"the opening frame announces {n} bytes, not a {TOKEN_BYTES}-byte token")
    return _recv_exact(sock, TOKEN_BYTES)


def tune(sock: socket.socket) -> None:
    """No Nagle delay on small frames; keepalive probes notice a peer whose host vanished
    while the connection is idle, ``TCP_USER_TIMEOUT`` while sent data waits for its ack
    (retransmissions would otherwise go on for ~15 minutes; keepalive does not run then)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (
        ("TCP_KEEPIDLE", 10),
        ("TCP_KEEPINTVL", 5),
        ("TCP_KEEPCNT", 3),
        ("TCP_USER_TIMEOUT", USER_TIMEOUT_MS),
    ):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)


def _shut(sock: socket.socket | None) -> None:
    """Shut down and close, waking any thread blocked in ``accept`` or ``recv`` on it."""
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # never connected, or already closed
        pass
    try:
        sock.close()
    except OSError:
        pass


class StepChannelServer:
    """The worker's end: accepts the driver's connection (which must open with the token),
    feeds its plans to ``loop`` (a ``workers.step_loop.StepLoop``) and sends the results
    back in the plans' order. Ranks other than ``result_rank`` send only the step id and error."""

    def __init__(self, loop, host: str, rank: int, result_rank: int):
        self.loop, self.rank, self.result_rank = loop, rank, result_rank
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self._listener = socket.create_server((host, 0))
        self.address = (host, self._listener.getsockname()[1])
        self._conn: socket.socket | None = None
        self._closed = False
        self._send_lock = threading.Lock()  # held by whoever takes results off _order and sends them
        self._order: collections.deque[concurrent.futures.Future] = collections.deque()  # plans received, oldest first
        self._thread = threading.Thread(target=self._serve, name=f"step-channel-{rank}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        conn = self._accept()
        if conn is None:
            return
        try:
            while True:
                self._submit(recv_frame(conn))
        except (ChannelClosed, OSError):
            logger.info("rank %d: the driver closed the step channel", self.rank)
        finally:
            conn.close()

    def _accept(self) -> socket.socket | None:
        """The first connection that presents the token (others are dropped)."""
        while True:
            try:
                conn, peer = self._listener.accept()
            except OSError:  # closed
                return None
            try:
                conn.settimeout(10.0)
                why = None if secrets.compare_digest(recv_token(conn), self.token) else "wrong token"
            except (ChannelClosed, OSError) as exc:
                why = str(exc) or type(exc).__name__
            if why is None and not self._closed:
                conn.settimeout(None)
                tune(conn)
                self._conn = conn
                _shut(self._listener)
                if self._closed:  # close() ran meanwhile and may have missed the connection
                    _shut(conn)
                    return None
                return conn
            _shut(conn)
            if self._closed:
                return None
            logger.warning("rank %d: refused a step channel connection from %s (%s)", self.rank, peer, why)

    def _submit(self, plan_bytes: bytes) -> None:
        try:
            fut = self.loop.submit(plan_bytes)
        except Exception as exc:  # an undecodable plan: the driver reports it as this rank's failure
            fut = concurrent.futures.Future()
            fut.set_result(self._error_bytes(exc))
        self._order.append(fut)  # (a deque: appends here and pops in _flush need no common lock)
        fut.add_done_callback(self._flush)  # (runs on the step thread, which set the result)

    def _flush(self, _fut=None) -> None:
        """Send the finished results at the head of the order (a result that finished out of
        turn waits here for the ones before it)."""
        with self._send_lock:
            while self._order and self._order[0].done():
                data = self._result_bytes(self._order.popleft())
                try:
                    try:
                        send_frame(self._conn, data)
                    except ValueError as exc:  # a result too large for a frame: its error instead
                        send_frame(self._conn, self._error_bytes(exc))
                except OSError:  # the driver is gone; the reader notices and stops
                    pass

    def _result_bytes(self, fut: concurrent.futures.Future) -> bytes:
        try:
            data = fut.result(timeout=0)
            if self.rank != self.result_rank:
                r = decode_result(data)
                data = encode(StepResult(step_id=r.step_id, rank=self.rank, error=r.error))
            return data
        except Exception as exc:  # (the step loop always sets bytes; still, never leave the driver waiting)
            return self._error_bytes(exc)

    def _error_bytes(self, exc: BaseException) -> bytes:
        """An error result whose step is unknown here (step id -1, which the driver accepts in any place)."""
        return encode(StepResult(step_id=-1, rank=self.rank, error=f"{type(exc).__name__}: {exc}"))

    def close(self) -> None:
        self._closed = True
        _shut(self._listener)
        _shut(self._conn)
