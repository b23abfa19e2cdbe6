"""Grid-wide barriers for persistent kernels (every program resident at once).

A persistent kernel that runs several dependent phases in one launch (``kernels.decode_layer``)
separates them with ``grid_barrier``: each program publishes its stores (a CTA barrier, then
one acq_rel arrival on a counter at GPU scope, as ``kernels.paged_attention``'s split merge
does), then spins until all ``P`` programs have arrived. That is only safe when all ``P``
programs are resident together: the grid must not exceed what the device holds at once
(one program an SM here), or the spinning programs wait forever for one that cannot start.

Counters re-arm themselves: after the last phase every program bumps an exit counter, and the
program that arrives last (all others are past every barrier by then) zeroes them all for
the next launch or CUDA-graph replay. Data one program stores and another reads after a
barrier must be loaded with ``cache_modifier=".cg"`` (L2, the coherence point), never from
a possibly stale L1 line.

The Triton interpreter runs programs one after another, so a spin barrier would never
release there: interpreted callers launch each phase separately instead (``ENABLED=False``
compiles the barrier out).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_COUNTERS: dict[tuple, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # kept alive: a captured graph may still use an old buffer


MAX_SPINS = tl.constexpr(1 << 20)  # polls (~1 s) before a barrier gives up: never legitimate


@triton.jit
def load_acquire(ptr):
    """``*ptr`` (int32) with acquire semantics at GPU scope (PTX ``ld.acquire.gpu``) after a
    short back-off (``nanosleep``): a plain load, so pollers neither queue in L2's atomic
    unit behind the arrivals they wait for nor flood the counter's line."""
    return tl.inline_asm_elementwise("nanosleep.u32 20; ld.acquire.gpu.global.b32 $0, [$1];",
                                     "=r,l", [ptr], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def grid_barrier(bar_ptr, target, err_ptr, ENABLED: tl.constexpr,
                 POLL_LOAD: tl.constexpr = False):
    """Arrive at counter ``bar_ptr`` and leave once it reaches ``target`` (``P`` for a fresh
    counter; ``k * P`` at the k-th use of one counter): every program's earlier stores are
    then visible (read them with ``.cg`` loads).

    A watchdog: a program that polls ``MAX_SPINS`` times in vain (some program never
    arrived: more programs than the device holds at once) adds 1 to ``err_ptr`` and goes
    on, so the launch ends with wrong results and a sticky error count
    (``barrier_timeouts``) instead of hanging the device. ``POLL_LOAD``: poll with acquire
    loads (``load_acquire``) instead of atomic adds of 0; each thread then polls for itself
    and warps may leave at different polls, so the error count is added without a branch
    (a scalar atomic inside a divergent branch would split the program's barriers)."""
    if ENABLED:
        tl.debug_barrier()  # every thread's stores precede the release below
        seen = tl.atomic_add(bar_ptr, 1, sem="acq_rel", scope="gpu") + 1
        spins = 0
        while (seen < target) & (spins < MAX_SPINS):
            if POLL_LOAD:
                seen = load_acquire(bar_ptr)
            else:
                seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
            spins += 1
        tl.debug_barrier()
        tl.atomic_add(err_ptr, (seen < target).to(tl.int32), sem="relaxed")  # no branch: see above


@triton.jit
def stamp(prof_ptr, pid, k: tl.constexpr, ENABLED: tl.constexpr):
    """Profiling: program ``pid``'s ``k``-th timestamp, ns (``%globaltimer``: comparable across
    SMs) at ``[pid, k]`` and SM clock cycles (``%clock64``) at ``[pid, 16 + k]`` of an int64
    ``[P, 32]`` buffer."""
    if ENABLED:
        ns = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [pid],
                                       dtype=tl.int64, is_pure=False, pack=1)
        cyc = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [pid],
                                        dtype=tl.int64, is_pure=False, pack=1)
        tl.store(prof_ptr + pid * 32 + k, ns)
        tl.store(prof_ptr + pid * 32 + 16 + k, cyc)


@triton.jit
def rearm_counters(bar_ptr, exit_idx, P, N_COUNTERS: tl.constexpr, ENABLED: tl.constexpr):
    """After the last barrier: the last program out zeroes counters ``0 .. N_COUNTERS - 1``
    and the exit counter ``exit_idx`` (every other program is past all barriers)."""
    if ENABLED:
        tl.debug_barrier()
        out = tl.atomic_add(bar_ptr + exit_idx, 1, sem="acq_rel", scope="gpu")
        if out == P - 1:
            for i in tl.static_range(N_COUNTERS):
                tl.atomic_xchg(bar_ptr + i, 0)
            tl.atomic_xchg(bar_ptr + exit_idx, 0)


ERROR_INDEX = 0  # counter buffers from ``counters``: entry 0 counts barrier timeouts (sticky)


def barrier_timeouts(device: torch.device) -> int:
    """Barrier timeouts on ``device`` so far (``counters``' error entry; synchronises: for
    tests and health checks, never the hot path)."""
    key = (device.type, device.index if device.index is not None else -1)
    buf = _COUNTERS.get(key)
    return 0 if buf is None else int(buf[ERROR_INDEX])


def counters(device: torch.device, n: int) -> torch.Tensor | None:
    """A zeroed int32 counter buffer for ``device``: entry ``ERROR_INDEX`` (0) counts barrier
    timeouts, entries ``1 .. n`` are the caller's; kept across launches (the kernels re-arm
    their counters) and shared by every caller on the device (one launch at a time, on one
    stream). None while a CUDA graph is being captured and no
    big enough buffer exists yet (allocating then would tie it to the graph's pool): the
    caller then takes its multi-launch path."""
    key = (device.type, device.index if device.index is not None else -1)
    buf = _COUNTERS.get(key)
    if buf is not None and buf.numel() >= n + 1:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    if buf is not None:
        _RETIRED.append(buf)
    buf = torch.zeros(max(n + 1, 64), dtype=torch.int32, device=device)
    _COUNTERS[key] = buf
    return buf
