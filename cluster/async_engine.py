"""The asyncio front of the engine, shared by the HTTP and gRPC servers.

``EngineCore`` is not thread-safe, so exactly one background thread owns it: it
builds it, takes add/abort commands from a thread-safe queue, steps it while any
request is unfinished, and hands each step's ``StreamDelta``s to the event loop
with ``loop.call_soon_threadsafe``, where they land in per-request queues.
A stream that its consumer leaves early (client disconnect, cancellation)
aborts its request, which frees its KV blocks at once.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Any, AsyncIterator

from cluster.outputs import RequestOutput, StreamDelta
from cluster.request_stream import EngineUnavailable, Overloaded, RequestStream, StreamEnd
from metadata.config import EngineConfig
from metadata.sampling_params import SamplingParams, SamplingParamsError

logger = logging.getLogger(__name__)

# Health hooks of an idle engine thread: how often it pings the workers (a death is noticed
# without traffic), and the restart backoff after a failure (doubling up to the max).
PROBE_INTERVAL_S = 1.0
GRAMMAR_COMPILE_TIMEOUT_S = 10.0  # a constraint's compilation, before the request is refused
RESTART_BACKOFF_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0


def take_queued_additions(commands, held: list, add) -> None:
    """An ``EngineCore.intake`` body for a command loop: take the ``("add", ...)`` commands at
    the head of ``commands`` (a queue) and run ``add(cmd)`` on each, so requests that arrived
    during a step join the plan about to be sent. The first other command goes to ``held``,
    and it and everything queued behind it wait, in order, for the loop."""
    while not held:
        try:
            cmd = commands.get_nowait()
        except queue.Empty:
            return
        if cmd[0] == "add":
            add(cmd)
        else:
            held.append(cmd)


class AsyncEngine:
    def __init__(self, cfg: EngineConfig, *, max_waiting_requests: int = 1024, metrics=None):
        self.cfg = cfg
        self.max_waiting_requests = max_waiting_requests
        self.metrics = metrics
        self.core = None  # owned by the engine thread once started
        self.tokenizer = None  # the frontend's own tokenizer instance (HF tokenizers are not thread-safe)
        self.info: dict[str, Any] = {}
        self.snapshot: dict[str, Any] = {}
        self.dead: str | None = None
        self.accepting = True
        self.loop: asyncio.AbstractEventLoop | None = None
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._thread: threading.Thread | None = None
        self._state_listeners: list = []
        self._prompt_tokens = 0  # engine thread only
        self._held: list = []  # engine thread only: commands taken mid-step, for the loop
        self._next_probe = 0.0  # engine thread only: death watch and restart backoff
        self._restart_at = 0.0
        self._backoff = RESTART_BACKOFF_S

    # ------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Build the engine core in its thread; returns once the workers are ready."""
        self.loop = asyncio.get_running_loop()
        ready: asyncio.Future = self.loop.create_future()
        self._thread = threading.Thread(target=self._thread_main, args=(ready,), name="engine-core", daemon=True)
        self._thread.start()
        await ready
        from cluster.model_source import load_tokenizer

        self.tokenizer = load_tokenizer(self.info["tokenizer_path"], None)  # a directory or a .gguf file

    async def shutdown(self, grace_s: float = 10.0) -> None:
        """Stop accepting, let in-flight requests finish for ``grace_s``, abort the rest,
        then stop the engine thread (which kills the worker actors)."""
        self.accepting = False
        deadline = time.monotonic() + grace_s
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._streams:
            logger.info("aborting %d in-flight requests", len(self._streams))
            for rid in list(self._streams):
                self.abort(rid)
            deadline = time.monotonic() + 5
            while self._streams and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        if self._thread is not None and self._thread.is_alive():
            self._cmds.put(("stop",))
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 60)

    def on_state_change(self, callback) -> None:
        """``callback()`` runs in the event loop when the engine dies or stops accepting."""
        self._state_listeners.append(callback)

    @property
    def healthy(self) -> bool:
        return self.dead is None and self.accepting and self._thread is not None and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ------------------------------------------------------------------ API
    async def add_request(
        self, request_id: str, prompt: Any, params: SamplingParams | None, strict_field: str | None = None
    ) -> RequestStream:
        """Validate and enqueue; raises InvalidRequestError, Overloaded or EngineUnavailable.
        ``strict_field``: the API field that set ``max_tokens``; past the context it is refused
        rather than cut (``InputProcessor.make_requests``)."""
        # After a failure (self.dead) the next request makes the engine restart its workers.
        if self._thread is None or not self._thread.is_alive():
            raise EngineUnavailable(f"the engine is not running{': ' + self.dead if self.dead else ''}")
        if not self.accepting:
            raise EngineUnavailable("the server is shutting down")
        if request_id in self._streams:
            from cluster.input_processor import InvalidRequestError

            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        if params is not None and params.structured_outputs is not None:
            await self._precompile(params)  # (off the engine thread: it then finds it cached)
        stream = RequestStream(self, request_id)
        self._streams[request_id] = stream
        fut = self.loop.create_future()
        self._cmds.put(("add", request_id, prompt, params, strict_field, fut))
        try:
            stream.prompt_token_ids, stream.prompt = await asyncio.shield(fut)
        except asyncio.CancelledError:
            # The caller left while the engine thread validates: once it has decided, abort
            # the request (added) or forget its stream (refused), so nothing is left behind.
            def settle(f: asyncio.Future) -> None:
                if f.cancelled() or f.exception() is not None:
                    if self._streams.get(request_id) is stream:
                        del self._streams[request_id]
                else:
                    self.abort(request_id)

            fut.add_done_callback(settle)
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return stream

    async def _precompile(self, params: SamplingParams) -> None:
        """Compile a request's constraint in a worker thread, bounded in time, so the engine
        thread never stalls on it (its own compile is then a cache hit); errors are 400s."""
        from cluster.input_processor import InvalidRequestError
        from cluster.structured_output import GrammarError

        core = self.core
        if core is None:
            return  # (the engine thread compiles it then)
        try:
            params.structured_outputs.validate()
            grammars = core.inputs.grammars
            await asyncio.wait_for(
                self.loop.run_in_executor(None, grammars.compile, params.structured_outputs), GRAMMAR_COMPILE_TIMEOUT_S
            )
        except (GrammarError, SamplingParamsError) as exc:
            raise InvalidRequestError(str(exc), "structured_outputs") from None
        except asyncio.TimeoutError:
            raise InvalidRequestError(
                f"structured_outputs took longer than {GRAMMAR_COMPILE_TIMEOUT_S:g} s to compile", "structured_outputs"
            ) from None

    async def generate(
        self, request_id: str, prompt: Any, params: SamplingParams | None = None
    ) -> AsyncIterator[StreamDelta]:
        """Yields the request's deltas; leaving early (cancellation, GeneratorExit) aborts it."""
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for delta in stream:
                yield delta
        finally:
            stream.close()

    def abort(self, request_id: str) -> bool:
        """Abort an in-flight request; False if it is unknown or already finished."""
        stream = self._streams.get(request_id)
        if stream is None or stream.finished:
            return False
        self._cmds.put(("abort", request_id))
        return True

    async def debug_state(self) -> dict[str, Any]:
        """A fresh snapshot taken by the engine thread (KV blocks, queues)."""
        if self._thread is None or not self._thread.is_alive():
            return dict(self.snapshot, in_flight=len(self._streams))
        fut = self.loop.create_future()
        self._cmds.put(("state", fut))
        snap = await asyncio.wait_for(fut, 30)
        return dict(snap, in_flight=len(self._streams))

    # ------------------------------------------------- event-loop side of hand-off
    def _resolve(self, fut: asyncio.Future, result, exc) -> None:
        if fut.done():
            return
        if exc is not None:
            if isinstance(exc, StopIteration) or not isinstance(exc, Exception):  # (a future refuses these)
                exc = RuntimeError(f"{type(exc).__name__}: {exc}")
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    def _dispatch(
        self,
        deltas: list[StreamDelta],
        finals: list[tuple[str, RequestOutput | None, str | None]],
        snap: dict[str, Any],
        dead: str | None,
    ) -> None:
        now = time.monotonic()
        self.snapshot = snap
        m = self.metrics
        for d in deltas:
            s = self._streams.get(d.request_id)
            if s is None:
                continue
            if d.token_ids and m is not None:
                last = s.last_token_time.get(d.index)
                if last is None:
                    m.observe_ttft(now - s.arrival)
                else:
                    m.observe_itl((now - last) / len(d.token_ids))
            if d.token_ids:
                s.last_token_time[d.index] = now
            s.queue.put_nowait(d)
        for rid, out, err in finals:
            s = self._streams.pop(rid, None)
            if s is None:
                continue
            if m is not None and out is not None:
                m.observe_finished(out, now - s.arrival)
            s.queue.put_nowait(StreamEnd(out, err))
        if m is not None:
            m.update_engine(snap)
        if dead and not self.dead:
            self.dead = dead
            for rid, s in list(self._streams.items()):  # whatever the engine did not report
                self._streams.pop(rid)
                s.queue.put_nowait(StreamEnd(None, dead))
            self._notify()
        elif self.dead and not dead:  # the workers were restarted
            self.dead = None
            self._notify()

    def _notify(self) -> None:
        for cb in self._state_listeners:
            try:
                cb()
            except Exception:
                logger.exception("state listener failed")

    def stop_accepting(self) -> None:
        self.accepting = False
        self._notify()

    # ------------------------------------------------------------ engine thread
    def _thread_main(self, ready: asyncio.Future) -> None:
        loop = self.loop
        try:
            from cluster.engine import EngineCore

            core = EngineCore(self.cfg)
            self.core = core
            self.info = self._static_info(core)
            self.snapshot = self._snap(core)
        except BaseException as exc:  # noqa: BLE001 - reported to start()
            loop.call_soon_threadsafe(self._resolve, ready, None, exc)
            return
        loop.call_soon_threadsafe(self._resolve, ready, None, None)
        try:
            self._loop(core)
        except BaseException as exc:  # noqa: BLE001 - a bug; fail the streams, not the process
            logger.exception("engine thread crashed")
            msg = f"engine thread crashed: {type(exc).__name__}: {exc}"
            core.dead = core.dead or msg
            self._post([], [], core)
        finally:
            try:
                core.shutdown()
            except Exception:
                logger.exception("engine shutdown failed")

    def _static_info(self, core) -> dict[str, Any]:
        import ray

        pids = []
        try:
            pids = [p["pid"] for p in ray.get([w.ping.remote() for w in core.executor.workers], timeout=30)]
        except Exception:
            pass
        cfg = core.cfg
        return {
            "model_path": core.model_dir,
            "tokenizer_path": cfg.model.tokenizer or core.model_dir,
            "architecture": str(getattr(core.arch, "architecture", "")),
            "vocab_size": core.arch.vocab_size,
            "max_model_len": core.max_model_len,
            "block_size": cfg.cache.block_size,
            "num_kv_blocks": core.scheduler.blocks.num_blocks,
            "eos_token_ids": list(core.eos_token_ids),
            "tensor_parallel_size": cfg.parallel.tensor_parallel_size,
            "device": core.device,
            "worker_pids": pids,
        }

    def _snap(self, core) -> dict[str, Any]:
        sch = core.scheduler
        return {
            "time": time.monotonic(),
            "running": len(sch.running),
            "waiting": len(sch.waiting),
            "kv_usage": sch.blocks.usage,
            "num_free_blocks": sch.blocks.num_free,
            "num_blocks": sch.blocks.num_blocks,
            "num_preemptions": sch.num_preemptions,
            "steps": core.stats.get("steps", 0),
            "generation_tokens": core.stats.get("generation_tokens", 0),
            "prompt_tokens": self._prompt_tokens,
            "groups": len(core.groups),
            "prefix_cache": sch.prefix_cache_stats(),
            "dead": core.dead,
        }

    def _post(self, deltas, finals, core) -> None:
        try:
            self.loop.call_soon_threadsafe(self._dispatch, deltas, finals, self._snap(core), core.dead)
        except RuntimeError:  # the loop is closed (process exiting)
            pass

    def _loop(self, core) -> None:
        idle_wait = None
        core.intake = lambda: self._intake(core)
        while True:
            busy = core.has_unfinished() and not core.dead
            cmds, self._held = self._held, []
            try:
                if (busy and idle_wait is None) or cmds:
                    while True:
                        cmds.append(self._cmds.get_nowait())
                else:
                    cmds.append(self._cmds.get(timeout=idle_wait if busy else self._watch_wait(core)))
                    while True:
                        cmds.append(self._cmds.get_nowait())
            except queue.Empty:
                pass
            if not busy and (not cmds or core.dead):  # probe only when truly idle; restart before adds
                self._watch(core)
            finals: list = []
            for cmd in cmds:
                if cmd[0] == "stop":
                    for rid in list(core.groups):
                        self._abort(core, rid, finals)
                    self._post([], finals, core)
                    return
                if cmd[0] == "add":
                    self._add(core, *cmd[1:])
                elif cmd[0] == "abort":
                    self._abort(core, cmd[1], finals)
                elif cmd[0] == "state":
                    snap = self._snap(core)
                    snap["worker_pids"] = [
                        i.get("pid") for i in getattr(core.executor, "info", None) or []
                    ] or self.info.get("worker_pids", [])
                    self.loop.call_soon_threadsafe(self._resolve, cmd[1], snap, None)
            if finals:
                self._post([], finals, core)
            idle_wait = None
            if not core.has_unfinished() or core.dead:
                continue
            deltas = core.step()
            finals = []
            for d in deltas:
                if d.finish_reason:
                    group = core.groups.get(d.request_id)
                    if group is not None and all(r.finished for r in group):
                        finals.append((d.request_id, core.output(d.request_id), d.error))
                        core.release(d.request_id)
            self._post(deltas, finals, core)
            if not deltas and not core.in_flight and core.has_unfinished():
                idle_wait = 0.01  # nothing schedulable right now: do not spin

    def _intake(self, core) -> None:
        """``core.intake``: the additions queued during a step join the plan about to be sent."""
        take_queued_additions(self._cmds, self._held, lambda cmd: self._add(core, *cmd[1:]))

    # -------------------------------------------- engine thread: health hooks
    def _watch_wait(self, core) -> float:
        """How long the idle loop may wait for a command before its next health hook."""
        due = self._restart_at if core.dead else self._next_probe
        return min(max(due - time.monotonic(), 0.001), PROBE_INTERVAL_S)

    def _watch(self, core) -> None:
        """While idle: notice dead workers without traffic, and restart them with backoff."""
        now = time.monotonic()
        if core.dead:
            if now < self._restart_at or core.has_unfinished():
                return
            try:
                core.recover()
            except Exception as exc:  # noqa: BLE001 - retried after the backoff
                logger.error("restarting the workers failed (next try in %.0f s): %s", self._backoff, exc)
                self._restart_at = time.monotonic() + self._backoff
                self._backoff = min(self._backoff * 2, RESTART_BACKOFF_MAX_S)
            else:
                logger.info("workers restarted; serving again")
                self._backoff = RESTART_BACKOFF_S
                self._next_probe = time.monotonic() + PROBE_INTERVAL_S
            self._post([], [], core)
        elif now >= self._next_probe:
            self._next_probe = now + PROBE_INTERVAL_S
            probe = getattr(core.executor, "probe", None)
            died = probe() if probe is not None else None
            if died:
                logger.error("engine failed while idle: %s", died)
                core.dead = died
                self._restart_at = time.monotonic()
                self._post([], [], core)

    def _add(self, core, request_id, prompt, params, strict_field, fut) -> None:
        try:
            if core.dead:  # a restart is due (the loop's health hook) and failed so far
                raise EngineUnavailable(f"the engine is restarting its workers after: {core.dead}; retry later")
            if len(core.scheduler.waiting) >= self.max_waiting_requests:
                raise Overloaded(
                    f"the server is overloaded: {len(core.scheduler.waiting)} requests are waiting "
                    f"(max_waiting_requests={self.max_waiting_requests}); retry later"
                )
            try:
                core.add_request(request_id, prompt, params, strict_field)
            except Exception as exc:
                from cluster.executor import EngineDeadError

                if isinstance(exc, EngineDeadError):
                    raise EngineUnavailable(f"the engine failed: {exc}") from None
                raise
            first = core.groups[request_id][0]
            self._prompt_tokens += len(first.prompt_token_ids)
            result = (list(first.prompt_token_ids), first.prompt)
            exc = None
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            result, exc = None, e
        self.loop.call_soon_threadsafe(self._resolve, fut, result, exc)

    def _abort(self, core, request_id: str, finals: list) -> None:
        if core.abort(request_id):
            finals.append((request_id, core.output(request_id), None))
            core.release(request_id)
