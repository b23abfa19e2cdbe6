"""The sync check's launch audit (``workers.launch_audit``) on the CPU: the counting and the
copy check run through the same dispatch mode as on a GPU, audited on the ``cpu`` device (for
the count) and on the ``meta`` device standing in for device memory (for the copy check: a
CPU-only torch has no pinned memory and no CUDA tensors). What only a GPU shows (Triton
launches counted, a pinned copy accepted): ``test_gpu_sync_check.py``."""

import pytest
import torch

from workers.launch_audit import LAUNCH_BUDGET
from workers.sync_check import SyncCheck, SyncError, allow_sync


X = torch.zeros(4)


def _adds(n: int) -> None:
    for _ in range(n):
        X.add_(1)


def test_a_step_over_the_launch_budget_is_an_error_naming_its_operators():
    check = SyncCheck("error", device_type="cpu", launch_budget=10)
    with check.armed():
        _adds(10)  # at the budget: fine
    with pytest.raises(SyncError, match=r"enqueued 11 device operations .*budget 10.*add_ x11"):
        with check.armed():
            _adds(11)


def test_views_and_allocations_are_not_launches():
    check = SyncCheck("error", device_type="cpu", launch_budget=3)
    with check.armed():
        x = torch.empty(64)
        for i in range(50):
            y = x.view(8, 8)[1:].t().unsqueeze(0).expand(2, -1, -1)  # views only
            torch.empty_like(y)
            x.detach()
        y.fill_(0.0)


def test_warn_mode_reports_and_goes_on():
    check = SyncCheck("warn", device_type="cpu", launch_budget=2)
    with check.armed():
        _adds(5)
    assert len(check.reports) == 1 and "enqueued 5 device operations" in check.reports[0]


def test_other_devices_and_unaudited_checks_are_not_counted():
    with SyncCheck("error", device_type="meta", launch_budget=1).armed():
        _adds(20)  # CPU work, the meta device audited
    with SyncCheck("error", launch_budget=1).armed():  # no device type: no audit (a CPU worker)
        _adds(20)
    with SyncCheck("off", device_type="cpu", launch_budget=1).armed():
        _adds(20)
    # no budget (a worker whose forwards run eagerly by design): pageable copies only
    check = SyncCheck("error", device_type="meta", launch_budget=None)
    with check.armed():
        torch.zeros(4, device="meta").add_(1)
    with pytest.raises(SyncError, match="pageable"):
        with check.armed():
            torch.empty(4, device="meta").copy_(torch.ones(4))


@pytest.mark.parametrize("how", ["copy_", "to"])
def test_a_pageable_host_to_device_copy_is_an_error(how):
    check = SyncCheck("error", device_type="meta", launch_budget=LAUNCH_BUDGET)
    host = torch.arange(6.0)
    dev = torch.empty(6, device="meta")
    with pytest.raises(SyncError, match="pageable memory"):
        with check.armed():
            dev.copy_(host, non_blocking=True) if how == "copy_" else host.to("meta", non_blocking=True)
    with check.armed():
        with allow_sync("a deliberate copy (test)"):
            dev.copy_(host)
        dev.copy_(dev)  # device to device: no host source
        host.clone()  # host to host
    warn = SyncCheck("warn", device_type="meta")
    with warn.armed():
        dev.copy_(host)
    assert len(warn.reports) == 1 and "pageable" in warn.reports[0]


def test_a_real_cpu_step_stays_within_the_budget(ckpt_dir):
    """A CPU engine's steps, audited as if the CPU had a launch queue, stay under the budget
    (the reference kernels are eager torch: far more operators than a CUDA step outside its
    graphs), so the budget leaves room for what a step legitimately does."""
    from metadata.config import EngineConfig
    from metadata.wire import NewRequest, SamplingOptions, ScheduledRow, StepPlan
    from workers.distributed import TPGroup
    from workers.model_runner import ModelRunner

    cfg = EngineConfig.from_options(num_kv_blocks=64, block_size=8, max_num_seqs=4)
    r = ModelRunner(cfg, str(ckpt_dir("llama")), torch.device("cpu"), TPGroup(), 256)
    r.init_kv_cache(64)
    greedy = SamplingOptions(0.0, 1.0, 0, 0.0, 0, 1.0, 0.0, 0.0, 0, [], -1)
    new = [NewRequest.of(h, [3 + h + i for i in range(9)], [], greedy, [h * 2, h * 2 + 1]) for h in range(4)]
    check = SyncCheck("error", device_type="cpu")
    with check.armed():
        r.execute(StepPlan(1, new_requests=new, rows=[ScheduledRow(h, 9, 9, [], True) for h in range(4)]))
    with check.armed():
        r.execute(StepPlan(2, rows=[ScheduledRow(h, 1, 10, [], True) for h in range(4)]))
    assert check.reports == []
