"""The per-step channel between the driver and one worker: a TCP connection of its own.

Step plans and results do not travel as Ray actor calls. Each call costs Ray's Python on
both sides (task submission, the actor's event loop, return-value handling), and on the
worker that Python runs in another thread of the process, holding the GIL while the step
thread is launching a step: launches ran 20-60 % above their single-threaded time, and a
call's round trip cost more than a launch. Here the driver connects once to each worker
(address and a one-time token handed over through Ray at start-up) and the step traffic is
length-prefixed frames of msgspec bytes: plans one way, results the other, in step order.
On the worker a reader thread blocks in ``recv`` (no GIL held while it waits), decodes the
plan into the step loop's queue, and the step thread sends each result itself when its
copy completes.

Ray still places, starts, watches and stops the workers; a worker that dies closes its
connection, which the driver notices at once (``cluster.step_channel``).
"""

from __future__ import annotations

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


def tune(sock: socket.socket) -> None:
    """No Nagle delay on small frames; keepalive probes notice a peer whose host vanished."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)


class StepChannelServer:
    """The worker's end: accepts the driver's connection (which must open with the token),
    feeds its plans to ``loop`` (a ``workers.step_loop.StepLoop``) and sends each result
    back. Ranks other than ``result_rank`` send only the step id and error."""

    def __init__(self, loop, host: str, rank: int, result_rank: int):
        self.loop, self.rank, self.result_rank = loop, rank, result_rank
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self._listener = socket.create_server((host, 0))
        self.address = (host, self._listener.getsockname()[1])
        self._conn: socket.socket | None = None
        self._send_lock = threading.Lock()
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
                ok = secrets.compare_digest(recv_frame(conn), self.token)
            except (ChannelClosed, OSError):
                ok = False
            if ok:
                conn.settimeout(None)
                tune(conn)
                self._listener.close()
                self._conn = conn
                return conn
            logger.warning("rank %d: refused a step channel connection from %s (wrong token)", self.rank, peer)
            conn.close()

    def _submit(self, plan_bytes: bytes) -> None:
        try:
            fut = self.loop.submit(plan_bytes)
        except Exception as exc:  # an undecodable plan: the driver reports it as this rank's failure
            self._send(encode(StepResult(step_id=-1, rank=self.rank, error=f"{type(exc).__name__}: {exc}")))
            return
        fut.add_done_callback(self._on_result)  # (runs on the step thread, which set the result)

    def _on_result(self, fut) -> None:
        data = fut.result()
        if self.rank != self.result_rank:
            r = decode_result(data)
            data = encode(StepResult(step_id=r.step_id, rank=self.rank, error=r.error))
        self._send(data)

    def _send(self, data: bytes) -> None:
        try:
            with self._send_lock:
                send_frame(self._conn, data)
        except OSError:  # the driver is gone; the reader notices and stops
            pass

    def close(self) -> None:
        for s in (self._listener, self._conn):
            if s is not None:
                try:
                    s.close()
                except OSError:
                    pass
