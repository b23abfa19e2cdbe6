"""``workers.host_staging``: reused pinned buffers never overwritten while a copy reads them."""

import time

import pytest
import torch

from workers.host_staging import MIN_BUFFER_BYTES, PinnedStaging

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")


def test_round_trip_of_every_dtype_and_size():
    s = PinnedStaging(DEV)
    g = torch.Generator().manual_seed(0)
    cases = [
        torch.randint(-(2**40), 2**40, (37,), dtype=torch.int64, generator=g),
        torch.randn(5, 7, generator=g),
        torch.randint(0, 2, (13,), generator=g).bool(),
        torch.randint(0, 100, (3 * MIN_BUFFER_BYTES // 4,), dtype=torch.int32, generator=g),  # larger than a buffer
        torch.arange(12, dtype=torch.int64).view(3, 4).t(),  # not contiguous
        torch.empty(0, dtype=torch.int64),
    ]
    outs = [s.copy(t) for t in cases]
    torch.cuda.synchronize()
    for t, out in zip(cases, outs):
        assert out.device.type == "cuda" and out.dtype == t.dtype and out.shape == t.shape
        assert torch.equal(out.cpu(), t)


def test_a_buffer_in_flight_is_never_reused_and_copies_never_wait():
    """The device is kept busy far longer than the copies take to enqueue: every copy is
    still pending when the next one is staged, so reusing a buffer would overwrite data
    a pending copy has yet to read."""
    s = PinnedStaging(DEV)
    torch.cuda.synchronize()
    cycles = 200_000_000
    torch.cuda._sleep(cycles)  # (about 100 ms on an H100)
    t0 = time.perf_counter()
    srcs = [torch.full((1000,), i, dtype=torch.int64) for i in range(24)]
    outs = [s.copy(x) for x in srcs]
    host_s = time.perf_counter() - t0
    made = s.buffers_made
    torch.cuda.synchronize()
    for i, out in enumerate(outs):
        assert torch.equal(out.cpu(), srcs[i]), f"copy {i} read a buffer overwritten by a later one"
    assert made == len(srcs), "a buffer was reused while its copy was still pending"
    assert host_s < 0.02, f"staging 24 copies took {host_s * 1e3:.1f} ms: a copy waited for the device"
    # once the device has caught up, the same buffers serve again
    outs = [s.copy(x) for x in srcs]
    torch.cuda.synchronize()
    assert s.buffers_made == made
    assert all(torch.equal(o.cpu(), x) for o, x in zip(outs, srcs))


def test_copies_into_one_fixed_buffer_arrive_in_stream_order():
    """``copy_into`` (the input graphs' stage): copies into the same device buffer behind a busy
    device, each read by a kernel enqueued before the next copy, see their own data (stream
    order), never wait on the host, and a mismatched destination is refused."""
    s = PinnedStaging(DEV)
    stage = torch.zeros(1000, dtype=torch.int64, device=DEV)
    seen = torch.zeros(16, 1000, dtype=torch.int64, device=DEV)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    t0 = time.perf_counter()
    for i in range(16):
        s.copy_into(torch.full((1000,), i, dtype=torch.int64), stage)
        seen[i].copy_(stage)  # (a reader of this step's words, before the next copy)
    host_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    assert torch.equal(seen.cpu(), torch.arange(16)[:, None].expand(16, 1000)), "a copy overwrote unread words"
    assert host_s < 0.02, f"16 copies took {host_s * 1e3:.1f} ms: a copy waited for the device"
    with pytest.raises(ValueError, match="must match"):
        s.copy_into(torch.zeros(10, dtype=torch.int64), stage)
    with pytest.raises(ValueError, match="must match"):
        s.copy_into(torch.zeros(1000, dtype=torch.int32), stage)
