"""A launch never waits for the device, in every scheduling mode (the busy-wait check).

Each worker enqueues a 150 ms GPU busy-wait just before every step's launch; a launch that
does not wait for the device returns long before the wait ends. ``sync_check="error"`` is
on too, but it cannot see a full launch queue, a pageable copy or allocator growth: only
this timing can. Real model shape (Qwen3-0.6B, 28 layers, random weights): a tiny model
launches too few kernels to fill the device's launch queue.
"""

import pytest

from benchmarks.launch_wait import MODES, run_mode, summarize
from benchmarks.shapes import resolve_model

pytestmark = pytest.mark.gpu

WAIT_MS = 150.0


def describe_launch(run: dict, i: int) -> str:
    """Launch ``i``'s kind, wall and thread-CPU ms and its longest phase: CPU close to the wall
    time is host work (a first use, a compile), CPU far below it a wait (the device, a lock)."""
    from workers.model_runner import LAUNCH_PHASES

    mixed, *phases = run["launch_phases_ms"][i]
    _, wall, cpu = run["launch_cpu_ms"][i]
    top = max(range(len(phases)), key=phases.__getitem__)
    return (
        f"#{i} {'mixed' if mixed else 'decode'} {wall:.1f} ms (thread CPU {cpu:.1f} ms; "
        f"{LAUNCH_PHASES[top]} {phases[top]:.1f} ms)"
    )


@pytest.mark.parametrize("mode", MODES)
def test_launch_returns_long_before_the_device_is_free(mode):
    model, fmt = resolve_model(None, "qwen3-0.6b")
    run = run_mode(mode, model, fmt, WAIT_MS)
    row = summarize(run)
    assert row["launches"] >= 20, row
    slow = [describe_launch(run, i) for i, x in enumerate(run["launch_ms"]) if x > WAIT_MS / 4]
    assert not slow, (
        f"{mode}: {len(slow)} of {row['launches']} launches took over {WAIT_MS / 4} ms: {slow[:8]}; Triton "
        f"variants after start-up: {run['kernel_variants_after_start']} {run['kernel_variants_first']}"
    )
    if mode == "async+preempt":
        assert row["preemptions"] > 0, "the KV budget was meant to force preemption"
    assert row["mixed_graph_replays"] > 0  # the prefill and mixed steps replayed mixed-step graphs
