"""Starts the worker actors in placement groups and ships them step plans.

One actor per rank of the TP x PP layout (placement/). Ray places, starts, watches and
stops them; the steps themselves travel over one TCP step channel per worker
(``cluster.step_channel``), not as Ray calls, whose per-call Python cost the driver and,
in another thread of the worker process, the launching step thread (``workers.step_channel``).
Every rank of every pipeline stage receives the same plan bytes; one result comes back per
step, the last stage's first rank's (it sampled the tokens; rank 0 without pipeline
stages). ``collect`` waits on all ranks at once, so a rank that dies while its peers are
blocked in a collective is noticed immediately (its connection closes): the step fails
with ``EngineDeadError`` naming the rank, where it ran and why it died (asked of Ray, all
such ranks at once). A rank whose host vanished closes no connection; ``collect`` waits in
slices and, while a slice ends with ranks still busy, asks Ray whether they live.
``restart()`` tears the workers down and starts fresh ones.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import re
import time

import msgspec
import ray

from metadata.config import EngineConfig
from metadata.wire import StepPlan, StepResult, encode
from placement.placement_groups import Layout, Placement, place_workers
from placement.platforms import actor_env_vars
from workers.step_channel import ChannelClosed

logger = logging.getLogger(__name__)

# After one rank fails, how long to wait for the others before reporting: a peer
# that died is the root cause of the survivors' collective errors, so prefer it.
_FAILURE_GRACE_S = 2.0
# A step's results are awaited in slices of this long; a slice that ends with ranks still
# busy pings them through Ray (a vanished host closes no connection: TCP may take long to tell).
_LIVENESS_SLICE_S = 5.0
# How long such a liveness check waits for the pings (a worker slow to answer is not dead).
_LIVENESS_PING_S = 2.0
# How long to wait, in all, for the answers of the ranks whose step channel closed.
_CAUSE_PING_S = 10.0
# Ray's "temporarily unavailable" is no death it vouches for (a subclass of RayActorError).
_UNAVAILABLE = getattr(ray.exceptions, "ActorUnavailableError", ())


class EngineDeadError(RuntimeError):
    """A worker died or failed a step; in-flight requests cannot complete."""


def _project_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def death_cause(exc: BaseException) -> str:
    """The useful part of Ray's actor-death message (exit type and detail, or the kill)."""
    text = str(exc)
    if "ray.kill" in text:
        return "killed by ray.kill"
    m = re.search(r"Worker exit type: (\S+)\s*Worker exit detail: (.+?)(?:\n|$)", text)
    if m:
        detail = m.group(2).split(" Some common causes")[0].strip()
        return f"its process exited ({m.group(1)}: {detail[:300]})"
    for line in text.splitlines():
        line = line.strip()
        if line and "actor_id" not in line.lower():
            return line[:300]
    return type(exc).__name__


class RayExecutor:
    def __init__(self, cfg: EngineConfig, model_dir: str, max_model_len: int, device_kind: str):
        if not ray.is_initialized():
            ray.init(address=cfg.parallel.ray_address, log_to_driver=True)
        self.cfg = cfg
        self.model_dir = model_dir
        self.max_model_len = max_model_len
        self.device_kind = device_kind
        self.layout = Layout(cfg.parallel.tensor_parallel_size, cfg.parallel.pipeline_parallel_size)
        self.result_rank = self.layout.stage_ranks(self.layout.pipeline_parallel_size - 1)[0]
        self.stage_layers = None  # [start, end) layers per pipeline stage
        if self.layout.pipeline_parallel_size > 1:  # a split that does not fit: refused before placement
            from workers.models.arch import load_arch
            from workers.pipeline import stage_layers

            self.stage_layers = stage_layers(
                load_arch(model_dir).num_layers, self.layout.pipeline_parallel_size, cfg.parallel.pipeline_layer_split
            )
        self.workers: list = []
        self.channels: list = []  # cluster.step_channel.StepChannel per rank
        self.info: list[dict] = []
        self.placement: Placement | None = None
        self.dead: str | None = None
        self.num_restarts = 0
        self._start()

    # ---------------------------------------------------------- lifecycle
    def _start(self) -> None:
        from workers.actor import WorkerActor

        timeout = self.cfg.parallel.worker_start_timeout_s
        world = self.layout.world_size
        logger.info("starting %d worker(s) (%s)", world, self.device_kind)
        self.placement = place_workers(self.layout, self.device_kind, timeout)
        try:
            env = {
                "PYTHONPATH": _project_root() + os.pathsep + os.environ.get("PYTHONPATH", ""),
                **actor_env_vars(self.device_kind),
            }
            gpu = self.device_kind != "cpu"
            cls = ray.remote(WorkerActor)
            cfg_bytes = msgspec.msgpack.encode(self.cfg)
            self.workers = [
                cls.options(
                    num_cpus=0 if gpu else 1,
                    num_gpus=1 if gpu else 0,
                    runtime_env={"env_vars": env},
                    scheduling_strategy=self.placement.scheduling_strategy(rank),
                    max_restarts=0,
                ).remote(
                    cfg_bytes,
                    self.model_dir,
                    rank,
                    world,
                    self.max_model_len,
                    self.device_kind,
                    self.layout.tensor_parallel_size,
                    logger.getEffectiveLevel(),  # the workers log from the driver's level up
                )
                for rank in range(world)
            ]
            self.info = self._get([w.describe.remote() for w in self.workers], timeout, "start")
            init = self._get(self.workers[0].rendezvous.remote(), timeout, "start") if world > 1 else None
            t0 = time.perf_counter()
            logger.info("loading the model on %d worker(s) and sizing the KV cache", world)
            blocks = self._get([w.load.remote(init) for w in self.workers], timeout, "load the model")
            self.num_blocks = min(blocks)
            t1 = time.perf_counter()
            logger.info(
                "loaded in %.1f s; KV cache of %d blocks; %s",
                t1 - t0,
                self.num_blocks,
                "capturing CUDA graphs and warming up"
                if gpu and not self.cfg.enforce_eager and self.layout.pipeline_parallel_size == 1
                else "warming up",
            )
            self._get([w.init_cache.remote(self.num_blocks) for w in self.workers], timeout, "allocate the KV cache")
            logger.info("workers warmed up in %.1f s", time.perf_counter() - t1)
            self._open_channels(timeout)
        except BaseException:
            self.shutdown()
            raise
        self.dead = None
        logger.info(
            "workers ready: %s",
            ", ".join(
                f"rank {i['rank']}{self._stage_note(i['rank'])} {i['platform']} {i['node_ip']} pid {i['pid']} "
                f"gpu {','.join(i['gpu_ids']) or '-'}"
                for i in self.info
            ),
        )

    def _open_channels(self, timeout: float) -> None:
        from cluster.step_channel import StepChannel

        addrs = self._get([w.open_step_channel.remote() for w in self.workers], timeout, "open a step channel")
        try:
            for rank, (host, port, token) in enumerate(addrs):  # (appended one by one: shutdown closes them)
                self.channels.append(StepChannel(host, port, token, rank, timeout))
        except OSError as exc:
            raise EngineDeadError(
                f"cannot connect to a worker's step channel ({exc}): the driver must reach every worker node's "
                "IP address on any TCP port (as Ray's own workers do)"
            ) from None

    def _stage_note(self, rank: int) -> str:
        if self.stage_layers is None:
            return ""
        stage = self.layout.stage_of(rank)
        start, end = self.stage_layers[stage]
        return f" (stage {stage}, layers {start}-{end - 1})"

    def restart(self) -> None:
        """Replace every worker (after a failure): new placement, new actors, empty KV cache."""
        logger.warning("restarting %d worker(s)%s", self.layout.world_size, f" after: {self.dead}" if self.dead else "")
        self.shutdown()
        self.num_restarts += 1
        self._start()

    def probe(self, timeout: float = 5.0) -> str | None:
        """Death watch for idle times (a step notices a death by itself): ping every worker;
        None while all that answer are alive, else the first death (also kept in ``dead``).
        A worker that is slow to answer is not called dead."""
        if self.dead:
            return self.dead
        if not self.workers:
            return None
        refs = [w.ping.remote() for w in self.workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        done = set(ready)
        for rank, ref in enumerate(refs):
            if ref not in done:
                continue
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                self.dead = f"worker {self._where(rank)} died: {death_cause(exc)}"
                return self.dead
            except ray.exceptions.RayError as exc:
                self.dead = f"worker {self._where(rank)} does not answer: {str(exc)[:300]}"
                return self.dead
        return None

    def shutdown(self) -> None:
        for ch in self.channels:
            ch.close()
        self.channels = []
        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:  # already gone
                pass
        self.workers = []
        if self.placement is not None:
            self.placement.remove()
            self.placement = None

    def _where(self, rank: int) -> str:
        i = self.info[rank] if rank < len(self.info) else {}
        gpu = f", GPU {','.join(i['gpu_ids'])}" if i.get("gpu_ids") else ""
        return f"rank {rank} (pid {i.get('pid', '?')} on {i.get('node_ip', '?')}{gpu})"

    def _get(self, refs, timeout: float, what: str):
        """All results of a startup call, or EngineDeadError naming the first rank that failed."""
        single = not isinstance(refs, list)
        refs = [refs] if single else refs
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        out: dict[int, object] = {}
        pending, deadline = list(refs), time.monotonic() + timeout
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise EngineDeadError(
                    f"workers did not {what} within {timeout:.0f} s (worker_start_timeout_s): ranks "
                    f"{sorted(rank_of[r] for r in pending)} still busy; check that the cluster has the "
                    "resources the workers need"
                )
            rank = rank_of[ready[0]]
            try:
                out[rank] = ray.get(ready[0])
            except ray.exceptions.RayActorError as exc:
                raise EngineDeadError(
                    f"worker {self._where(rank)} died while trying to {what}: {death_cause(exc)}"
                ) from None
            except ray.exceptions.RayTaskError as exc:
                raise EngineDeadError(
                    f"worker {self._where(rank)} failed to {what}: {getattr(exc, 'cause', None) or exc}"
                ) from None
        return out[0] if single else [out[r] for r in range(len(refs))]

    # --------------------------------------------------------------- steps
    def submit(self, plan: StepPlan) -> list:
        """Ship a plan to every rank; returns the step's futures (one per rank) for ``collect``."""
        if self.dead:
            raise EngineDeadError(self.dead)
        data = encode(plan)
        futs = []
        for rank, ch in enumerate(self.channels):
            try:
                futs.append(ch.send(data, plan.step_id))
            except ChannelClosed as exc:
                self.dead = self._channel_losses({rank: exc})[rank]
                raise EngineDeadError(self.dead) from None
        return futs

    def collect(self, futs: list) -> StepResult:
        """Wait for one step on every rank; the last stage's first rank's result is the step's.
        The wait goes in slices of ``_LIVENESS_SLICE_S``; each that ends with ranks still busy
        pings those through Ray (no Ray call while results come in time)."""
        rank_of = {fut: rank for rank, fut in enumerate(futs)}
        pending = set(futs)
        results: dict[int, StepResult] = {}
        closed: dict[int, ChannelClosed] = {}  # ranks whose step channel ended
        deaths: dict[int, str] = {}  # ranks Ray reports dead while their channel looked open
        pings: dict = {}  # rank -> its liveness ping, not answered yet
        wait = concurrent.futures.wait
        while pending and not closed and not deaths and not any(r.error for r in results.values()):
            ready, pending = wait(pending, timeout=_LIVENESS_SLICE_S, return_when=concurrent.futures.FIRST_COMPLETED)
            if ready:
                self._gather(ready, rank_of, results, closed)
            else:
                self._check_alive(sorted(rank_of[fut] for fut in pending), pings, deaths)
        if pending and (closed or deaths or any(r.error for r in results.values())):
            ready, pending = wait(pending, timeout=_FAILURE_GRACE_S)
            self._gather(ready, rank_of, results, closed)
        if closed or deaths:
            losses = self._channel_losses({rank: exc for rank, exc in closed.items() if rank not in deaths})
            losses.update(deaths)
            self.dead = "; ".join(losses[rank] for rank in sorted(losses))
            raise EngineDeadError(self.dead)
        failed = [r for r in results.values() if r.error]
        if failed:
            r = min(failed, key=lambda r: r.rank)
            self.dead = f"worker {self._where(r.rank)} failed step {r.step_id}: {r.error}"
            raise EngineDeadError(self.dead)
        return results[self.result_rank]

    def _gather(self, ready, rank_of, results, closed) -> None:
        for fut in ready:
            rank = rank_of[fut]
            try:
                results[rank] = fut.result()
            except ChannelClosed as exc:
                closed[rank] = exc

    def _check_alive(self, ranks: list[int], pings: dict, deaths: dict[int, str]) -> None:
        """Ping ``ranks`` through Ray, all at once, and wait ``_LIVENESS_PING_S`` for the
        answers (a ping still unanswered from an earlier slice is waited on, not repeated).
        A rank that Ray reports dead goes into ``deaths``; a slow answer is no death."""
        for rank in ranks:
            if rank not in pings:
                pings[rank] = self.workers[rank].ping.remote()
        rank_of = {ref: rank for rank, ref in pings.items()}
        ready, _ = ray.wait(list(rank_of), num_returns=len(rank_of), timeout=_LIVENESS_PING_S)
        for ref in ready:
            rank = rank_of[ref]
            del pings[rank]
            try:
                ray.get(ref)
            except _UNAVAILABLE:
                pass  # asked again after the next slice
            except ray.exceptions.RayActorError as err:
                deaths[rank] = f"worker {self._where(rank)} died: {death_cause(err)}"
            except ray.exceptions.RayError:
                pass

    def _channel_losses(self, closed: dict[int, ChannelClosed]) -> dict[int, str]:
        """Why each rank's step channel closed, asked of Ray: the ranks are pinged all at once
        and their answers awaited together (``_CAUSE_PING_S`` in all). A rank that Ray reports
        dead "died" (the process's exit); one that still answers, or does not answer at all,
        "lost its step channel" (with the channel's own error)."""
        if not closed:
            return {}
        refs = {rank: self.workers[rank].ping.remote() for rank in closed}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=_CAUSE_PING_S)
        ready = set(ready)
        losses = {}
        for rank, exc in closed.items():
            lost = f"worker {self._where(rank)} lost its step channel: {exc}"
            if refs[rank] not in ready:
                losses[rank] = f"{lost}, and the worker does not answer either (no reply within {_CAUSE_PING_S:.0f} s)"
                continue
            try:
                ray.get(refs[rank])
            except _UNAVAILABLE as err:
                losses[rank] = f"{lost}, and the worker does not answer either: {str(err)[:300]}"
            except ray.exceptions.RayActorError as err:
                losses[rank] = f"worker {self._where(rank)} died: {death_cause(err)}"
            except ray.exceptions.RayError as err:
                losses[rank] = f"{lost}, and the worker does not answer either: {str(err)[:300]}"
            else:
                losses[rank] = f"{lost}, and the worker still answers"
        return losses
