"""Continuous batching with a token budget, chunked prefill and preemption by recompute.

The scheduler may run one step ahead of the workers (async scheduling): it
schedules from ``num_tokens_upper`` (confirmed tokens plus in-flight
placeholders) and lets ``update_from_result`` reconcile. No request is ever
dropped: when KV blocks run out, the most recently arrived running request is
preempted (its blocks freed, recomputed later from its confirmed tokens).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from cluster.block_manager import BlockManager
from cluster.request import Request, RequestStatus
from cluster.spec_scheduling import DraftPlanner
from metadata.config import EngineConfig
from metadata.wire import NewRequest, ScheduledRow, StepPlan


@dataclass
class ScheduledStep:
    plan: StepPlan
    sampled: dict[int, Request] = field(default_factory=dict)  # handle -> request sampling this step


class Scheduler:
    def __init__(self, cfg: EngineConfig, num_blocks: int, max_model_len: int):
        self.cfg = cfg
        self.max_model_len = max_model_len
        self.blocks = BlockManager(num_blocks, cfg.cache.block_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.by_handle: dict[int, Request] = {}
        self._handles = itertools.count(1)
        self._last_step_id = 0  # ids of plans with content are consecutive: 1, 2, 3, ...
        self._pending_release: list[int] = []  # handles to release on the workers
        self._pending_preempt: list[int] = []
        self.num_preemptions = 0
        self.drafts = DraftPlanner(cfg, max_model_len)

    # ------------------------------------------------------------ intake
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def finish(self, req: Request, reason: str, stop_reason=None) -> None:
        """Finish (or abort) a request: free its blocks now, release its worker row next step."""
        if req.finished:
            return
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        if req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.blocks.free(req)
        if req.handle >= 0:
            self._pending_release.append(req.handle)
            self.by_handle.pop(req.handle, None)
            req.handle = -1

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---------------------------------------------------------- schedule
    def schedule(self) -> ScheduledStep:
        budget = self.cfg.scheduler.max_num_batched_tokens
        rows: list[ScheduledRow] = []
        new_reqs: list[NewRequest] = []
        step = ScheduledStep(plan=StepPlan(step_id=self._last_step_id + 1))
        scheduled: set[int] = set()
        preempted_now = False

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._num_new_tokens(req, budget)
            if n == 0:
                i += 1
                continue
            k = self.drafts.num_drafts(req, budget) if self._decodes(req, n) else 0
            target = req.num_computed_tokens + n + k
            alloc = self.drafts.alloc_tokens(req, target) if k or self.drafts.kv_lookahead else target
            while not self.blocks.can_allocate(req, alloc):
                victim = self.running[-1]
                self._preempt(victim)
                preempted_now = True
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                break  # req preempted itself: nothing else left to preempt
            new_blocks = self.blocks.allocate(req, alloc)
            rows.append(self._row(req, n, new_blocks, step, k))
            scheduled.add(id(req))
            budget -= n
            i += 1

        while self.waiting and budget > 0 and not preempted_now:
            if len(self.running) >= self.cfg.scheduler.max_num_seqs:
                break
            req = self.waiting[0]
            if req.num_placeholders:  # preempted with a sample still in flight: wait for it
                break
            n = self._num_new_tokens(req, budget)
            if n == 0:
                break
            alloc = self.drafts.alloc_tokens(req, req.num_computed_tokens + n)
            if not self.blocks.can_allocate(req, alloc):
                break
            self.waiting.popleft()
            self.blocks.allocate(req, alloc)
            req.status = RequestStatus.RUNNING
            req.handle = next(self._handles)
            self.by_handle[req.handle] = req
            self.running.append(req)
            new_reqs.append(
                NewRequest(
                    handle=req.handle,
                    prompt_token_ids=req.prompt_token_ids,
                    output_token_ids=list(req.output_token_ids),
                    sampling=req.options,
                    block_ids=list(req.block_ids),
                )
            )
            rows.append(self._row(req, n, [], step))
            budget -= n

        plan = step.plan
        plan.rows = rows
        plan.new_requests = new_reqs
        plan.finished_handles, self._pending_release = self._pending_release, []
        plan.preempted_handles, self._pending_preempt = self._pending_preempt, []
        if plan.rows or plan.new_requests or plan.finished_handles or plan.preempted_handles:
            # an empty plan is never sent, so it does not use up an id: workers see no gaps
            self._last_step_id = plan.step_id
        return step

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        remaining = req.num_tokens_upper - req.num_computed_tokens
        if remaining <= 0:
            return 0
        if remaining > budget and not self.cfg.scheduler.enable_chunked_prefill and not req.output_token_ids:
            # prompts are not chunked; a preempted request's recompute (prompt + outputs) may
            # outgrow the budget, so it is chunked: otherwise it could never run again
            return 0
        n = min(remaining, budget)
        if req.num_computed_tokens + n >= req.num_tokens_upper:  # this row would sample
            if req.num_outputs_upper >= req.max_tokens or req.num_tokens_upper >= self.max_model_len:
                return 0  # its last token is already confirmed or in flight
        return n

    def _decodes(self, req: Request, n: int) -> bool:
        """This row is a decode step: its one new token is the last sampled one."""
        return n == 1 and req.num_computed_tokens + 1 >= req.num_tokens_upper and bool(req.output_token_ids)

    def _row(self, req: Request, n: int, new_blocks: list[int], step: ScheduledStep, k: int = 0) -> ScheduledRow:
        """``k`` drafts ride on a decode row: ``n + k`` query tokens, all counted as if accepted."""
        drafts = self.drafts.host_drafts(req, k) if k and self.drafts.host_ngram else []
        req.num_computed_tokens += n + k
        samples = req.num_computed_tokens >= req.num_tokens_upper
        if samples:
            req.num_placeholders += 1 + k
            step.sampled[req.handle] = req
        return ScheduledRow(
            handle=req.handle,
            num_scheduled_tokens=n + k,
            seq_len_upper_bound=req.num_computed_tokens,
            new_block_ids=new_blocks,
            sample=samples,
            num_draft_tokens=k,
            draft_token_ids=drafts,
        )

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.blocks.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        if req.handle >= 0:
            self._pending_preempt.append(req.handle)
            self.by_handle.pop(req.handle, None)
            req.handle = -1
        self.waiting.appendleft(req)

    def confirm_step(self, sched: ScheduledStep, kv_written: dict[int, int] | None = None) -> None:
        """A step's result arrived (called by the engine after its tokens were appended).
        ``kv_written`` maps a speculative row's handle to the tokens whose KV it really
        wrote (1 + accepted drafts); other rows wrote ``num_scheduled_tokens``.
        Placeholder: prefix caching commits the newly confirmed full blocks here."""
