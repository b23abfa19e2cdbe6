"""Continuous batching with a token budget, chunked prefill and preemption by recompute.

The scheduler may run one step ahead of the workers (async scheduling): it
schedules from ``num_tokens_upper`` (confirmed tokens plus in-flight
placeholders) and lets ``update_from_result`` reconcile. No request is ever
dropped: when KV blocks run out, the most recently arrived running request is
preempted (its blocks freed, recomputed later from its confirmed tokens).

``update_from_result`` is the one owner of post-step state: it appends the
sampled tokens, rolls back rejected drafts and placeholders, finishes requests
on EOS, stop tokens and length, and commits or frees KV blocks. The engine only
detokenizes; a stop string it finds comes back through ``finish_at_stop_string``.
The scheduler also owns the plan chain (``step_id``/``prev_step_id``).

Prefix caching: a request being placed reuses the longest cached prefix of its
confirmed tokens (whole blocks, never its last token) and schedules only the
rest; ``update_from_result`` commits full blocks once every token in them is
confirmed by a ``StepResult`` (token known, KV written by a finished step).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from cluster.block_manager import BlockManager
from cluster.request import Request, RequestStatus
from cluster.spec_scheduling import DraftPlanner
from metadata.config import EngineConfig
from metadata.wire import NewRequest, ScheduledRow, StepPlan, StepResult, token_bytes

logger = logging.getLogger(__name__)


@dataclass
class ScheduledStep:
    plan: StepPlan
    sampled: dict[int, Request] = field(default_factory=dict)  # handle -> request sampling this step
    row_requests: list[Request] = field(default_factory=list)  # the request of each of plan.rows
    prompt_starts: dict[int, tuple[Request, int]] = field(default_factory=dict)
    """handle -> (request, first position) of each row in ``plan.prompt_logprob_handles``"""

    @property
    def empty(self) -> bool:
        """Nothing to send: no row, no placement, no release (never sent, uses up no step id)."""
        p = self.plan
        return not (p.rows or p.new_requests or p.finished_handles or p.preempted_handles)


@dataclass(slots=True)
class SequenceUpdate:
    """The tokens one sequence gained from a step, already appended to ``req.output_token_ids``
    from index ``start`` on. ``finish_reason`` is set when the scheduler finished the request
    on the last of them (EOS, a stop token, length); stop strings are the engine's to find."""

    req: Request
    start: int
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: str | int | None


@dataclass
class StepUpdate:
    """What ``Scheduler.update_from_result`` did with one step's result."""

    sequences: list[SequenceUpdate] = field(default_factory=list)
    num_new_tokens: int = 0  # output tokens appended (less any a stop string later drops)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class Scheduler:
    """Decides each step's plan (``schedule``) and owns every request's state after a step
    (``update_from_result``); the engine's only other write is ``finish`` (abort, errors)
    and ``finish_at_stop_string``."""

    def __init__(self, cfg: EngineConfig, num_blocks: int, max_model_len: int):
        self.cfg = cfg
        self.max_model_len = max_model_len
        c = cfg.cache
        self.blocks = BlockManager(
            num_blocks, c.block_size, c.enable_prefix_caching, c.prefix_cache_hash, c.prefix_cache_retention_interval
        )
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
        # 'priority': waiting and running stay sorted by (priority, order), so the queue's head
        # is admitted first and running[-1] (the lowest priority, latest) is preempted first
        self.by_priority = cfg.scheduler.scheduling_policy == "priority"
        self._order = itertools.count()

    # ------------------------------------------------------------ intake
    def add(self, req: Request) -> None:
        req.order = next(self._order)
        if self.by_priority:
            _insert_sorted(self.waiting, req)
        else:
            self.waiting.append(req)

    def finish(self, req: Request, reason: str, stop_reason=None) -> None:
        """Finish (or abort) a request: free its blocks, release its worker row next step.
        A stop or length finish comes from a result; with prefix caching its blocks are
        freed after that result's blocks are committed (before the next schedule)."""
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
            upper = req.num_tokens_upper  # (fixed until _row adds the row's placeholders)
            n = self._num_new_tokens(req, budget, upper)
            if n == 0:
                i += 1
                continue
            k = self.drafts.num_drafts(req, budget) if self._decodes(req, n, upper) else 0
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
            rows.append(self._row(req, n, new_blocks, step, k, upper))
            budget -= n
            i += 1

        while self.waiting and budget > 0 and not preempted_now:
            if len(self.running) >= self.cfg.scheduler.max_num_seqs:
                break
            req = self.waiting[0]
            if req.num_placeholders:  # preempted with a sample still in flight: wait for it
                break
            # (prompt logprobs need every prompt token's hidden state: no prefix-cache hit)
            hit = self.blocks.lookup(req) if not req.wants_prompt_logprobs else []
            req.num_computed_tokens = len(hit) * self.blocks.block_size
            upper = req.num_tokens_upper
            n = self._num_new_tokens(req, budget, upper)
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
            if self.by_priority:  # (the running loop is over: rows already scheduled keep their order)
                _insert_sorted(self.running, req)
            else:
                self.running.append(req)
            new_reqs.append(
                NewRequest(
                    handle=req.handle,
                    prompt_words=req.prompt_wire,
                    output_words=token_bytes(req.output_token_ids),
                    sampling=req.options,
                    block_ids=list(req.block_ids),
                    num_cached_tokens=req.num_computed_tokens,
                )
            )
            rows.append(self._row(req, n, [], step, 0, upper))
            budget -= n

        plan = step.plan
        plan.rows = rows
        plan.new_requests = new_reqs
        plan.finished_handles, self._pending_release = self._pending_release, []
        plan.preempted_handles, self._pending_preempt = self._pending_preempt, []
        if not step.empty:
            # an empty plan is never sent, so it does not use up an id: workers see no gaps;
            # every plan names the one before it (workers run plans by this chain)
            plan.prev_step_id = self._last_step_id
            self._last_step_id = plan.step_id
        return step

    def _num_new_tokens(self, req: Request, budget: int, upper: int) -> int:
        """``upper``: ``req.num_tokens_upper`` (read once a row by the caller)."""
        remaining = upper - req.num_computed_tokens
        if remaining <= 0:
            return 0
        if remaining > budget and not self.cfg.scheduler.enable_chunked_prefill and not req.output_token_ids:
            # prompts are not chunked; a preempted request's recompute (prompt + outputs) may
            # outgrow the budget, so it is chunked: otherwise it could never run again
            return 0
        n = min(remaining, budget)
        samples = req.num_computed_tokens + n >= upper
        if samples and (req.num_outputs_upper >= req.max_tokens or upper >= self.max_model_len):
            return 0  # its last token is already confirmed or in flight
        if samples and req.grammar is not None and req.num_placeholders:
            return 0  # constrained: its mask needs the token in flight (cluster.structured_output)
        return n

    def _decodes(self, req: Request, n: int, upper: int) -> bool:
        """This row is a decode step: its one new token is the last sampled one."""
        return n == 1 and req.num_computed_tokens + 1 >= upper and bool(req.output_token_ids)

    def _row(
        self, req: Request, n: int, new_blocks: list[int], step: ScheduledStep, k: int, upper: int
    ) -> ScheduledRow:
        """``k`` drafts ride on a decode row: ``n + k`` query tokens, all counted as if accepted.
        ``upper``: ``req.num_tokens_upper`` before the row (its placeholders are added here)."""
        drafts = self.drafts.host_drafts(req, k) if k and self.drafts.host_ngram else []
        # (a row past the prompt's last scored position, as a first decode row scheduled ahead, is not)
        if (
            req.prompt_logprobs is not None
            and req.wants_prompt_logprobs
            and req.num_computed_tokens < len(req.prompt_token_ids) - 1
        ):
            step.prompt_starts[req.handle] = (req, req.num_computed_tokens)
            step.plan.prompt_logprob_handles.append(req.handle)
        req.num_computed_tokens += n + k
        step.row_requests.append(req)
        samples = req.num_computed_tokens >= upper
        if samples:
            req.num_placeholders += 1 + k
            step.sampled[req.handle] = req
        row = ScheduledRow(
            handle=req.handle,
            num_scheduled_tokens=n + k,
            seq_len_upper_bound=req.num_computed_tokens,
            new_block_ids=new_blocks,
            sample=samples,
            num_draft_tokens=k,
            draft_token_ids=drafts,
        )
        if samples and req.grammar is not None:
            row.token_bitmask = req.grammar.bitmask()
            step.plan.any_token_bitmask = True
        return row

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
        if self.by_priority:
            _insert_sorted(self.waiting, req)
        else:
            self.waiting.appendleft(req)

    # ------------------------------------------------------------ results
    def update_from_result(self, step: ScheduledStep, result: StepResult) -> StepUpdate:
        """Apply a step's result: appends each sampled row's tokens to its request, takes back
        the placeholders (and the KV of rejected drafts) the step was scheduled with, finishes
        requests on EOS, stop tokens and length, commits confirmed KV blocks to the prefix
        cache and frees the blocks of requests finished by this result. Tokens of a request
        that finished while the step was in flight are dropped."""
        now = time.monotonic()
        update = StepUpdate()
        drafts = {r.handle: r.num_draft_tokens for r in step.plan.rows if r.sample} if self.drafts.enabled else {}
        returned = {row.handle for row in result.outputs}
        for handle, req in step.sampled.items():
            if handle not in returned and not req.finished:
                req.num_placeholders -= 1 + drafts.get(handle, 0)  # the worker produced nothing for it
        for chunk in result.prompt_logprobs:  # (before the first sampled token: it may finish the request)
            self._add_prompt_logprobs(step, chunk)
        kv_written: dict[int, int] = {}
        for row in result.outputs:
            req = step.sampled.get(row.handle)
            if req is None:
                continue
            k = drafts.get(row.handle, 0)
            req.num_placeholders -= 1 + k  # the scheduler counted every draft as a future token
            if k:
                accepted = len(row.token_ids) - 1
                kv_written[row.handle] = 1 + accepted
                update.num_draft_tokens += k
                update.num_accepted_tokens += accepted
                if req.handle == row.handle:  # still placed there: its rejected drafts hold no KV
                    req.num_computed_tokens -= k - accepted
            if req.finished:
                continue  # in-flight tokens of a request that already finished: dropped
            update.sequences.append(self._append_tokens(req, row, now))
            update.num_new_tokens += len(update.sequences[-1].token_ids)
        self._commit_blocks(step, kv_written)
        return update

    @staticmethod
    def _add_prompt_logprobs(step: ScheduledStep, chunk) -> None:
        """A row's prompt logprobs: entry j scores the token after position ``start + j``; the
        ones already known (a recompute after preemption) and past the prompt are skipped."""
        req, start = step.prompt_starts[chunk.handle]
        got, prompt = req.prompt_logprobs, req.prompt_token_ids
        for j, e in enumerate(chunk.entries):
            pos = start + j + 1
            if pos >= len(prompt):
                break
            if pos == len(got):
                lp = {prompt[pos]: e.sampled_logprob}
                lp.update(zip(e.top_token_ids, e.top_logprobs))
                got.append(lp)

    def _append_tokens(self, req: Request, row, now: float) -> SequenceUpdate:
        """Append a row's tokens up to the first that finishes the request (the rest, accepted
        drafts past a stop, are dropped)."""
        params, outs = req.params, req.output_token_ids
        start = len(outs)
        room = self.max_model_len - len(req.prompt_token_ids)  # outputs that fit the context
        lps: list[dict[int, float]] | None = [] if req.logprobs is not None and row.logprobs else None
        reason = stop_reason = None
        n = 0
        for tok in row.token_ids:
            if req.grammar is not None and not req.grammar.accept(tok):
                # (the mask allows only accepted tokens: a bug, reported; the token is dropped and
                # the request ends before it)
                logger.error("request %s: token %d breaks its structured_outputs constraint", req.request_id, tok)
                reason = "stop"
                self.finish(req, reason)
                break
            outs.append(tok)
            if lps is not None:
                tl = row.logprobs[n]
                lp = {tok: tl.sampled_logprob}
                lp.update(zip(tl.top_token_ids, tl.top_logprobs))
                req.logprobs.append(lp)
                req.cumulative_logprob += tl.sampled_logprob
                lps.append(lp)
            n += 1
            n_out = start + n
            if n_out >= params.min_tokens:
                if tok in req.eos_token_ids:
                    reason = "stop"
                elif tok in params.stop_token_ids or tok in req.extra_stop_ids:
                    reason, stop_reason = "stop", tok
            if reason is None and req.grammar is not None and req.grammar.terminated:
                reason = "stop"  # the constraint is complete (on one of the request's EOS ids)
            if reason is None and (n_out >= req.max_tokens or n_out >= room):
                reason = "length"
            if reason is not None:
                self.finish(req, reason, stop_reason)
                break
        if req.first_token_time is None:
            req.first_token_time = now
        req.last_token_time = now
        tokens = row.token_ids if n == len(row.token_ids) else row.token_ids[:n]
        return SequenceUpdate(req, start, tokens, lps, reason, stop_reason)

    def finish_at_stop_string(self, req: Request, num_outputs: int, stop: str) -> int:
        """The engine found stop string ``stop`` in the text of the first ``num_outputs`` output
        tokens: later tokens (accepted drafts of the same step) are dropped and the request
        finishes with ``stop`` (replacing a finish by a later token or by length). Returns the
        number of tokens dropped. Under async scheduling one more step may already be in flight
        for it; its tokens are dropped when they arrive and its blocks are freed as usual."""
        outs = req.output_token_ids
        dropped = len(outs) - num_outputs
        if dropped > 0:
            if req.logprobs is not None:
                for lp, tok in zip(req.logprobs[num_outputs:], outs[num_outputs:]):
                    req.cumulative_logprob -= lp[tok]
                del req.logprobs[num_outputs:]
            del outs[num_outputs:]
        if req.finished:
            req.finish_reason, req.stop_reason = "stop", stop
        else:
            self.finish(req, "stop", stop)
        return max(dropped, 0)

    def _commit_blocks(self, step: ScheduledStep, kv_written: dict[int, int]) -> None:
        """Commit every full block whose tokens are all confirmed. ``kv_written`` maps a
        speculative row's handle to the tokens whose KV it really wrote (1 + accepted drafts);
        other rows wrote ``num_scheduled_tokens``. Rows of a placement that was preempted or
        freed since are ignored (their KV is gone with the placement). Then the blocks of
        requests this result finished are freed (after their commit)."""
        if self.blocks.caching:
            bs = self.blocks.block_size
            for row, req in zip(step.plan.rows, step.row_requests):
                if req.kv_handle != row.handle:
                    continue
                req.num_confirmed_kv += kv_written.get(row.handle, row.num_scheduled_tokens)
                confirmed = min(req.num_confirmed_kv, req.num_known_tokens)
                if confirmed // bs > req.num_committed_blocks:  # a block was completed
                    self.blocks.commit(req, confirmed)
        self._flush_deferred()

    def prefix_cache_stats(self) -> dict:
        """Token-level queries and hits of placed requests, hit rate, cached blocks, evictions."""
        return self.blocks.stats()


def _insert_sorted(queue, req: Request) -> None:
    """Insert ``req`` into ``queue`` (a deque or list kept sorted by (priority, order)) after
    every entry that goes before it."""
    key = (req.priority, req.order)
    i = len(queue)
    while i > 0 and (queue[i - 1].priority, queue[i - 1].order) > key:
        i -= 1
    queue.insert(i, req)
