"""The engine core: intake, the (optionally asynchronous) step loop, output processing."""

from __future__ import annotations

import gc
import logging
import time
from collections import deque
from typing import Any

from cluster.detokenizer import IncrementalDetokenizer, find_stop
from cluster.executor import EngineDeadError, RayExecutor
from cluster.input_processor import InputProcessor, InvalidRequestError
from cluster.outputs import CompletionOutput, RequestMetrics, RequestOutput, StreamDelta
from cluster.request import Request, RequestStatus
from cluster.scheduler import ScheduledStep, Scheduler
from metadata.config import ConfigError, EngineConfig
from metadata.sampling_params import SamplingParams
from metadata.wire import StepResult, encode
from workers.models.arch import ModelLoadError, load_arch
from workers.models.loader import checkpoint_files

logger = logging.getLogger(__name__)


def resolve_model_dir(cfg: EngineConfig) -> str:
    if cfg.model.model is None:
        from cluster.demo_model import ensure_demo_model

        return str(ensure_demo_model())
    return cfg.model.model


def resolve_device(cfg: EngineConfig) -> str:
    if cfg.device != "auto":
        return cfg.device
    import ray

    return "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"


class EngineCore:
    """Owns the scheduler and the executor. ``step()`` advances the engine by one
    result: in async mode it keeps two plans queued on the workers, so the
    driver's scheduling and output processing overlap the device's work."""

    def __init__(self, cfg: EngineConfig):
        import ray
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.model_dir = resolve_model_dir(cfg)
        arch = load_arch(self.model_dir)
        if cfg.model.load_format == "safetensors":
            checkpoint_files(self.model_dir)
        self.arch = arch
        limit = arch.max_position_embeddings
        if cfg.model.max_model_len is not None and cfg.model.max_model_len > limit:
            raise ConfigError(
                f"max_model_len {cfg.model.max_model_len} exceeds the model's "
                f"max_position_embeddings {limit}"
            )
        self.max_model_len = cfg.model.max_model_len or limit
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer or self.model_dir)
        except Exception as exc:
            raise ModelLoadError(f"cannot load a tokenizer from {cfg.model.tokenizer or self.model_dir}: {exc}") from None
        eos = arch.eos_token_ids or ((self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ())
        self.eos_token_ids = tuple(eos)
        if not ray.is_initialized():
            ray.init(address=cfg.parallel.ray_address, log_to_driver=True)
        self.device = resolve_device(cfg)
        self.executor = RayExecutor(cfg, self.model_dir, self.max_model_len, self.device)
        self.scheduler = Scheduler(cfg, self.executor.num_blocks, self.max_model_len)
        self.inputs = InputProcessor(
            self.tokenizer, self.eos_token_ids, arch.vocab_size, self.max_model_len,
            cfg.scheduler.max_num_batched_tokens, cfg.scheduler.enable_chunked_prefill, cfg.model.seed,
        )
        self.async_scheduling = cfg.scheduler.async_scheduling
        self.in_flight: deque[tuple[ScheduledStep, list]] = deque()
        self.groups: dict[str, list[Request]] = {}
        self.detok: dict[str, IncrementalDetokenizer] = {}
        self.stats = {"steps": 0, "prompt_tokens": 0, "generation_tokens": 0, "plan_bytes": 0}
        self.dead: str | None = None
        self._last_sent_step = 0  # reset to 0 whenever the workers are restarted
        self.timeline: list[tuple[int, float, float]] = []  # (rows, device step s, idle before s)
        # The tokenizer, transformers and torch modules live as long as the engine: keep them
        # out of the cyclic collector, whose full passes over them stall the step loop 100+ ms.
        gc.collect()
        gc.freeze()

    # ------------------------------------------------------------------ API
    def add_request(self, request_id: str, prompt: Any, params: SamplingParams | None = None,
                    strict_field: str | None = None) -> None:
        """``strict_field``: refuse a ``max_tokens`` past the context instead of cutting it
        (``InputProcessor.make_requests``; the servers' API fields)."""
        if self.dead:
            self.recover()
        if request_id in self.groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        blocks = self.scheduler.blocks
        reqs = self.inputs.make_requests(request_id, prompt, params, blocks.num_blocks * blocks.block_size,
                                          strict_field)
        self.groups[request_id] = reqs
        for r in reqs:
            self.detok[r.request_id] = IncrementalDetokenizer(
                self.tokenizer, r.prompt_token_ids, r.params.skip_special_tokens
            )
            self.scheduler.add(r)

    def recover(self) -> None:
        """Restart the workers after a failure (its requests already finished with an error).
        The new workers' KV caches are empty, so the scheduler starts afresh too."""
        logger.warning("restarting the workers after: %s", self.dead)
        self.executor.restart()
        self.scheduler = Scheduler(self.cfg, self.executor.num_blocks, self.max_model_len)
        self.in_flight.clear()
        self._last_sent_step = 0  # the new workers' plan chain starts again
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
        reqs = self.groups[request_id]
        first = reqs[0]
        return RequestOutput(
            request_id=request_id, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=r.index, text=self.detok[r.request_id].text, token_ids=list(r.output_token_ids),
                    cumulative_logprob=r.cumulative_logprob if r.logprobs is not None else None,
                    logprobs=r.logprobs, finish_reason=r.finish_reason, stop_reason=r.stop_reason,
                )
                for r in reqs
            ],
            finished=all(r.finished for r in reqs),
            metrics=RequestMetrics(first.arrival, first.first_token_time, first.last_token_time,
                                   sum(r.num_preemptions for r in reqs)),
        )

    def release(self, request_id: str) -> None:
        """Forget a finished request group (after its output was delivered)."""
        for r in self.groups.pop(request_id, []):
            self.detok.pop(r.request_id, None)

    # ----------------------------------------------------------------- step
    def step(self) -> list[StreamDelta]:
        """Advance by one step result; returns the per-sequence deltas it produced."""
        if self.dead:
            raise EngineDeadError(self.dead)
        # async: the driver stays two steps ahead, so result travel, output processing and the
        # next plan's preparation all hide behind device work (exact lengths stay on the device)
        depth = 3 if self.async_scheduling else 1
        while len(self.in_flight) < depth and self.scheduler.has_unfinished():
            t_plan = time.perf_counter()
            sched = self.scheduler.schedule()
            plan = sched.plan
            if not (plan.rows or plan.finished_handles or plan.preempted_handles):
                break
            plan.prev_step_id = self._last_sent_step
            self._last_sent_step = plan.step_id
            t_sched = time.perf_counter()
            try:
                refs = self.executor.submit(plan)
            except Exception as exc:
                return self._fail_all(f"cannot submit a step: {exc}")
            self.stats["steps"] += 1
            self.stats["driver_schedule_s"] = self.stats.get("driver_schedule_s", 0.0) + t_sched - t_plan
            if plan.rows and self.cfg.measure_device_timeline:
                self.stats["plan_bytes"] += len(encode(plan))
                self.stats["plan_rows"] = self.stats.get("plan_rows", 0) + len(plan.rows)
            self.in_flight.append((sched, refs))
            if not plan.rows:
                break
        if not self.in_flight:
            return []
        sched, refs = self.in_flight.popleft()
        t_wait = time.perf_counter()
        try:
            result = self.executor.collect(refs)
        except EngineDeadError as exc:
            return self._fail_all(str(exc))
        t0 = time.perf_counter()
        deltas = self._process(sched, result)
        st = self.stats
        st["driver_wait_s"] = st.get("driver_wait_s", 0.0) + t0 - t_wait  # blocked on the workers
        st["driver_process_s"] = st.get("driver_process_s", 0.0) + time.perf_counter() - t0
        st["worker_launch_s"] = st.get("worker_launch_s", 0.0) + result.host_launch_s
        if result.device_step_s >= 0:
            self.timeline.append((len(sched.plan.rows), result.device_step_s, result.device_idle_before_s))
        return deltas

    def _process(self, sched: ScheduledStep, result: StepResult) -> list[StreamDelta]:
        now = time.monotonic()
        deltas: list[StreamDelta] = []
        drafts = {r.handle: r.num_draft_tokens for r in sched.plan.rows if r.sample}
        returned = {row.handle for row in result.outputs}
        for handle, req in sched.sampled.items():
            if handle not in returned and not req.finished:
                req.num_placeholders -= 1 + drafts.get(handle, 0)  # worker produced nothing for it
        kv_written: dict[int, int] = {}
        for row in result.outputs:
            req = sched.sampled.get(row.handle)
            if req is None:
                continue
            k = drafts.get(row.handle, 0)
            req.num_placeholders -= 1 + k  # the scheduler counted every draft as a future token
            if k:
                accepted = len(row.token_ids) - 1
                kv_written[row.handle] = 1 + accepted
                self.stats["spec_draft_tokens"] = self.stats.get("spec_draft_tokens", 0) + k
                self.stats["spec_accepted_tokens"] = self.stats.get("spec_accepted_tokens", 0) + accepted
                if req.handle == row.handle:  # still placed there: its rejected drafts hold no KV
                    req.num_computed_tokens -= k - accepted
            if req.finished:
                continue  # in-flight tokens of a request that already finished: dropped
            parts = []
            for i, tok in enumerate(row.token_ids):
                req.output_token_ids.append(tok)
                self.stats["generation_tokens"] += 1
                if req.first_token_time is None:
                    req.first_token_time = now
                req.last_token_time = now
                lp = None
                if req.logprobs is not None and row.logprobs:
                    tl = row.logprobs[i]
                    lp = {tok: tl.sampled_logprob}
                    lp.update({t: v for t, v in zip(tl.top_token_ids, tl.top_logprobs)})
                    req.logprobs.append(lp)
                    req.cumulative_logprob += tl.sampled_logprob
                parts.append(self._check_stop(req, tok, lp))
                if req.finished:
                    break  # a stop inside the accepted drafts: the rest is dropped
            deltas.append(parts[0] if len(parts) == 1 else _merge(parts))
        self.scheduler.confirm_step(sched, kv_written)
        return deltas

    def _check_stop(self, req: Request, tok: int, lp) -> StreamDelta:
        detok = self.detok[req.request_id]
        n_out = len(req.output_token_ids)
        reason = stop_reason = None
        if n_out >= req.params.min_tokens:
            if tok in req.eos_token_ids:
                reason = "stop"
            elif tok in req.params.stop_token_ids:
                reason, stop_reason = "stop", tok
        if reason is None and (n_out >= req.max_tokens or req.num_known_tokens >= self.max_model_len):
            reason = "length"
        if reason == "stop" and not req.params.include_stop_str_in_output:
            new = detok.flush()  # a stop token (EOS or stop_token_ids) adds no text (as vLLM)
        else:
            new = detok.add(tok, final=reason is not None)
        if req.params.stop and n_out >= req.params.min_tokens:
            hit = find_stop(detok.text, len(new), req.params.stop)
            if hit is not None:
                pos, s = hit
                detok.text = detok.text[: pos + len(s) if req.params.include_stop_str_in_output else pos]
                reason, stop_reason = "stop", s
        # Streamed text holds back what could still turn out to start a stop string.
        hold = 0 if reason is not None else max((len(s) - 1 for s in req.params.stop), default=0)
        upto = max(req.emitted_chars, len(detok.text) - hold)
        delta_text = detok.text[req.emitted_chars : upto]
        req.emitted_chars = upto
        if reason is not None:
            self.scheduler.finish(req, reason, stop_reason)
        return StreamDelta(req.parent_id, req.index, [tok], delta_text, [lp] if lp else None, reason, stop_reason)

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


def _merge(parts: list[StreamDelta]) -> StreamDelta:
    """One delta for several tokens a sequence gained in one step (accepted drafts)."""
    last = parts[-1]
    lps = [lp for p in parts for lp in (p.logprobs or [])]
    return StreamDelta(last.request_id, last.index, [t for p in parts for t in p.token_ids],
                       "".join(p.text for p in parts), lps or None, last.finish_reason, last.stop_reason)
