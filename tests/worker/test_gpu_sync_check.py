"""The sync check sees what PyTorch's sync-debug mode cannot: the caching allocator freeing
its cache (``cudaFree`` waits for the device) to satisfy an allocation inside a step."""

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
