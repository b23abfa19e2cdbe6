"""Continuous batching with a token budget, chunked prefill and preemption by recompute.

The scheduler may run one step ahead of the workers (async scheduling): it
schedules from ``num_tokens_upper`` (confirmed tokens plus in-flight
placeholders) and lets ``update_from_result`` reconcile. No request is ever
dropped: when KV blocks run out, the most recently arrived running request is
preempted (its blocks freed, recomputed later from its confirmed tokens).

Prefix caching: a request being placed reuses the longest cached prefix of its
confirmed tokens (whole blocks, never its last token) and schedules only the
rest; ``confirm_step`` commits full blocks once every token in them is confirmed
by a ``StepResult`` (token known, KV written by a finished step).
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
    row_requests: list[Request] = field(default_factory=list)  # the request of each of plan.rows


class Scheduler:
    def __init__(self, cfg: EngineConfig, num_blocks: int, max_model_len: int):
        self.cfg = cfg
        self.max_model_len = max_model_len
        c = cfg.cache
        self.blocks = BlockManager(num_blocks, c.block_size, c.enable_prefix_caching, c.prefix_cache_hash,
                                   c.prefix_cache_retention_interval)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.by_handle: dict[int, Request] = {}
        self._handles = itertools.count(1)
        self._last_step_id = 0  # ids of plans with content are consecutive: 1, 2, 3, ...
        self._pending_release: list[int] = []  # handles to release on the workers
        self._pending_preempt: list[int] = []
        self.num_preemptions = 0
        self._deferred_free: list[Request] = []  # finished by this result: freed after its commit
        self.drafts = DraftPlanner(cfg, max_model_len)

    # ------------------------------------------------------------ intake
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def finish(self, req: Request, reason: str, stop_reason=None) -> None:
        """Finish (or abort) a request: free its blocks, release its worker row next step.
        A stop or length finish comes from the result being processed; with prefix caching
        its blocks are freed by the ``confirm_step`` that follows, after committing them."""
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
        if self.blocks.caching and reason in ("stop", "length") and req.block_ids:
            self._deferred_free.append(req)
        else:
            self._free(req)
        if req.handle >= 0:
            self._pending_release.append(req.handle)
            self.by_handle.pop(req.handle, None)
            req.handle = -1

    def has_unfinished(self) -> bool:
        self._flush_deferred()
        return bool(self.waiting or self.running)

    def _free(self, req: Request) -> None:
        self.blocks.free(req)
        req.kv_handle = -1
        req.num_confirmed_kv = 0

    def _flush_deferred(self) -> None:
        while self._deferred_free:
            self._free(self._deferred_free.pop())

    # ---------------------------------------------------------- schedule
    def schedule(self) -> ScheduledStep:
        self._flush_deferred()
        budget = self.cfg.scheduler.max_num_batched_tokens
        rows: list[ScheduledRow] = []
        new_reqs: list[NewRequest] = []
        step = ScheduledStep(plan=StepPlan(step_id=self._last_step_id + 1))
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
            new_blocks: list[int] = []
            if self.blocks.blocks_needed(req, alloc):  # most decode rows still have room in their block
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
            budget -= n
            i += 1

        while self.waiting and budget > 0 and not preempted_now:
            if len(self.running) >= self.cfg.scheduler.max_num_seqs:
                break
            req = self.waiting[0]
            if req.num_placeholders:  # preempted with a sample still in flight: wait for it
                break
            hit = self.blocks.lookup(req)
            req.num_computed_tokens = len(hit) * self.blocks.block_size
            n = self._num_new_tokens(req, budget)
            alloc = self.drafts.alloc_tokens(req, req.num_computed_tokens + n)
            # retained cached blocks are only evicted to avoid preemption or an idle engine
            evict_retained = not self.running
            if n == 0 or not self.blocks.can_admit(req, alloc, hit, evict_retained):
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            self.blocks.admit(req, alloc, hit, evict_retained)
            req.status = RequestStatus.RUNNING
            req.handle = req.kv_handle = next(self._handles)
            req.num_confirmed_kv = req.num_computed_tokens
            self.by_handle[req.handle] = req
            self.running.append(req)
            new_reqs.append(
                NewRequest(
                    handle=req.handle,
                    prompt_token_ids=req.prompt_token_ids,
                    output_token_ids=list(req.output_token_ids),
                    sampling=req.options,
                    block_ids=list(req.block_ids),
                    num_cached_tokens=req.num_computed_tokens,
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
        step.row_requests.append(req)
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
        self._free(req)
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
        """A step's result arrived (called by the engine after its tokens were appended and
        stops checked). ``kv_written`` maps a speculative row's handle to the tokens whose KV
        it really wrote (1 + accepted drafts); other rows wrote ``num_scheduled_tokens``.
        Commits every full block whose tokens are all confirmed; rows of a placement that
        was preempted or freed since are ignored (their KV is gone with the placement)."""
        if self.blocks.caching:
            kv = kv_written or {}
            for row, req in zip(sched.plan.rows, sched.row_requests):
                if req.kv_handle != row.handle:
                    continue
                req.num_confirmed_kv += kv.get(row.handle, row.num_scheduled_tokens)
                self.blocks.commit(req, min(req.num_confirmed_kv, req.num_known_tokens))
        self._flush_deferred()

    def prefix_cache_stats(self) -> dict:
        """Token-level queries and hits of placed requests, hit rate, cached blocks, evictions."""
        return self.blocks.stats()
