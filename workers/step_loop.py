"""The worker's step thread: keeps the device fed while results travel back.

Plans arrive in order (one per driver call). The thread launches a plan as soon
as it is available, even while the previous step's sampled-token copy is still
in flight; it polls that copy's event (``query()`` never blocks) and reports a
step only once its copy is complete. So with the driver one step ahead, the
device starts step N+1 before step N's result has even left the worker.

Results may complete out of turn: a launch that fails sets its step's error at
once, while the step before it may still wait for its copy. The step channel
(``workers.step_channel``) sends them back in the plans' order regardless.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import queue
import threading
import time
import traceback

from metadata.wire import StepResult, decode_plan, encode

logger = logging.getLogger(__name__)


class StepLoop:
    def __init__(self, runner, sync_check, rank: int, max_launched: int = 2):
        self.runner = runner
        self.sync_check = sync_check
        self.rank = rank
        self.max_launched = max_launched
        self.inbox: queue.Queue = queue.Queue()
        self._last_step = 0
        self._order_lock = threading.Lock()
        self._waiting: dict[int, tuple] = {}  # prev_step_id -> (plan, future)
        self._released = 0  # step id of the last plan handed to the step thread
        self._thread = threading.Thread(target=self._run, name=f"step-loop-{rank}", daemon=True)
        self._stop = False
        self._thread.start()

    def submit(self, plan_bytes: bytes) -> concurrent.futures.Future:
        """Queue a plan; plans are released to the step thread in ``prev_step_id`` order."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        plan = decode_plan(plan_bytes)
        with self._order_lock:
            if plan.prev_step_id == 0:
                self._released = 0  # the first plan of a (re)started engine
            self._waiting[plan.prev_step_id] = (plan, fut)
            while self._released in self._waiting:
                item = self._waiting.pop(self._released)
                self._released = item[0].step_id
                self.inbox.put(item)
        return fut

    def stop(self) -> None:
        self._stop = True
        self.inbox.put(None)

    def _launch(self, plan):
        self._last_step = plan.step_id
        with self.sync_check.armed():
            return plan.step_id, self.runner.launch(plan)

    def _error(self, step_id: int, exc: BaseException) -> bytes:
        logger.exception("step %d failed on rank %d", step_id, self.rank)
        return encode(
            StepResult(
                step_id=step_id, rank=self.rank, error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}"
            )
        )

    def _run(self) -> None:
        launched: collections.deque = collections.deque()  # (step_id, pending, future)
        while not self._stop:
            item = None
            if len(launched) < self.max_launched:
                try:
                    item = self.inbox.get(timeout=None if not launched else 0)
                except queue.Empty:
                    item = None
            if item is None and self._stop:
                break
            if item is not None:
                plan, fut = item
                try:
                    step_id, pending = self._launch(plan)
                    launched.append((step_id, pending, fut))
                except Exception as exc:  # reported to the driver
                    fut.set_result(self._error(plan.step_id, exc))
                continue
            step_id, pending, fut = launched[0]
            if not pending.ready():
                if len(launched) < self.max_launched and not self.inbox.empty():
                    continue  # a new plan arrived: launch it before reporting
                time.sleep(20e-6)
                continue
            launched.popleft()
            try:
                fut.set_result(encode(self.runner.finish(pending)))
            except Exception as exc:
                fut.set_result(self._error(step_id, exc))
