"""The engine core: intake and the (optionally asynchronous) step loop.

One step: schedule -> execute (send the plan) -> ``Scheduler.update_from_result`` (all
post-step scheduler state) -> build outputs (``OutputProcessor``: detokenize, stop
strings, deltas). Under async scheduling the next plan is sent between the last two, so
output processing never delays the workers' next plan.
"""

from __future__ import annotations

import gc
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from cluster.executor import EngineDeadError, RayExecutor
from cluster.input_processor import InputProcessor, InvalidRequestError
from cluster.model_source import model_len, resolve_model
from cluster.output_processor import OutputProcessor
from cluster.outputs import RequestOutput, StreamDelta
from cluster.request import Request
from cluster.scheduler import ScheduledStep, Scheduler, StepUpdate
from metadata.config import EngineConfig
from metadata.sampling_params import SamplingParams
from metadata.wire import StepStats, encode

logger = logging.getLogger(__name__)


def resolve_device(cfg: EngineConfig) -> str:
    if cfg.device != "auto":
        return cfg.device
    import ray

    return "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"


class EngineCore:
    """Owns the scheduler, the executor and the output processor. ``step()`` advances the
    engine by one result: in async mode it keeps plans queued on the workers (two ahead,
    P + 1 with P pipeline stages), so the driver's work overlaps the device's.

    Public surface: ``EngineCore(cfg)``, ``add_request``, ``abort``, ``step``,
    ``has_unfinished``, ``output``, ``release``, ``recover``, ``shutdown``; ``stats``
    (counters and seconds, see ``_account``), ``timeline``, ``dead``, ``groups``,
    ``in_flight``, ``scheduler``, and the ``intake`` hook."""

    def __init__(self, cfg: EngineConfig):
        import ray

        self.cfg = cfg
        source = resolve_model(cfg)  # checkpoint dir or .gguf file, default SmolLM2-135M-Instruct
        self.model_dir, self.arch, self.tokenizer = source.path, source.arch, source.tokenizer
        self.eos_token_ids, self.served_model_name = source.eos_token_ids, source.served_name
        self.generation = source.generation
        if source.generation.source is not None:
            logger.info(
                "%s: stop tokens %s, request defaults %s",
                source.generation.source,
                list(source.generation.eos_token_ids),
                source.generation.sampling,
            )
        arch = self.arch
        self.max_model_len = model_len(cfg.model.max_model_len, arch)
        if not ray.is_initialized():
            ray.init(address=cfg.parallel.ray_address, log_to_driver=True)
        self.device = resolve_device(cfg)
        self.executor = RayExecutor(cfg, self.model_dir, self.max_model_len, self.device)
        self.scheduler = Scheduler(cfg, self.executor.num_blocks, self.max_model_len)
        self.inputs = InputProcessor(
            self.tokenizer,
            self.eos_token_ids,
            arch.vocab_size,
            self.max_model_len,
            cfg.scheduler.max_num_batched_tokens,
            cfg.scheduler.enable_chunked_prefill,
            cfg.model.seed,
            source.generation.params(),
            source.generation.eos_token_ids,
        )
        self.async_scheduling = cfg.scheduler.async_scheduling
        self.in_flight: deque[tuple[ScheduledStep, list]] = deque()
        self.groups: dict[str, list[Request]] = {}
        self.outputs = OutputProcessor(self.tokenizer)
        self.stats = {"steps": 0, "prompt_tokens": 0, "generation_tokens": 0, "plan_bytes": 0}
        self.dead: str | None = None
        # called right before plans are scheduled (a server's request intake): under async
        # scheduling that is mid-step, so requests that arrived meanwhile join the next plan
        self.intake: Callable[[], None] | None = None
        self.timeline: list[tuple[int, float, float]] = []  # (rows, device step s, idle before s)
        # The tokenizer, transformers and torch modules live as long as the engine: keep them
        # out of the cyclic collector, whose full passes over them stall the step loop 100+ ms.
        gc.collect()
        gc.freeze()

    # ------------------------------------------------------------------ API
    def add_request(
        self, request_id: str, prompt: Any, params: SamplingParams | None = None, strict_field: str | None = None
    ) -> None:
        """``strict_field``: refuse a ``max_tokens`` past the context instead of cutting it
        (``InputProcessor.make_requests``; the servers' API fields)."""
        if self.dead:
            self.recover()
        if request_id in self.groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        if isinstance(params, SamplingParams) and params.priority and not self.scheduler.by_priority:
            raise InvalidRequestError(
                f"priority {params.priority}: this engine schedules first come, first served; start it with "
                "scheduling_policy='priority' (--scheduling-policy priority) to use request priorities",
                "priority",
            )
        blocks = self.scheduler.blocks
        reqs = self.inputs.make_requests(
            request_id, prompt, params, blocks.num_blocks * blocks.block_size, strict_field
        )
        self.groups[request_id] = reqs
        for r in reqs:
            self.outputs.add(r)
            self.scheduler.add(r)

    def recover(self) -> None:
        """Restart the workers after a failure (its requests already finished with an error).
        The new workers' KV caches are empty, so the scheduler (and its plan chain) starts
        afresh too."""
        logger.warning("restarting the workers after: %s", self.dead)
        self.executor.restart()
        self.scheduler = Scheduler(self.cfg, self.executor.num_blocks, self.max_model_len)
        self.in_flight.clear()
        self.dead = None

    def abort(self, request_id: str) -> bool:
        reqs = self.groups.get(request_id)
        if not reqs:
            return False
        for r in reqs:
            self.scheduler.finish(r, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.in_flight)

    def output(self, request_id: str) -> RequestOutput:
        return self.outputs.request_output(request_id, self.groups[request_id])

    def release(self, request_id: str) -> None:
        """Forget a finished request group (after its output was delivered)."""
        for r in self.groups.pop(request_id, []):
            self.outputs.release(r)

    # ----------------------------------------------------------------- step
    def step(self) -> list[StreamDelta]:
        """Advance by one step result; returns the per-sequence deltas it produced."""
        if self.dead:
            raise EngineDeadError(self.dead)
        failure = self._send_plans()  # schedule -> execute
        if failure:
            return self._fail_all(failure)
        if not self.in_flight:
            return []
        sched, refs = self.in_flight.popleft()
        t_wait = time.perf_counter()
        try:
            result = self.executor.collect(refs)
        except EngineDeadError as exc:
            return self._fail_all(str(exc))
        t_update = time.perf_counter()
        update = self.scheduler.update_from_result(sched, result)
        t_updated = time.perf_counter()
        if self.async_scheduling:
            failure = self._send_plans()  # the next plan leaves before this result's outputs are built
        t_out = time.perf_counter()
        deltas = self.outputs.process(update, self.scheduler)
        t_end = time.perf_counter()
        self._account(sched, update, result.stats, t_update - t_wait, t_updated - t_update, t_end - t_out)
        if failure:
            deltas += self._fail_all(failure)
        return deltas

    def _send_plans(self) -> str | None:
        """Schedule and send plans until ``in_flight`` holds the pipelining depth (async: the
        driver stays two steps ahead, with P pipeline stages P + 1, so result travel, output
        processing and the next plan's preparation hide behind device work; sync: one).
        Returns why sending failed, if it did."""
        pp = self.cfg.parallel.pipeline_parallel_size
        depth = pp + 2 if self.async_scheduling else 1
        st = self.stats
        if self.intake is not None and len(self.in_flight) < depth:
            self.intake()
        while len(self.in_flight) < depth and self.scheduler.has_unfinished():
            t_plan = time.perf_counter()
            sched = self.scheduler.schedule()
            if sched.empty:
                break
            plan = sched.plan
            t_sched = time.perf_counter()
            try:
                refs = self.executor.submit(plan)
            except Exception as exc:  # noqa: BLE001 - any failure to send kills the engine, reported
                return f"cannot submit a step: {exc}"
            st["steps"] += 1
            st["driver_schedule_s"] = st.get("driver_schedule_s", 0.0) + t_sched - t_plan
            if plan.rows and self.cfg.measure_device_timeline:
                st["plan_bytes"] += len(encode(plan))
                st["plan_rows"] = st.get("plan_rows", 0) + len(plan.rows)
            self.in_flight.append((sched, refs))
            if not plan.rows:
                break
        return None

    def _account(
        self,
        sched: ScheduledStep,
        update: StepUpdate,
        stats: StepStats,
        wait_s: float,
        update_s: float,
        output_s: float,
    ) -> None:
        """Engine statistics of one result. Seconds: ``driver_wait_s`` blocked on the workers,
        ``driver_update_s`` applying the result to the scheduler (on the path to the next
        plan), ``driver_output_s`` detokenizing and building outputs (after the next plan
        left, under async scheduling), ``driver_process_s`` the two together; the workers'
        ``worker_launch_s`` (host time preparing and enqueueing steps)."""
        st = self.stats
        st["generation_tokens"] += update.num_new_tokens
        if update.num_draft_tokens:
            st["spec_draft_tokens"] = st.get("spec_draft_tokens", 0) + update.num_draft_tokens
            st["spec_accepted_tokens"] = st.get("spec_accepted_tokens", 0) + update.num_accepted_tokens
        st["driver_wait_s"] = st.get("driver_wait_s", 0.0) + wait_s
        st["driver_update_s"] = st.get("driver_update_s", 0.0) + update_s
        st["driver_output_s"] = st.get("driver_output_s", 0.0) + output_s
        st["driver_process_s"] = st.get("driver_process_s", 0.0) + update_s + output_s
        st["worker_launch_s"] = st.get("worker_launch_s", 0.0) + stats.host_launch_s
        if stats.device_step_s >= 0:
            self.timeline.append((len(sched.plan.rows), stats.device_step_s, stats.device_idle_before_s))

    def _fail_all(self, message: str) -> list[StreamDelta]:
        logger.error("engine failed: %s", message)
        self.dead = message
        deltas = []
        for reqs in self.groups.values():
            for r in reqs:
                if not r.finished:
                    self.scheduler.finish(r, "error")
                    deltas.append(StreamDelta(r.parent_id, r.index, [], "", None, "error", error=message))
        self.in_flight.clear()
        return deltas

    def shutdown(self) -> None:
        self.executor.shutdown()
        gc.unfreeze()  # what the engine held can be collected again
