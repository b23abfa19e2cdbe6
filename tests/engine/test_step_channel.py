"""The step channel between the driver and a worker (``workers.step_channel``,
``cluster.step_channel``): framing, the token, result order, and what each side sees when
the other goes away. The worker side is driven by a stand-in step loop here (its
``submit`` is the whole interface); the engine tests run it with the real one."""

from __future__ import annotations

import concurrent.futures
import contextlib
import socket
import threading
import time

import pytest

import cluster.step_channel
import workers.step_channel
from cluster.step_channel import StepChannel
from metadata.wire import StepPlan, StepResult, decode_plan, decode_result, encode
from workers.step_channel import (
    TOKEN_BYTES,
    USER_TIMEOUT_MS,
    ChannelClosed,
    StepChannelServer,
    recv_frame,
    send_frame,
)
from workers.step_loop import StepLoop


class EchoLoop:
    """``StepLoop.submit``'s contract: decode the plan, return a future of the result's
    bytes; ``hold`` keeps the futures for the test to resolve."""

    def __init__(self, hold: bool = False):
        self.hold, self.futures, self.plans = hold, [], []

    def submit(self, plan_bytes: bytes) -> concurrent.futures.Future:
        plan = decode_plan(plan_bytes)
        self.plans.append(plan)
        fut = concurrent.futures.Future()
        if self.hold:
            self.futures.append((plan, fut))
        else:
            fut.set_result(encode(StepResult(step_id=plan.step_id, rank=0, error=f"rows={len(plan.rows)}")))
        return fut


def _server(loop, rank=0, result_rank=0) -> StepChannelServer:
    return StepChannelServer(loop, "127.0.0.1", rank, result_rank)


def _send(ch: StepChannel, plan: StepPlan) -> concurrent.futures.Future:
    return ch.send(encode(plan), plan.step_id)


def _until(cond, timeout=10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_frames_round_trip_whole_and_empty():
    a, b = socket.socketpair()
    with a, b:
        big = bytes(range(256)) * 8192  # 2 MiB: many recv calls
        for payload in (b"", b"x", big):
            t = threading.Thread(target=send_frame, args=(a, payload))
            t.start()
            assert recv_frame(b) == payload
            t.join()


def test_a_stream_cut_mid_frame_is_channel_closed():
    a, b = socket.socketpair()
    with b:
        a.sendall((100).to_bytes(4, "little") + b"only part")
        a.close()
        with pytest.raises(ChannelClosed):
            recv_frame(b)


def test_plans_and_results_in_order():
    loop = EchoLoop()
    srv = _server(loop)
    ch = StepChannel(*srv.address, srv.token, rank=0)
    try:
        futs = [_send(ch, StepPlan(step_id=i, prev_step_id=i - 1)) for i in range(1, 51)]
        results = [f.result(timeout=10) for f in futs]
        assert [r.step_id for r in results] == list(range(1, 51))
        assert [p.step_id for p in loop.plans] == list(range(1, 51))
    finally:
        ch.close()
        srv.close()


def test_results_resolve_only_when_the_worker_reports():
    loop = EchoLoop(hold=True)
    srv = _server(loop)
    ch = StepChannel(*srv.address, srv.token, rank=0)
    try:
        f1 = _send(ch, StepPlan(step_id=1))
        f2 = _send(ch, StepPlan(step_id=2, prev_step_id=1))
        deadline = time.monotonic() + 10
        while len(loop.futures) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not f1.done() and not f2.done()
        loop.futures[0][1].set_result(encode(StepResult(step_id=1, rank=0)))
        assert f1.result(timeout=10).step_id == 1
        assert not f2.done()
        loop.futures[1][1].set_result(encode(StepResult(step_id=2, rank=0)))
        assert f2.result(timeout=10).step_id == 2
    finally:
        ch.close()
        srv.close()


def test_a_wrong_token_is_refused_and_the_right_one_still_accepted():
    srv = _server(EchoLoop())
    try:
        with socket.create_connection(srv.address) as intruder:
            send_frame(intruder, b"\0" * len(srv.token))
            send_frame(intruder, encode(StepPlan(step_id=1)))
            intruder.settimeout(10)
            with pytest.raises((ChannelClosed, OSError)):
                recv_frame(intruder)  # dropped: no result ever comes back
        ch = StepChannel(*srv.address, srv.token, rank=0)
        assert _send(ch, StepPlan(step_id=7)).result(timeout=10).step_id == 7
        ch.close()
    finally:
        srv.close()


def test_other_ranks_send_only_the_step_id_and_error():
    srv = _server(EchoLoop(), rank=1, result_rank=0)
    ch = StepChannel(*srv.address, srv.token, rank=1)
    try:
        r = _send(ch, StepPlan(step_id=3)).result(timeout=10)
        assert (r.step_id, r.rank, r.error, r.outputs) == (3, 1, "rows=0", [])
    finally:
        ch.close()
        srv.close()


def test_an_undecodable_plan_comes_back_as_that_ranks_error():
    srv = _server(EchoLoop())
    ch = StepChannel(*srv.address, srv.token, rank=0)
    try:
        r = ch.send(b"\xc1 not msgpack", 1).result(timeout=10)
        assert r.step_id == -1 and r.error
    finally:
        ch.close()
        srv.close()


def test_the_worker_going_away_fails_waiting_and_later_steps():
    loop = EchoLoop(hold=True)
    srv = _server(loop)
    ch = StepChannel(*srv.address, srv.token, rank=0)
    fut = _send(ch, StepPlan(step_id=1))
    deadline = time.monotonic() + 10
    while not loop.futures and time.monotonic() < deadline:
        time.sleep(0.01)
    srv._conn.shutdown(socket.SHUT_RDWR)  # as the process's exit closes it
    srv.close()
    with pytest.raises(ChannelClosed):
        fut.result(timeout=10)
    deadline = time.monotonic() + 10
    while ch.closed is None and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(ChannelClosed):
        _send(ch, StepPlan(step_id=2))
    ch.close()


def test_results_decode_to_the_wire_types():
    """The client hands back ``StepResult`` structs (decoded on its reader thread)."""
    srv = _server(EchoLoop())
    ch = StepChannel(*srv.address, srv.token, rank=0)
    try:
        r = _send(ch, StepPlan(step_id=5)).result(timeout=10)
        assert isinstance(r, StepResult) and decode_result(encode(r)) == r
    finally:
        ch.close()
        srv.close()


# ------------------------------------------------------------------ result order


def test_a_step_finished_out_of_turn_waits_for_the_one_before_it():
    """The worker sends results in the plans' order, whatever order they finish in."""
    loop = EchoLoop(hold=True)
    srv = _server(loop)
    ch = StepChannel(*srv.address, srv.token, rank=0)
    try:
        f1 = _send(ch, StepPlan(step_id=1))
        f2 = _send(ch, StepPlan(step_id=2, prev_step_id=1))
        _until(lambda: len(loop.futures) == 2)
        loop.futures[1][1].set_result(encode(StepResult(step_id=2, rank=0, error="launch failed")))
        time.sleep(0.2)
        assert not f1.done() and not f2.done() and ch.closed is None
        loop.futures[0][1].set_result(encode(StepResult(step_id=1, rank=0)))
        r1, r2 = f1.result(timeout=10), f2.result(timeout=10)
        assert (r1.step_id, r1.error) == (1, None) and (r2.step_id, r2.error) == (2, "launch failed")
    finally:
        ch.close()
        srv.close()


class _Copy:
    """A launched step whose copy completes when the test says so."""

    def __init__(self, step_id: int, done: threading.Event):
        self.step_id, self.done = step_id, done

    def ready(self) -> bool:
        return self.done.is_set()


class _Runner:
    """``StepLoop``'s runner: step 2's launch fails (reported at once, while step 1 still
    waits for its copy)."""

    def __init__(self):
        self.copied = threading.Event()

    def launch(self, plan):
        if plan.step_id == 2:
            raise RuntimeError("launch of step 2 failed")
        return _Copy(plan.step_id, self.copied)

    def finish(self, pending):
        return StepResult(step_id=pending.step_id, rank=0)


class _SyncCheck:
    @contextlib.contextmanager
    def armed(self):
        yield


def test_the_real_step_loop_failed_launch_resolves_its_own_step():
    runner = _Runner()
    loop = StepLoop(runner, _SyncCheck(), 0)
    srv = _server(loop)
    ch = StepChannel(*srv.address, srv.token, rank=0)
    try:
        f1 = _send(ch, StepPlan(step_id=1))
        f2 = _send(ch, StepPlan(step_id=2, prev_step_id=1))
        time.sleep(0.3)  # step 2's error is ready; step 1 still waits for its copy
        assert not f1.done() and not f2.done()
        runner.copied.set()
        r1, r2 = f1.result(timeout=10), f2.result(timeout=10)
        assert (r1.step_id, r1.error) == (1, None)
        assert r2.step_id == 2 and "launch of step 2 failed" in r2.error
        assert ch.closed is None
    finally:
        ch.close()
        srv.close()
        loop.stop()


def test_an_undecodable_plan_keeps_its_place_in_the_order():
    loop = EchoLoop(hold=True)
    srv = _server(loop)
    ch = StepChannel(*srv.address, srv.token, rank=0)
    try:
        f1 = _send(ch, StepPlan(step_id=1))
        f2 = ch.send(b"\xc1 not msgpack", 2)
        _until(lambda: len(loop.futures) == 1)
        time.sleep(0.2)
        assert not f1.done() and not f2.done()  # the error waits behind step 1
        loop.futures[0][1].set_result(encode(StepResult(step_id=1, rank=0)))
        assert f1.result(timeout=10).step_id == 1
        r2 = f2.result(timeout=10)
        assert r2.step_id == -1 and r2.error
    finally:
        ch.close()
        srv.close()


def _fake_worker(script):
    """A listener standing in for a worker: reads the token and two plans, then ``script(conn)``
    writes whatever results it likes. Returns (address, token, thread)."""
    listener = socket.create_server(("127.0.0.1", 0))
    token = b"t" * TOKEN_BYTES

    def serve():
        conn, _ = listener.accept()
        listener.close()
        with conn:
            assert recv_frame(conn) == token
            recv_frame(conn), recv_frame(conn)
            script(conn)
            try:
                while recv_frame(conn) is not None:  # until the driver closes
                    pass
            except (ChannelClosed, OSError):
                pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return listener.getsockname()[:2], token, t


def test_a_result_for_another_step_is_a_protocol_error():
    """The driver pairs each result with the oldest plan waiting; a result that names another
    step ends the channel instead of resolving the wrong future."""
    addr, token, t = _fake_worker(lambda conn: send_frame(conn, encode(StepResult(step_id=2, rank=0))))
    ch = StepChannel(*addr, token, rank=0)
    try:
        f1, f2 = _send(ch, StepPlan(step_id=1)), _send(ch, StepPlan(step_id=2, prev_step_id=1))
        for f in (f1, f2):
            with pytest.raises(ChannelClosed, match="protocol error: result for step 2 where step 1 was expected"):
                f.result(timeout=10)
        assert "protocol error" in ch.closed
        with pytest.raises(ChannelClosed, match="protocol error"):
            _send(ch, StepPlan(step_id=3, prev_step_id=2))
        t.join(timeout=10)
        assert not t.is_alive()  # the driver shut the connection down: the worker sees it end
    finally:
        ch.close()


def test_an_error_of_an_undecodable_plan_resolves_the_waiting_step():
    def script(conn):
        send_frame(conn, encode(StepResult(step_id=-1, rank=0, error="DecodeError: bad")))
        send_frame(conn, encode(StepResult(step_id=2, rank=0)))

    addr, token, t = _fake_worker(script)
    ch = StepChannel(*addr, token, rank=0)
    try:
        f1, f2 = _send(ch, StepPlan(step_id=1)), _send(ch, StepPlan(step_id=2, prev_step_id=1))
        assert f1.result(timeout=10).error == "DecodeError: bad"
        assert f2.result(timeout=10).step_id == 2
        assert ch.closed is None
    finally:
        ch.close()
        t.join(timeout=10)


# ------------------------------------------------------------------ sending


def test_a_plan_too_large_is_refused_without_touching_the_channel(monkeypatch):
    loop = EchoLoop()
    srv = _server(loop)
    ch = StepChannel(*srv.address, srv.token, rank=0)
    try:
        monkeypatch.setattr(cluster.step_channel, "MAX_FRAME_BYTES", 1000)
        with pytest.raises(ValueError, match="exceeds"):
            ch.send(b"x" * 1001, 1)
        assert ch.closed is None and not ch._pending
        assert _send(ch, StepPlan(step_id=1)).result(timeout=10).step_id == 1  # nothing half-sent before it
        assert [p.step_id for p in loop.plans] == [1]
    finally:
        ch.close()
        srv.close()


class _BrokenSend:
    """A socket whose ``sendall`` writes part of the frame, then fails."""

    def __init__(self, sock: socket.socket):
        self.sock = sock

    def sendall(self, data: bytes) -> None:
        self.sock.sendall(data[:3])
        raise BrokenPipeError(32, "Broken pipe")

    def __getattr__(self, name):
        return getattr(self.sock, name)


def test_a_failed_send_ends_the_channel_and_fails_the_waiting_steps():
    loop = EchoLoop(hold=True)
    srv = _server(loop)
    ch = StepChannel(*srv.address, srv.token, rank=0)
    try:
        f1 = _send(ch, StepPlan(step_id=1))
        _until(lambda: len(loop.futures) == 1)
        ch._sock = _BrokenSend(ch._sock)
        with pytest.raises(ChannelClosed, match="sending a plan failed"):
            _send(ch, StepPlan(step_id=2, prev_step_id=1))
        with pytest.raises(ChannelClosed, match="sending a plan failed"):
            f1.result(timeout=5)  # half a frame went out: no later result could be trusted
        assert "BrokenPipeError" in ch.closed and not ch._pending
        with pytest.raises(ChannelClosed):
            _send(ch, StepPlan(step_id=3, prev_step_id=2))
        srv._thread.join(timeout=10)  # the socket was shut down: the worker's reader ends
        assert not srv._thread.is_alive()
    finally:
        ch.close()
        srv.close()


# ------------------------------------------------------------------ the worker's socket


def test_a_stray_client_is_dropped_without_reading_its_announced_length(monkeypatch):
    """``GET `` read as a length is ~517 MB: the handshake refuses any length but the token's
    before it reads (allocates) anything more."""
    asked = []
    real = workers.step_channel._recv_exact

    def spy(sock, n):
        asked.append(n)
        return real(sock, n)

    monkeypatch.setattr(workers.step_channel, "_recv_exact", spy)
    srv = _server(EchoLoop())
    try:
        t0 = time.monotonic()
        with socket.create_connection(srv.address) as stray:
            stray.sendall(b"GET / HTTP/1.1\r\nHost: worker\r\n\r\n")
            stray.settimeout(5)
            try:
                assert stray.recv(1) == b""  # closed by the worker
            except ConnectionResetError:  # (closed with our bytes unread)
                pass
        assert time.monotonic() - t0 < 2.0  # not the handshake's 10 s timeout
        assert asked == [4]  # the length only
        ch = StepChannel(*srv.address, srv.token, rank=0)
        assert _send(ch, StepPlan(step_id=7)).result(timeout=10).step_id == 7
        ch.close()
        assert max(asked) < 1 << 20
    finally:
        srv.close()


def test_close_wakes_the_threads_blocked_in_accept_and_recv():
    srv = _server(EchoLoop())
    time.sleep(0.1)  # (blocked in accept)
    srv.close()
    srv._thread.join(timeout=5)
    assert not srv._thread.is_alive()

    srv = _server(EchoLoop())
    ch = StepChannel(*srv.address, srv.token, rank=0)
    try:
        assert _send(ch, StepPlan(step_id=1)).result(timeout=10).step_id == 1  # (blocked in recv)
        srv.close()
        srv._thread.join(timeout=5)
        assert not srv._thread.is_alive()
        _until(lambda: ch.closed is not None)  # and the driver sees the connection end
    finally:
        ch.close()


@pytest.mark.skipif(not hasattr(socket, "TCP_USER_TIMEOUT"), reason="no TCP_USER_TIMEOUT here")
def test_unacknowledged_data_times_the_connection_out():
    """A vanished host closes nothing, and keepalive does not probe while sent data waits for
    its acknowledgement: the user timeout ends such a connection."""
    srv = _server(EchoLoop())
    ch = StepChannel(*srv.address, srv.token, rank=0)
    try:
        assert _send(ch, StepPlan(step_id=1)).result(timeout=10).step_id == 1
        for s in (ch._sock, srv._conn):
            assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == USER_TIMEOUT_MS == 30_000
            assert s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
    finally:
        ch.close()
        srv.close()
