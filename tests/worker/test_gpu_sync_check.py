"""The sync check sees what PyTorch's sync-debug mode cannot: the caching allocator freeing
its cache (``cudaFree`` waits for the device) to satisfy an allocation inside a step, and
(its launch audit) pageable host-to-device copies and steps over the launch budget."""

import pytest
import torch

from workers.sync_check import SyncCheck, SyncError

pytestmark = pytest.mark.gpu


def test_allocator_retry_inside_a_step_is_an_error():
    torch.cuda.init()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    mib = 1 << 20
    limit = torch.cuda.memory_allocated() + 256 * mib
    torch.cuda.set_per_process_memory_fraction(limit / total)
    try:
        x = torch.empty(200 * mib, dtype=torch.uint8, device="cuda")
        del x  # a cached 200 MiB segment: the next, larger block fits only once it is freed
        check = SyncCheck("error")
        with pytest.raises(SyncError, match="caching allocator"):
            with check.armed():
                y = torch.empty(220 * mib, dtype=torch.uint8, device="cuda")
        del y
        warn = SyncCheck("warn")
        z = torch.empty(16 * mib, dtype=torch.uint8, device="cuda")  # fits: no retry, no report
        with warn.armed():
            z.add_(1)
        assert warn.reports == []
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


def test_launch_audit_on_the_device():
    """A pageable host-to-device copy is an error and a pinned one is not; Triton launches count
    towards the launch budget as aten operators do; a graph replay is one call, not its nodes."""
    from kernels import ops

    dev = torch.empty(1024, device="cuda")
    pageable, pinned = torch.ones(1024), torch.ones(1024).pin_memory()
    check = SyncCheck("error", device_type="cuda", launch_budget=4)
    with pytest.raises(SyncError, match="pageable memory"):
        with check.armed():
            dev.copy_(pageable, non_blocking=True)
    with check.armed():
        dev.copy_(pinned, non_blocking=True)
    x = torch.randn(4, 256, device="cuda")
    ops.argmax(x)  # compiled outside the check
    with pytest.raises(SyncError, match=r"enqueued \d+ device operations.*triton x(5|10)\b"):
        with check.armed():
            for _ in range(5):
                ops.argmax(x)  # (one or two Triton launches each, no aten operator)
    g = torch.cuda.CUDAGraph()
    y = torch.zeros(16, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        for _ in range(50):
            y.add_(1)
    with check.armed():
        g.replay()
    torch.cuda.synchronize()
