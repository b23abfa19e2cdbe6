"""What each kernel adds to a profiled step's span (its critical-path share).

A profiler's per-kernel durations mislead under programmatic dependent launch (PDL): a
kernel starts while its predecessor still runs and waits inside, so its duration counts
the predecessor's tail again, and the durations sum to more than the step. Here each
kernel is charged only the time by which it moved the step's end: ``end - max(start,
latest end before it)`` when positive. The charges plus the idle gaps sum exactly to the
span from the first kernel's start to the last kernel's end.
"""

from __future__ import annotations

from typing import Any, Iterable


def exposed_time(kernels: Iterable[tuple[str, float, float]]) -> dict[str, Any]:
    """``kernels``: (name, start_us, end_us) of one device stream's kernels, any order.

    Returns ``{"span_us", "idle_us", "by_name": {name: {"exposed_us", "duration_us",
    "calls"}}}``; ``exposed_us`` is how much that kernel's calls extended the span, ``idle_us``
    the time no kernel ran."""
    rows = sorted(kernels, key=lambda k: (k[1], k[2]))
    by_name: dict[str, dict[str, float]] = {}
    if not rows:
        return {"span_us": 0.0, "idle_us": 0.0, "by_name": by_name}
    latest = rows[0][1]
    idle = 0.0
    for name, start, end in rows:
        if end < start:
            raise ValueError(f"kernel {name!r} ends ({end}) before it starts ({start})")
        if start > latest:
            idle += start - latest
        added = max(0.0, end - max(start, latest))
        latest = max(latest, end)
        r = by_name.setdefault(name, {"exposed_us": 0.0, "duration_us": 0.0, "calls": 0})
        r["exposed_us"] += added
        r["duration_us"] += end - start
        r["calls"] += 1
    return {"span_us": latest - rows[0][1], "idle_us": idle, "by_name": by_name}


def profiler_kernels(prof) -> list[tuple[str, float, float]]:
    """(name, start_us, end_us) of the device kernels a ``torch.profiler.profile`` recorded
    (CUDA graph replays included); empty on a CPU-only run."""
    out = []
    for ev in prof.events():
        if "CUDA" not in str(getattr(ev, "device_type", "")):
            continue
        tr = ev.time_range
        out.append((ev.name[:120], float(tr.start), float(tr.end)))
    return out


def exposed_per_step(kernels: list[tuple[str, float, float]], steps: int, top: int = 40) -> dict:
    """``exposed_time`` per step: the kernels sorted by the span they add, and the idle time."""
    t = exposed_time(kernels)
    steps = max(1, steps)
    rows = [
        {
            "name": n,
            "exposed_us_per_step": r["exposed_us"] / steps,
            "duration_us_per_step": r["duration_us"] / steps,
            "calls_per_step": r["calls"] / steps,
        }
        for n, r in t["by_name"].items()
    ]
    rows.sort(key=lambda r: -r["exposed_us_per_step"])
    return {
        "span_us_per_step": t["span_us"] / steps,
        "idle_us_per_step": t["idle_us"] / steps,
        "exposed_top": rows[:top],
    }
