"""The worker's step thread: keeps the device fed while results travel back.

Plans arrive in order (one per driver call). The thread launches a plan as soon
as it is available, even while the previous step's sampled-token copy is still
in flight; it polls that copy's event (``query()`` never blocks) and reports a
step only once its copy is complete. So with the driver one step ahead, the
device starts step N+1 before step N's result has even left the worker.
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
        self._thread = threading.Thread(target=self._run, name=f"step-loop-{rank}", daemon=True)
        self._stop = False
        self._thread.start()

    def submit(self, plan_bytes: bytes) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.inbox.put((plan_bytes, fut))
        return fut

    def stop(self) -> None:
        self._stop = True
        self.inbox.put(None)

    def _launch(self, plan_bytes: bytes):
        plan = decode_plan(plan_bytes)
        if plan.step_id <= self._last_step:
            raise RuntimeError(f"plan {plan.step_id} arrived after plan {self._last_step}: out of order")
        self._last_step = plan.step_id
        with self.sync_check.armed():
            return plan.step_id, self.runner.launch(plan)

    def _error(self, step_id: int, exc: BaseException) -> bytes:
        logger.exception("step %d failed on rank %d", step_id, self.rank)
        return encode(StepResult(step_id=step_id, rank=self.rank,
                                 error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}"))

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
                plan_bytes, fut = item
                try:
                    step_id, pending = self._launch(plan_bytes)
                    launched.append((step_id, pending, fut))
                except Exception as exc:  # reported to the driver
                    fut.set_result(self._error(-1, exc))
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
