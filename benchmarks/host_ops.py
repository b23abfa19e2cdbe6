"""What the launch path's primitives cost the host, with the device idle and busy.

    python -m benchmarks.host_ops [--busy-ms 2] [--calls 200] [--output host_ops.json]

A launch is made of a few kinds of host calls: a host-to-device staging copy
(``workers.host_staging``), small torch CUDA operators, Triton launches (through
``kernels.fast_launch`` and through Triton's own path) and event records. On an H100 host a
staging copy measured ~100 µs inside served launches and ~13 µs with the device idle, and a
Triton launch 50-100 µs (``benchmarks.launch_sections``); this times each primitive and each
part of a staging copy alone, with nothing else running, idle and behind a GPU busy-wait
(``torch.cuda._sleep`` before each call), to say which one pays. Median µs of ``--calls`` calls; GPU only.
"""

from __future__ import annotations

import argparse
import statistics
import time


def _timed(fn, calls: int) -> float:
    out = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out) * 1e6


def primitives(dev) -> dict:
    """name -> a zero-argument call (state made once, outside the timing)."""
    import torch

    from kernels.place import place_requests_triton
    from workers.host_staging import PinnedStaging

    staging = PinnedStaging(dev)
    host = torch.arange(128, dtype=torch.int64)  # 1 KB: a decode step's packed inputs
    pinned = torch.empty(host.numel() * 8, dtype=torch.uint8, pin_memory=True)
    x = torch.zeros(1024, device=dev)
    ev = torch.cuda.Event()
    rows, vocab, width = 8, 1000, 64
    state = (
        torch.zeros(rows, width, dtype=torch.int64, device=dev),  # token ids
        torch.zeros(rows, dtype=torch.int32, device=dev),  # num_computed
        torch.zeros(rows, dtype=torch.int32, device=dev),  # prompt_len
        torch.zeros(rows, vocab, dtype=torch.bool, device=dev),  # prompt mask
        torch.zeros(rows, vocab, dtype=torch.int32, device=dev),  # output counts
        torch.zeros(10, rows, dtype=torch.int64, device=dev),  # option table
    )
    tok = torch.arange(16, device=dev)  # 16 prompt tokens of row 0, in columns 0-15
    trow = torch.zeros(16, dtype=torch.int64, device=dev)
    one = torch.zeros(1, dtype=torch.int64, device=dev)
    words = torch.zeros(10, dtype=torch.int64, device=dev)

    def place():
        place_requests_triton(*state, tok, trow, tok, 16, one, one, tok[:1], words)

    return {
        "staging copy, 1 KB (PinnedStaging.copy)": lambda: staging.copy(host),
        "  torch.empty on the device": lambda: torch.empty(1024, dtype=torch.uint8, device=dev),
        "  pinned -> device copy_ (non_blocking)": lambda: torch.empty(1024, dtype=torch.uint8, device=dev).copy_(
            pinned, non_blocking=True
        ),
        "  event record on the current stream": lambda: ev.record(torch.cuda.current_stream(dev)),
        "  event query": ev.query,
        "  is_current_stream_capturing": torch.cuda.is_current_stream_capturing,
        "small torch op (add_)": lambda: x.add_(1),
        "Triton launch, fast path (placement kernel)": place,
    }


def measure(busy_ms: float, calls: int) -> dict:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.host_ops times CUDA calls: it needs a GPU")
    dev = torch.device("cuda", torch.cuda.current_device())
    prims = primitives(dev)
    for fn in prims.values():  # first uses (compiles, allocations, lazy loads) outside the timing
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    cycles = int(busy_ms * 10_000_000 / start.elapsed_time(end))

    def behind_a_wait(fn):  # one call queued behind a fresh busy-wait: at most one call in flight
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        return fn

    rows = {}
    for name, fn in prims.items():
        torch.cuda.synchronize()
        idle = _timed(fn, calls)
        busy = statistics.median(_timed(behind_a_wait(fn), 1) for _ in range(calls))
        torch.cuda.synchronize()
        rows[name] = {"idle_us": idle, "busy_us": busy}
    return {"device": torch.cuda.get_device_name(), "busy_ms": busy_ms, "calls": calls, "us": rows}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.host_ops", description=__doc__.split("\n\n")[0])
    p.add_argument("--busy-ms", type=float, default=2.0, help="GPU busy-wait each busy call queues behind")
    p.add_argument("--calls", type=int, default=200, help="calls timed a primitive and column (median)")
    p.add_argument("--output", default=None, help="write the table as JSON here")
    a = p.parse_args(argv)
    if a.busy_ms <= 0 or a.calls < 1:
        p.error("--busy-ms must be positive and --calls at least 1")
    res = measure(a.busy_ms, a.calls)
    print(f"host µs a call on {res['device']} (median of {a.calls}; busy: behind a {a.busy_ms:g} ms busy-wait)")
    print("| primitive | idle | busy |\n|---|---|---|")
    for name, r in res["us"].items():
        print(f"| {name} | {r['idle_us']:.1f} | {r['busy_us']:.1f} |")
    if a.output:
        from pathlib import Path

        from benchmarks.common import write_json

        write_json(Path(a.output), res)
    return res


if __name__ == "__main__":
    main()
