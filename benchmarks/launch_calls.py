"""What a step's launch enqueues: CUDA runtime calls per launch, and the longest one.

A launch that waits for the device (``benchmarks.launch_wait``) blocks inside one runtime
call: a kernel launch, a copy or a memset issued while the device's launch queue (about
1,000 entries on a Hopper GPU) is full. This profiles every step's launch inside the worker
(``torch.profiler`` around ``ModelRunner._enqueue``, started and stopped on the launching
thread) and prints, per launch, the kernel launches, graph launches, copies and memsets it
issued and its longest runtime call, separately for decode steps and for steps that place
prompt tokens (prefill or mixed); with ``--wait-ms`` a GPU busy-wait precedes each launch,
as in ``benchmarks.launch_wait``, so the waits show where they happen.

    python -m benchmarks.launch_calls --shape qwen3-0.6b --modes async+draft,async+ngram --wait-ms 100
"""

from __future__ import annotations

import argparse
import json
import statistics

from benchmarks.launch_wait import MODES, mode_options, rich_sampling, workload
from benchmarks.shapes import resolve_model

KINDS = {"kernels": "LaunchKernel", "graphs": "GraphLaunch", "copies": "Memcpy", "memsets": "Memset"}


def _arm(actor, launches: int) -> None:
    """(On the worker.) Profile the next ``launches`` launches of rows, on the step thread."""
    from torch.profiler import ProfilerActivity, profile, record_function

    runner, state = actor.runner, {"n": 0, "rows": None, "prof": None, "kinds": []}
    actor._launch_calls = state
    inner = runner._enqueue

    def enqueue(plan, t0):
        if not plan.rows or state["n"] >= launches:
            return inner(plan, t0)
        if state["n"] == 0:
            state["prof"] = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            state["prof"].__enter__()
        state["n"] += 1
        state["kinds"].append(step_kind(plan))
        with record_function(f"launch#{state['n']}"):
            out = inner(plan, t0)
        if state["n"] == launches:
            state["rows"] = _summarise(state.pop("prof"), state["kinds"])
        return out

    runner._enqueue = enqueue


def step_kind(plan) -> str:
    """``mixed`` when a row places prompt tokens (more than its one new token and drafts),
    else ``decode``."""
    prompt = any(r.num_scheduled_tokens > 1 + r.num_draft_tokens for r in plan.rows)
    return "mixed" if prompt else "decode"


def _summarise(prof, kinds: list[str]) -> list[dict]:
    prof.__exit__(None, None, None)
    events = prof.events()
    calls = [e for e in events if e.name.startswith("cu")]
    rows = []
    from torch.autograd import DeviceType

    # (a record_function range also appears as a GPU-side annotation: the host's only)
    for launch in (e for e in events if e.name.startswith("launch#") and e.device_type == DeviceType.CPU):
        lo, hi = launch.time_range.start, launch.time_range.end
        inside = [c for c in calls if lo <= c.time_range.start and c.time_range.end <= hi]
        worst = max(inside, key=lambda c: c.time_range.elapsed_us(), default=None)
        row = {
            "launch": launch.name,
            "kind": kinds[int(launch.name.removeprefix("launch#")) - 1],
            "ms": (hi - lo) / 1e3,
        }
        row.update({k: sum(pat in c.name for c in inside) for k, pat in KINDS.items()})
        row["longest_call"] = worst.name if worst is not None else None
        row["longest_call_ms"] = worst.time_range.elapsed_us() / 1e3 if worst is not None else 0.0
        rows.append(row)
    return rows


def _collect(actor) -> list[dict] | str:
    """The profiled rows, or why there are none: the profiler runs on the step thread and
    can only be stopped there, so a workload with fewer launches than asked reports so."""
    state = actor._launch_calls
    if state["rows"] is None:
        return f"only {state['n']} launches of rows ran: rerun with --launches {max(1, state['n'])}"
    return state["rows"]


def run_mode(mode: str, model: str, fmt: str, wait_ms: float, launches: int, vocab: int = 1000) -> list[dict] | str:
    """``benchmarks.launch_wait``'s workload in one mode, the first ``launches`` launches of
    rows after a warm-up request profiled on worker 0."""
    import ray

    from cluster import LLM

    opts = dict(load_format=fmt, max_num_seqs=32, max_model_len=2048)  # (the mode sets the scheduling)
    llm = LLM(model=model, launch_wait_probe_ms=wait_ms, **opts, **mode_options(mode, model))
    try:
        ids, params = workload(vocab=vocab, rich=rich_sampling(mode))
        prompts = [{"prompt_token_ids": p} for p in ids]
        llm.generate([{"prompt_token_ids": ids[0][:50]}], params[0], use_tqdm=False)  # warm-up
        worker = llm.engine.executor.workers[0]
        ray.get(worker.__ray_call__.remote(_arm, launches))
        llm.generate(prompts, params, use_tqdm=False)
        return ray.get(worker.__ray_call__.remote(_collect))
    finally:
        llm.shutdown()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-0.6b", help="random-weight model shape (default: qwen3-0.6b)")
    p.add_argument("--model", default=None, help="a local checkpoint instead of --shape")
    p.add_argument("--modes", default="async,async+ngram,async+draft", help=f"comma-separated subset of {MODES}")
    p.add_argument("--wait-ms", type=float, default=0.0, help="GPU busy-wait before each launch (default: none)")
    p.add_argument("--launches", type=int, default=20, help="launches profiled per mode (default: 20)")
    p.add_argument("--vocab", type=int, default=1000, help="prompt token ids below this (default: 1000)")
    p.add_argument("--output", default=None, help="write every launch's record as JSON here")
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad or args.launches < 1:
        p.error(f"unknown modes {bad} (known: {', '.join(MODES)}) or --launches below 1")
    model, fmt = resolve_model(args.model, None if args.model else args.shape)
    runs = {m: run_mode(m, model, fmt, args.wait_ms, args.launches, args.vocab) for m in modes}
    print("| mode | steps | launches | median ms | kernels | graphs | copies | memsets | longest call (ms) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mode, all_rows in runs.items():
        if isinstance(all_rows, str):
            print(f"| {mode} | {all_rows} | | | | | | | |")
            continue
        for kind in ("decode", "mixed"):
            _print_row(mode, kind, [r for r in all_rows if r["kind"] == kind])
    if args.output:
        with open(args.output, "w") as f:
            json.dump(runs, f)
    return runs


def _print_row(mode: str, kind: str, rows: list[dict]) -> None:
    if not rows:
        print(f"| {mode} | {kind} | 0 | | | | | | |")
        return
    med = {k: statistics.median(r[k] for r in rows) for k in ("ms", *KINDS)}
    worst = max(rows, key=lambda r: r["longest_call_ms"])
    print(
        f"| {mode} | {kind} | {len(rows)} | {med['ms']:.2f} | {med['kernels']:g} | {med['graphs']:g} "
        f"| {med['copies']:g} | {med['memsets']:g} | {worst['longest_call']} {worst['longest_call_ms']:.1f} |"
    )


if __name__ == "__main__":
    main()
