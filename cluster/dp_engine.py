"""The data-parallel front end: the asyncio engine interface of ``cluster.async_engine``
(what the HTTP and gRPC servers use) over D replica actors (``cluster.replica``).

Each request is routed by ``PrefixLoadRouter`` (prefix-cache affinity, then load) and sent
to its replica as msgspec bytes. One supervisor task per replica keeps a long poll open on
it and dispatches the deltas that come back to the per-request streams; because a poll is
always pending, the replica actor's death raises at once (``RayActorError``), traffic or
not. Then the replica's requests that streamed nothing yet move to another replica, the
others end with an error naming the replica, and the supervisor starts a new actor with
exponential backoff. A replica whose *worker* died restarts its workers by itself (it
reports ``dead`` while it does); the front end routes around it meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from cluster.request_stream import EngineUnavailable
from cluster.dp_policy import PrefixLoadRouter
from cluster.outputs import StreamDelta
from cluster.replica_client import (
    actor_error,
    add_error,
    front_end_tokenizer,
    start_replica_actor,
    startup_timeout_s,
    wire_request,
)
from cluster.request_stream import StreamEnd
from cluster.replica_stream import ReplicaStream
from cluster.replica_wire import (
    AddResult,
    PollBatch,
    ReplicaLoad,
    ReplicaRequest,
    aggregate_loads,
    decode,
    encode,
)
from metadata.config import EngineConfig
from metadata.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

POLL_TIMEOUT_S = 5.0
RESTART_BACKOFF_S = (1.0, 30.0)  # first delay, cap


@dataclass
class _Replica:
    index: int
    actor: Any = None
    info: dict[str, Any] = field(default_factory=dict)
    load: ReplicaLoad = field(default_factory=ReplicaLoad)
    up: bool = False
    down_reason: str | None = "starting"
    actor_restarts: int = 0
    streams: dict[str, ReplicaStream] = field(default_factory=dict)
    pending_adds: list = field(default_factory=list)  # (ReplicaRequest, future) of the next add call
    task: asyncio.Task | None = None


class DataParallelEngine:
    def __init__(self, cfg: EngineConfig, *, max_waiting_requests: int = 1024, metrics=None):
        self.cfg = cfg
        self.size = cfg.parallel.data_parallel_size
        self.max_waiting_requests = max_waiting_requests
        self.metrics = metrics
        self.tokenizer = None
        self.info: dict[str, Any] = {}
        self.snapshot: dict[str, Any] = {}
        self.accepting = True
        self.loop: asyncio.AbstractEventLoop | None = None
        self.router = PrefixLoadRouter(
            self.size, cfg.cache.block_size, cfg.cache.prefix_cache_hash, enabled=cfg.cache.enable_prefix_caching
        )
        self.replicas = [_Replica(i) for i in range(self.size)]
        self._streams: dict[str, ReplicaStream] = {}
        self._listeners: list = []
        self._closing = False

    # ------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Start every replica (in parallel); returns once all serve. A replica that fails to
        start fails the start, naming it."""
        self.loop = asyncio.get_running_loop()
        results = await asyncio.gather(*(self._start_replica(r) for r in self.replicas), return_exceptions=True)
        for r, res in zip(self.replicas, results):
            if isinstance(res, BaseException):
                await self._kill_all()
                raise EngineUnavailable(f"data-parallel replica {r.index} failed to start: {res}")
        first = self.replicas[0].info
        self.tokenizer = front_end_tokenizer(self.cfg, first["model_path"])
        self.info = dict(
            first,
            data_parallel_size=self.size,
            worker_pids=[p for r in self.replicas for p in r.info.get("worker_pids", [])],
        )
        for r in self.replicas:
            r.task = asyncio.ensure_future(self._supervise(r))
        self._refresh_snapshot()

    async def _start_replica(self, r: _Replica) -> None:
        import ray

        actor = start_replica_actor(self.cfg, r.index, self.max_waiting_requests)
        try:
            info = await asyncio.wait_for(actor.describe.remote(), startup_timeout_s(self.cfg))
        except asyncio.TimeoutError:
            ray.kill(actor, no_restart=True)
            raise RuntimeError(f"replica {r.index} did not start within {startup_timeout_s(self.cfg):.0f} s") from None
        except ray.exceptions.RayError as exc:
            ray.kill(actor, no_restart=True)
            raise RuntimeError(actor_error(exc)) from None
        r.actor, r.info = actor, decode(info, dict)
        r.up, r.down_reason, r.load = True, None, ReplicaLoad(num_blocks=r.info.get("num_kv_blocks", 0))
        self.router.forget(r.index)
        self.router.set_capacity(r.index, int(r.info.get("num_kv_blocks", 1 << 16)))
        logger.info("replica %d serving: pid %s, workers %s", r.index, r.info.get("pid"), r.info.get("worker_pids"))

    async def _supervise(self, r: _Replica) -> None:
        """Pump the replica's outputs; on its death, fail or move its requests and restart it."""
        import ray

        backoff = RESTART_BACKOFF_S[0]
        while not self._closing:
            if r.actor is None:
                try:
                    await self._start_replica(r)
                    backoff = RESTART_BACKOFF_S[0]
                    r.actor_restarts += 1
                    self._notify()
                except Exception as exc:  # noqa: BLE001 - retried with backoff
                    r.down_reason = f"restart failed: {exc}"
                    logger.error("replica %d: %s; next attempt in %.0f s", r.index, r.down_reason, backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, RESTART_BACKOFF_S[1])
                    continue
            try:
                while not self._closing:
                    data = await r.actor.poll.remote(POLL_TIMEOUT_S)
                    self._on_batch(r, decode(data, PollBatch))
            except ray.exceptions.RayActorError as exc:
                if self._closing:
                    return
                self._replica_died(r, f"replica {r.index} died: {actor_error(exc)}")
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, RESTART_BACKOFF_S[1])
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.exception("replica %d: output pump failed", r.index)
                if self._closing:
                    return
                ray.kill(r.actor, no_restart=True)
                self._replica_died(r, f"replica {r.index} failed: {type(exc).__name__}: {exc}")

    def _replica_died(self, r: _Replica, reason: str) -> None:
        logger.error("%s; restarting it", reason)
        r.actor, r.up, r.down_reason = None, False, reason
        self.router.forget(r.index)
        streams, r.streams = list(r.streams.values()), {}
        for s in streams:
            if s.sending:
                continue  # its add fails with the actor; _send moves it
            if not s.streamed:
                s.failed_on = reason
                self._move(s)
            else:
                self._finish(s, StreamEnd(None, reason))
        self._refresh_snapshot()
        self._notify()

    async def shutdown(self, grace_s: float = 10.0) -> None:
        """Stop accepting, let in-flight requests finish for ``grace_s``, abort the rest,
        then stop the replicas (which stop their workers)."""
        self.accepting = False
        deadline = time.monotonic() + grace_s
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for rid in list(self._streams):
            self.abort(rid)
        deadline = time.monotonic() + 5
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self._closing = True
        stops = [r.actor.stop.remote() for r in self.replicas if r.actor is not None]
        if stops:
            await asyncio.wait([asyncio.ensure_future(_await(s)) for s in stops], timeout=60)
        for r in self.replicas:
            if r.task is not None:
                r.task.cancel()
        await self._kill_all()

    async def _kill_all(self) -> None:
        import ray

        for r in self.replicas:
            if r.actor is not None:
                with contextlib.suppress(ray.exceptions.RayError, ValueError):  # already gone
                    ray.kill(r.actor, no_restart=True)
                r.actor, r.up = None, False

    def on_state_change(self, callback) -> None:
        self._listeners.append(callback)

    def _notify(self) -> None:
        for cb in self._listeners:
            try:
                cb()
            except Exception:
                logger.exception("state listener failed")

    def stop_accepting(self) -> None:
        self.accepting = False
        self._notify()

    @property
    def dead(self) -> str | None:
        """None while at least one replica serves; else why none does."""
        if any(r.up for r in self.replicas):
            return None
        return "no data-parallel replica is serving: " + "; ".join(
            f"replica {r.index}: {r.down_reason}" for r in self.replicas
        )

    @property
    def healthy(self) -> bool:
        return self.accepting and not self._closing and any(r.up for r in self.replicas)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def replica_states(self) -> list[dict[str, Any]]:
        """Per replica: index, up, why it is down, restarts and its last load (``/metrics``)."""
        return [
            {
                "replica": r.index,
                "up": r.up,
                "down_reason": r.down_reason,
                "actor_restarts": r.actor_restarts,
                "worker_restarts": r.load.num_restarts,
                "in_flight": len(r.streams),
                "load": msgspec.to_builtins(r.load),
            }
            for r in self.replicas
        ]

    # ------------------------------------------------------------------ API
    async def add_request(
        self, request_id: str, prompt: Any, params: SamplingParams | None, strict_field: str | None = None
    ) -> ReplicaStream:
        """Validate and route; raises InvalidRequestError, Overloaded or EngineUnavailable."""
        if not self.accepting or self._closing:
            raise EngineUnavailable("the server is shutting down")
        if self.dead:
            raise EngineUnavailable(self.dead)
        if request_id in self._streams:
            from cluster.input_processor import InvalidRequestError

            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        wire, hashes = wire_request(self.tokenizer, self.router, request_id, prompt, params, strict_field)
        stream = ReplicaStream(self, request_id, wire, hashes)
        self._streams[request_id] = stream
        try:
            res = await self._send(stream, exclude=())
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        stream.prompt_token_ids, stream.prompt = res.prompt_token_ids, res.prompt
        return stream

    async def _send(self, s: ReplicaStream, exclude: tuple[int, ...]) -> AddResult:
        """Route ``s`` to a serving replica not in ``exclude`` and add it there; a replica that
        turns out to be down is skipped. Raises the replica's refusal."""
        import ray

        tried = set(exclude)
        while True:
            alive = [r.index for r in self.replicas if r.up and r.actor is not None and r.index not in tried]
            if not alive:
                raise EngineUnavailable(self.dead or s.failed_on or "no data-parallel replica can take the request")
            choice = self.router.choose(s.hashes, alive)
            r = self.replicas[choice.replica]
            self.router.assign(r.index, s.hashes)
            s.replica = r.index
            r.streams[s.request_id] = s
            s.sending = True
            try:
                res = await self._add_batched(r, s.wire)
            except ray.exceptions.RayActorError:
                res = AddResult(request_id=s.request_id, error="replica died", error_kind="unavailable")
            except asyncio.CancelledError:
                self.abort(s.request_id)
                raise
            finally:
                s.sending = False
            if res.error is None:
                return res
            if r.streams.get(s.request_id) is s:
                del r.streams[s.request_id]
                self.router.done(r.index)
            if res.error_kind != "unavailable":
                raise add_error(res)
            tried.add(r.index)

    def _add_batched(self, r: _Replica, wire: ReplicaRequest) -> asyncio.Future:
        """Adds issued in the same event-loop turn go to the replica in one call."""
        fut = self.loop.create_future()
        r.pending_adds.append((wire, fut))
        if len(r.pending_adds) == 1:
            asyncio.ensure_future(self._flush_adds(r, r.actor))
        return fut

    async def _flush_adds(self, r: _Replica, actor) -> None:
        await asyncio.sleep(0)  # let this turn's other adds join the batch
        batch, r.pending_adds = r.pending_adds, []
        try:
            results = decode(await actor.add.remote(encode([w for w, _ in batch])), list[AddResult])
        except Exception as exc:  # noqa: BLE001 - each waiting add raises it (RayActorError: moved)
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(exc)
            return
        for (_, fut), res in zip(batch, results):
            if not fut.done():
                fut.set_result(res)

    def _move(self, s: ReplicaStream) -> None:
        """Re-send a request its replica failed before it streamed anything (once)."""
        failed = s.replica
        if s.moves >= 1 or self._closing:
            self._finish(s, StreamEnd(None, s.failed_on))
            return
        s.moves += 1
        logger.warning("moving request %s off replica %d: %s", s.request_id, failed, s.failed_on)

        async def resend() -> None:
            try:
                await self._send(s, exclude=(failed,))
            except Exception as exc:  # noqa: BLE001 - ends the stream with the reason
                self._finish(s, StreamEnd(None, f"{s.failed_on}; moving the request failed: {exc}"))

        asyncio.ensure_future(resend())

    def generate(
        self, request_id: str, prompt: Any, params: SamplingParams | None = None
    ) -> AsyncIterator[StreamDelta]:
        async def gen():
            stream = await self.add_request(request_id, prompt, params)
            try:
                async for delta in stream:
                    yield delta
            finally:
                stream.close()

        return gen()

    def abort(self, request_id: str) -> bool:
        s = self._streams.get(request_id)
        if s is None or s.finished or s.replica < 0:
            return False
        r = self.replicas[s.replica]
        if r.actor is not None:
            r.actor.abort.remote([request_id])
        return True

    async def debug_state(self) -> dict[str, Any]:
        self._refresh_snapshot()
        return dict(self.snapshot, in_flight=len(self._streams), replicas=self.replica_states())

    # ------------------------------------------------------------ dispatch
    def _finish(self, s: ReplicaStream, final: StreamEnd) -> None:
        if self._streams.get(s.request_id) is s:
            del self._streams[s.request_id]
        s.queue.put_nowait(final)

    def _on_batch(self, r: _Replica, batch: PollBatch) -> None:
        now = time.monotonic()
        m = self.metrics
        load = batch.load
        was_up = r.up
        restarted = load.num_restarts != r.load.num_restarts
        r.load = load
        self.router.report(r.index, load.running, load.waiting, load.kv_usage)
        if load.dead:
            r.up, r.down_reason = False, load.dead
        elif not r.up:
            r.up, r.down_reason = True, None
        if restarted:
            self.router.forget(r.index)
            self.router.report(r.index, load.running, load.waiting, load.kv_usage)
        for d in batch.deltas:
            s = r.streams.get(d.request_id)
            if s is None:
                continue
            if d.finish_reason == "error" and not s.streamed:
                s.failed_on = f"replica {r.index} failed: {d.error}"
                continue  # held back: the request moves when its final output arrives
            if d.finish_reason == "error":
                d.error = f"replica {r.index}: {d.error}"
            if d.token_ids:
                s.streamed = True
                if m is not None:
                    last = s.last_token_time.get(d.index)
                    if last is None:
                        m.observe_ttft(now - s.arrival)
                    else:
                        m.observe_itl((now - last) / len(d.token_ids))
                s.last_token_time[d.index] = now
            s.queue.put_nowait(d)
        for out in batch.finals:
            s = r.streams.pop(out.request_id, None)
            if s is None:
                continue
            self.router.done(r.index)
            if s.failed_on is not None and not s.streamed:
                self._move(s)
                continue
            if m is not None:
                m.observe_finished(out, now - s.arrival)
            self._finish(s, StreamEnd(out, f"replica {r.index}: {out.error}" if out.error else None))
        self._refresh_snapshot()
        if was_up != r.up:
            self._notify()

    def _refresh_snapshot(self) -> None:
        snap = aggregate_loads([r.load for r in self.replicas])
        snap["dead"] = self.dead
        snap["replicas_up"] = sum(r.up for r in self.replicas)
        self.snapshot = snap
        if self.metrics is not None:
            self.metrics.update_engine(snap)


async def _await(ref) -> None:
    import ray

    with contextlib.suppress(ray.exceptions.RayError):  # a replica that is already gone
        await ref
