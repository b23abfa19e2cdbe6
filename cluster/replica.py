"""One data-parallel replica: a Ray actor hosting an ``EngineCore`` (which starts the
replica's own TP x PP worker actors) and running its step loop in a thread.

The front end talks to it in msgspec bytes only (``cluster.replica_wire``): ``add`` a batch
of requests, ``abort`` ids, and ``poll`` — a long poll that returns every delta, finished
output and the load the step thread produced since the previous poll, as soon as there is
any. ``watch`` never returns: the front end's supervisor awaits it so that the actor's
death is noticed without traffic.

When a worker of the replica dies, its in-flight requests end with an ``error`` delta
(``EngineCore`` does that), ``ReplicaLoad.dead`` says why, and the step thread restarts the
workers by itself with exponential backoff; adds are refused (``unavailable``) meanwhile.
An idle replica pings its workers every ``PROBE_INTERVAL_S`` so that a death is noticed
without a request too.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any

import msgspec

from cluster.replica_wire import (
    AddResult,
    PollBatch,
    ReplicaLoad,
    ReplicaRequest,
    decode,
    encode,
)
from metadata.config import EngineConfig

logger = logging.getLogger(__name__)

PROBE_INTERVAL_S = 1.0
BACKOFF_INITIAL_S = 0.5
BACKOFF_MAX_S = 30.0


def replica_config(cfg: EngineConfig) -> EngineConfig:
    """The config one replica runs: the same engine, one replica of it."""
    parallel = msgspec.structs.replace(cfg.parallel, data_parallel_size=1)
    return msgspec.structs.replace(cfg, parallel=parallel)


class ReplicaActor:
    """Construct through ``ray.remote(ReplicaActor).options(max_concurrency=...)`` (threaded:
    ``poll``, ``add`` and ``watch`` block in threads of their own)."""

    def __init__(self, cfg_bytes: bytes, index: int, max_waiting_requests: int = 1024):
        from cluster.async_engine import take_queued_additions
        from cluster.engine import EngineCore

        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s replica {index}: %(message)s")
        self.index = index
        self.max_waiting_requests = max_waiting_requests
        cfg = decode(cfg_bytes, EngineConfig)
        self.core = EngineCore(replica_config(cfg))
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._held: list = []  # commands the intake hook met behind an addition: the loop's next
        self.core.intake = lambda: take_queued_additions(self._cmds, self._held, self._add_command)
        self._cond = threading.Condition()
        self._deltas: list = []
        self._finals: list = []
        self._load_changed = True  # the first poll returns the load at once
        self._prompt_tokens = 0
        self._num_restarts = 0
        self._load = self._snap()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"replica-{index}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------- remote API
    def describe(self) -> bytes:
        import ray

        core = self.core
        ctx = ray.get_runtime_context()
        return encode(
            {
                "replica": self.index,
                "pid": os.getpid(),
                "node_id": ctx.get_node_id(),
                "model_path": core.model_dir,
                "tokenizer_path": core.cfg.model.tokenizer or core.model_dir,
                "architecture": str(getattr(core.arch, "architecture", "")),
                "vocab_size": core.arch.vocab_size,
                "max_model_len": core.max_model_len,
                "block_size": core.cfg.cache.block_size,
                "num_kv_blocks": core.scheduler.blocks.num_blocks,
                "eos_token_ids": list(core.eos_token_ids),
                "tensor_parallel_size": core.cfg.parallel.tensor_parallel_size,
                "pipeline_parallel_size": core.cfg.parallel.pipeline_parallel_size,
                "device": core.device,
                "worker_pids": self.worker_pids(),
            }
        )

    def worker_pids(self) -> list[int]:
        return [int(i.get("pid", -1)) for i in getattr(self.core.executor, "info", None) or []]

    def add(self, data: bytes) -> bytes:
        """``data``: an encoded ``list[ReplicaRequest]``; returns an encoded ``list[AddResult]``."""
        reqs = decode(data, list[ReplicaRequest])
        done = threading.Event()
        box: list = []
        self._cmds.put(("add", reqs, box, done))
        done.wait()
        return encode(box)

    def abort(self, request_ids: list[str]) -> None:
        self._cmds.put(("abort", list(request_ids)))

    def poll(self, timeout_s: float = 5.0) -> bytes:
        """The deltas, finished outputs and load since the previous poll (an encoded
        ``PollBatch``); waits up to ``timeout_s`` for there to be any."""
        with self._cond:
            if not (self._deltas or self._finals or self._load_changed):
                self._cond.wait(timeout_s)
            batch = PollBatch(deltas=self._deltas, finals=self._finals, load=self._load)
            self._deltas, self._finals, self._load_changed = [], [], False
        return encode(batch)

    def watch(self) -> None:
        """Never returns while the actor lives (the front end's death watch)."""
        self._stopped.wait()

    def stop(self) -> None:
        """Abort what runs, stop the step loop, kill the workers."""
        self._cmds.put(("stop",))
        self._thread.join(60)
        try:
            self.core.shutdown()
        finally:
            self._stopped.set()

    # ------------------------------------------------------------ step thread
    def _snap(self) -> ReplicaLoad:
        core = self.core
        sch = core.scheduler
        return ReplicaLoad(
            time=time.monotonic(),
            running=len(sch.running),
            waiting=len(sch.waiting),
            kv_usage=float(sch.blocks.usage),
            num_free_blocks=sch.blocks.num_free,
            num_blocks=sch.blocks.num_blocks,
            num_preemptions=sch.num_preemptions,
            steps=core.stats.get("steps", 0),
            generation_tokens=core.stats.get("generation_tokens", 0),
            prompt_tokens=self._prompt_tokens,
            groups=len(core.groups),
            prefix_cache=dict(sch.prefix_cache_stats()),
            dead=core.dead,
            num_restarts=self._num_restarts,
        )

    def _post(self, deltas: list, finals: list) -> None:
        load = self._snap()
        with self._cond:
            self._deltas.extend(deltas)
            self._finals.extend(finals)
            self._load = load
            self._load_changed = True
            self._cond.notify_all()

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException:  # a bug: end the process, so the front end fails or moves its
            logger.exception("the step loop crashed")  # requests and starts a new replica
            os._exit(1)

    def _loop(self) -> None:
        core = self.core
        backoff = BACKOFF_INITIAL_S
        retry_at = 0.0
        next_probe = time.monotonic() + PROBE_INTERVAL_S
        while True:
            busy = core.has_unfinished() and not core.dead
            if busy:
                wait = None
            elif core.dead:
                wait = max(0.0, retry_at - time.monotonic())
            else:
                wait = max(0.0, next_probe - time.monotonic())
            cmds, self._held = self._held, []
            try:
                if cmds:
                    raise queue.Empty  # held commands first: then the ones that queued behind them
                cmds.append(self._cmds.get_nowait() if wait is None else self._cmds.get(timeout=wait))
                while True:
                    cmds.append(self._cmds.get_nowait())
            except queue.Empty:
                pass
            finals: list = []
            for cmd in cmds:
                if cmd[0] == "stop":
                    for rid in list(core.groups):
                        self._abort(rid, finals)
                    self._post([], finals)
                    return
                if cmd[0] == "add":
                    self._add_command(cmd)
                elif cmd[0] == "abort":
                    for rid in cmd[1]:
                        self._abort(rid, finals)
            if cmds:
                self._post([], finals)
            if core.dead:
                if time.monotonic() >= retry_at:
                    backoff, retry_at = self._recover(backoff)
                continue
            if not core.has_unfinished():
                if time.monotonic() >= next_probe:
                    self._probe_workers()
                    next_probe = time.monotonic() + PROBE_INTERVAL_S
                    if core.dead:
                        retry_at = time.monotonic()
                        self._post([], [])
                continue
            deltas = core.step()
            finals = []
            for d in deltas:
                if d.finish_reason:
                    group = core.groups.get(d.request_id)
                    if group is not None and all(r.finished for r in group):
                        out = core.output(d.request_id)
                        out.error = d.error
                        finals.append(out)
                        core.release(d.request_id)
            self._post(deltas, finals)
            if core.dead:
                retry_at = time.monotonic() + backoff
            next_probe = time.monotonic() + PROBE_INTERVAL_S

    def _add_command(self, cmd: tuple) -> None:
        self._add(cmd[1], cmd[2])
        cmd[3].set()

    def _recover(self, backoff: float) -> tuple[float, float]:
        """One restart attempt; returns (next backoff, when to retry if it failed)."""
        try:
            self.core.recover()
        except Exception as exc:  # noqa: BLE001 - retried with backoff
            self.core.dead = f"restarting the workers failed: {exc}"
            logger.error("%s; next attempt in %.1f s", self.core.dead, backoff)
            self._post([], [])
            return min(backoff * 2, BACKOFF_MAX_S), time.monotonic() + backoff
        self._num_restarts += 1
        logger.warning("workers restarted (restart %d)", self._num_restarts)
        self._post([], [])
        return BACKOFF_INITIAL_S, 0.0

    def _probe_workers(self) -> None:
        """Notice a worker that died while the replica was idle."""
        import ray

        from cluster.executor import death_cause

        workers = list(getattr(self.core.executor, "workers", []))
        refs = [w.ping.remote() for w in workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=10) if refs else ([], [])
        for rank, ref in enumerate(refs):
            if ref not in ready:
                continue
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                self.core.dead = f"worker rank {rank} died while the replica was idle: {death_cause(exc)}"
                logger.error("%s", self.core.dead)
                return

    def _add(self, reqs: list[ReplicaRequest], box: list) -> None:
        from cluster.input_processor import InvalidRequestError

        core = self.core
        for r in reqs:
            res = AddResult(request_id=r.request_id)
            try:
                if core.dead:
                    res.error, res.error_kind = f"replica {self.index} is restarting: {core.dead}", "unavailable"
                elif len(core.scheduler.waiting) >= self.max_waiting_requests:
                    res.error_kind = "overloaded"
                    res.error = (
                        f"the server is overloaded: {len(core.scheduler.waiting)} requests are "
                        f"waiting (max_waiting_requests={self.max_waiting_requests}); retry later"
                    )
                else:
                    core.add_request(r.request_id, r.engine_prompt(), r.params, r.strict_field)
                    first = core.groups[r.request_id][0]
                    self._prompt_tokens += len(first.prompt_token_ids)
                    res.prompt_token_ids, res.prompt = list(first.prompt_token_ids), first.prompt
            except InvalidRequestError as exc:
                res.error, res.error_kind, res.error_field = str(exc), "invalid", exc.field
            except Exception as exc:  # noqa: BLE001 - handed to the front end
                res.error, res.error_kind = f"{type(exc).__name__}: {exc}", "internal"
            box.append(res)

    def _abort(self, request_id: str, finals: list) -> None:
        core = self.core
        if core.abort(request_id):
            finals.append(core.output(request_id))
            core.release(request_id)


def replica_actor_options() -> dict[str, Any]:
    """Ray options of a replica actor: no CPU reserved (its workers hold the resources; a
    replica actor must not take a CPU a worker needs), spread over the nodes, never
    restarted by Ray (the front end's supervisor restarts it, with backoff)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return {
        "num_cpus": 0,
        "max_concurrency": 16,
        "max_restarts": 0,
        "scheduling_strategy": "SPREAD",
        "runtime_env": {"env_vars": {"PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}},
    }
