"""The worker's step loop runs plans in their prev_step_id chain, whatever order calls arrive in."""

from metadata.wire import StepPlan, StepResult, decode_result, encode
from workers.step_loop import StepLoop
from workers.sync_check import SyncCheck


class _Pending:
    def __init__(self, step_id):
        self.step_id = step_id

    def ready(self):
        return True


class _FakeRunner:
    def __init__(self):
        self.order = []

    def launch(self, plan):
        self.order.append(plan.step_id)
        return _Pending(plan.step_id)

    def finish(self, pending):
        return StepResult(step_id=pending.step_id)


def _plan(step, prev):
    return encode(StepPlan(step_id=step, prev_step_id=prev))


def test_out_of_order_calls_run_in_chain_order():
    runner = _FakeRunner()
    loop = StepLoop(runner, SyncCheck("off"), rank=0)
    try:
        futs = {s: loop.submit(_plan(s, p)) for s, p in [(3, 2), (1, 0), (4, 3), (2, 1)]}
        results = {s: decode_result(f.result(timeout=5)).step_id for s, f in futs.items()}
        assert results == {1: 1, 2: 2, 3: 3, 4: 4}
        assert runner.order == [1, 2, 3, 4]
        # a restarted engine starts a new chain at prev_step_id 0
        f = loop.submit(_plan(10, 0))
        assert decode_result(f.result(timeout=5)).step_id == 10
        assert runner.order[-1] == 10
    finally:
        loop.stop()
