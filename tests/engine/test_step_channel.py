"""The step channel between the driver and a worker (``workers.step_channel``,
``cluster.step_channel``): framing, the token, result order, and what each side sees when
the other goes away. The worker side is driven by a stand-in step loop here (its
``submit`` is the whole interface); the engine tests run it with the real one."""

from __future__ import annotations

import concurrent.futures
import socket
import threading
import time

import pytest

from cluster.step_channel import StepChannel
from metadata.wire import StepPlan, StepResult, decode_plan, decode_result, encode
from workers.step_channel import ChannelClosed, StepChannelServer, recv_frame, send_frame


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
        futs = [ch.send(encode(StepPlan(step_id=i, prev_step_id=i - 1))) for i in range(1, 51)]
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
        f1 = ch.send(encode(StepPlan(step_id=1)))
        f2 = ch.send(encode(StepPlan(step_id=2, prev_step_id=1)))
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
        assert ch.send(encode(StepPlan(step_id=7))).result(timeout=10).step_id == 7
        ch.close()
    finally:
        srv.close()


def test_other_ranks_send_only_the_step_id_and_error():
    srv = _server(EchoLoop(), rank=1, result_rank=0)
    ch = StepChannel(*srv.address, srv.token, rank=1)
    try:
        r = ch.send(encode(StepPlan(step_id=3))).result(timeout=10)
        assert (r.step_id, r.rank, r.error, r.outputs) == (3, 1, "rows=0", [])
    finally:
        ch.close()
        srv.close()


def test_an_undecodable_plan_comes_back_as_that_ranks_error():
    srv = _server(EchoLoop())
    ch = StepChannel(*srv.address, srv.token, rank=0)
    try:
        r = ch.send(b"\xc1 not msgpack").result(timeout=10)
        assert r.step_id == -1 and r.error
    finally:
        ch.close()
        srv.close()


def test_the_worker_going_away_fails_waiting_and_later_steps():
    loop = EchoLoop(hold=True)
    srv = _server(loop)
    ch = StepChannel(*srv.address, srv.token, rank=0)
    fut = ch.send(encode(StepPlan(step_id=1)))
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
        ch.send(encode(StepPlan(step_id=2)))
    ch.close()


def test_results_decode_to_the_wire_types():
    """The client hands back ``StepResult`` structs (decoded on its reader thread)."""
    srv = _server(EchoLoop())
    ch = StepChannel(*srv.address, srv.token, rank=0)
    try:
        r = ch.send(encode(StepPlan(step_id=5))).result(timeout=10)
        assert isinstance(r, StepResult) and decode_result(encode(r)) == r
    finally:
        ch.close()
        srv.close()
