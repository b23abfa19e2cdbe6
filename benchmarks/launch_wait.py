"""Does a launch wait for the device? The busy-wait check, for every scheduling mode.

Each worker enqueues a GPU busy-wait of ``--wait-ms`` (``torch.cuda._sleep``) just before
every step's launch (``launch_wait_probe_ms``) and records how long the launch call took
on the host. A launch that never waits for the device returns in a few ms whatever the
GPU is doing; one that waits (a host read of device data, a pageable copy, allocator
growth, or a launch queue filled by thousands of small kernels) takes about the wait.

Modes: plain async scheduling, async with n-gram drafts, async with a draft model,
async under KV pressure (preemption), FP8 weights and KV cache, every sampling option at
once (top-k/top-p, min-p, penalties, min_tokens, logprobs beside greedy rows), and the
engine's default synchronous scheduling, plain and with a draft model (the driver waits
for each step's tokens before planning the next; the launch itself must not). Each runs
requests arriving mid-run (more prompts than ``max_num_seqs``) and then prompts that hit
the prefix cache.

    python -m benchmarks.launch_wait --shape qwen3-0.6b --wait-ms 100
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import statistics

from benchmarks.common import phase_medians, thread_time_medians
from benchmarks.shapes import resolve_model

MODES = ("async", "async+ngram", "async+draft", "async+preempt", "async+fp8", "async+options", "sync", "sync+draft")


def mode_options(mode: str, model: str) -> dict:
    """``mode``'s engine options besides ``make_llm``'s (``async_scheduling`` among them)."""
    sched, _, extra = mode.partition("+")
    opts = {"async_scheduling": sched == "async"}
    if extra == "ngram":
        return opts | {"speculative_method": "ngram", "num_speculative_tokens": 3}
    if extra == "draft":
        return opts | {"speculative_method": "draft_model", "speculative_model": model, "num_speculative_tokens": 3}
    if extra == "preempt":
        return opts | {"num_kv_blocks": 160}  # 48 requests of ~230 tokens in blocks of 16 do not fit
    if extra == "fp8":  # FP8 weights (per-token activation quantization) and KV cache
        return opts | {"quantization": "fp8", "kv_cache_dtype": "fp8"}
    return opts


def rich_sampling(mode: str) -> bool:
    """Whether ``mode``'s workload gives its rows every sampling option (``workload``'s ``rich``)."""
    return mode == "async+options"


ARRIVALS = ("batched", "staggered")


# per-row extras of the "async+options" mode, in turn (rows without extras: greedy or temperature only)
RICH_OPTIONS = (
    dict(top_p=0.9, top_k=20),
    dict(repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.2),
    dict(min_p=0.05, logprobs=3),
    dict(min_tokens=8, stop_token_ids=[11, 12]),
    dict(logprobs=0),
    dict(top_k=5, repetition_penalty=1.05),
    dict(logit_bias={7: 2.0, 9: -1.0}, allowed_token_ids=list(range(3, 200))),  # (device masks)
    dict(top_p=0.95, bad_words=["w5"]),
    {},
)  # (an odd count: each set meets greedy and temperature rows in turn)


def workload(
    num_prompts: int = 48,
    prompt_len: int = 200,
    vocab: int = 1000,
    seed: int = 0,
    arrivals: str = "batched",
    rich: bool = False,
) -> tuple[list, list]:
    """Random prompts (token ids) and their sampling parameters: greedy and sampled rows
    alternating. ``arrivals``: ``batched``, ``max_tokens`` 16-48 in five groups (rows finish,
    and waiting prompts are placed, a few groups at a time: few mixed steps); ``staggered``,
    ``max_tokens`` spread over 16-79 so that about one row finishes a step and the next
    prompt is placed beside the running decode rows (a mixed step nearly every step).
    ``rich``: the rows also take ``RICH_OPTIONS`` in turn (every sampling path at once)."""
    from cluster import SamplingParams

    if arrivals not in ARRIVALS:
        raise ValueError(f"arrivals must be one of {ARRIVALS}, got {arrivals!r}")
    rnd = random.Random(seed)
    prompts = [[rnd.randrange(10, vocab) for _ in range(prompt_len)] for _ in range(num_prompts)]
    lengths = [16 + (i % 5) * 8 if arrivals == "batched" else 16 + (i * 37) % 64 for i in range(num_prompts)]
    params = [
        SamplingParams(
            temperature=0.0 if i % 2 else 0.8,
            max_tokens=n,
            seed=i,
            ignore_eos=True,
            **(RICH_OPTIONS[i % len(RICH_OPTIONS)] if rich else {}),
        )
        for i, n in enumerate(lengths)
    ]
    return prompts, params


def make_llm(mode: str, model: str, fmt: str, max_num_seqs: int, **options):
    """The engine a mode's workload runs on (its scheduling, 2,048 positions), with ``options``."""
    from cluster import LLM

    return LLM(
        model=model,
        load_format=fmt,
        max_num_seqs=max_num_seqs,
        max_model_len=2048,
        **mode_options(mode, model),
        **options,
    )


def run_mode(
    mode: str,
    model: str,
    fmt: str,
    wait_ms: float,
    num_prompts: int = 48,
    prompt_len: int = 200,
    max_num_seqs: int = 32,
    vocab: int = 1000,
    sync_check: str = "error",
    passes: int = 1,
    arrivals: str = "batched",
) -> dict:
    """Launch times (ms) of one mode: after a warm-up request, the workload (its prompts, then
    prompts that hit the prefix cache) ``passes`` times with new prompts each pass, of which
    only the last is recorded. One pass includes every step shape's first use (a graph's
    first replay, a GEMM's first shape); later passes time the steady state."""
    import ray

    llm = make_llm(mode, model, fmt, max_num_seqs, sync_check=sync_check, launch_wait_probe_ms=wait_ms)
    try:
        rich = rich_sampling(mode)
        prompts, params = workload(num_prompts, prompt_len, vocab, arrivals=arrivals, rich=rich)
        llm.generate([{"prompt_token_ids": prompts[0][:50]}], params[0], use_tqdm=False)  # warm-up
        workers = llm.engine.executor.workers
        for n in range(passes):
            if n:
                prompts, params = workload(num_prompts, prompt_len, vocab, seed=n, arrivals=arrivals, rich=rich)
            ray.get([w.clear_launch_times.remote() for w in workers])  # only the last pass counts
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            hits = [{"prompt_token_ids": p[:160] + [5, 6, 7]} for p in prompts[: num_prompts // 2]]
            llm.generate(hits, params[: num_prompts // 2], use_tqdm=False)
        stats = ray.get([w.stats.remote() for w in workers])
        launches = [ms for s in stats for ms in s["launch_ms"]]
        mixed = [ms for s in stats for ms in s["mixed_launch_ms"]]
        phases = [p for s in stats for p in s["launch_phases_ms"]]
        cpu = [c for s in stats for c in s["launch_cpu_ms"]]
        allocs = [a for s in stats for a in s["launch_allocs"]]
        return {
            "mode": mode,
            "wait_ms": wait_ms,
            "launch_ms": launches,
            "mixed_launch_ms": mixed,
            "launch_phases_ms": phases,
            "launch_cpu_ms": cpu,
            "launch_allocs": allocs,
            "preemptions": llm.engine.scheduler.num_preemptions,
            "async_scheduling": llm.engine.async_scheduling,
            "mixed_graph_replays": sum(s["mixed_graph_replays"] for s in stats),
            # Triton variants compiled or loaded after start-up (a first use's host time)
            "kernel_variants_after_start": sum(s["kernel_variants_after_start"] for s in stats),
            "kernel_variants_first": [v for s in stats for v in s["kernel_variants_first"]][:4],
        }
    finally:
        llm.shutdown()


def summarize(run: dict) -> dict:
    ls = run["launch_ms"]
    mixed = collections.Counter(run["mixed_launch_ms"])  # a subset of the launches
    decode = list((collections.Counter(ls) - mixed).elements())
    return {
        "mode": run["mode"],
        "launches": len(ls),
        "waited": sum(x > run["wait_ms"] / 4 for x in ls),
        "median_ms": statistics.median(ls) if ls else 0.0,
        "decode_median_ms": statistics.median(decode) if decode else 0.0,
        "mixed_launches": len(run["mixed_launch_ms"]),
        "mixed_median_ms": statistics.median(run["mixed_launch_ms"]) if run["mixed_launch_ms"] else 0.0,
        "max_ms": max(ls) if ls else 0.0,
        "preemptions": run["preemptions"],
        "mixed_graph_replays": run["mixed_graph_replays"],
        "kernel_variants_after_start": run.get("kernel_variants_after_start", 0),
        **allocations(run.get("launch_allocs", [])),
    }


def draft_overheads(rows: list[dict]) -> list[str]:
    """Each speculative mode's median decode launch against plain ``async``'s, from the same
    run's summaries (issue 38's bound: within 1.5x); none without an ``async`` row."""
    plain = next((r["decode_median_ms"] for r in rows if r["mode"] == "async"), 0.0)
    if not plain:
        return []
    return [
        f"{r['mode']}: decode launch {r['decode_median_ms']:.2f} ms = {r['decode_median_ms'] / plain:.2f}x "
        f"plain async's {plain:.2f} ms"
        for r in rows
        if r["mode"] in ("async+ngram", "async+draft") and r["decode_median_ms"]
    ]


def allocations(allocs: list) -> dict:
    """Pinned host blocks and device segments the launches created (each a ``cudaHostAlloc`` or
    ``cudaMalloc`` on the launch's path), summed over decode and over mixed launches."""
    out = {}
    for kind, mixed in (("decode", False), ("mixed", True)):
        rows = [a for a in allocs if bool(a[0]) == mixed]
        out[f"{kind}_pinned_allocs"] = sum(a[1] for a in rows)
        out[f"{kind}_device_allocs"] = sum(a[2] for a in rows)
    return out


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-0.6b", help="random-weight model shape (default: qwen3-0.6b)")
    p.add_argument("--model", default=None, help="a local checkpoint instead of --shape")
    p.add_argument("--wait-ms", type=float, default=100.0, help="busy-wait before each launch (default: 100)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {', '.join(MODES)}")
    p.add_argument(
        "--sync-check",
        choices=("off", "warn", "error"),
        default="error",
        help="the workers' sync check (default: error; its launch audit adds host time to every "
        "operator: 'off' times the launches as served)",
    )
    p.add_argument(
        "--passes",
        type=int,
        default=1,
        help="run the workload this many times (new prompts each) and time the last (default: 1, "
        "which includes every step shape's first use; 2 times the steady state)",
    )
    p.add_argument(
        "--arrivals",
        choices=ARRIVALS,
        default="batched",
        help="batched (default): prompts placed a few groups at a time, few mixed steps; staggered: "
        "about one prompt placed beside the decode rows every step (use with --num-prompts 128 to "
        "time a hundred mixed steps)",
    )
    p.add_argument("--num-prompts", type=int, default=48, help="prompts a pass (default: 48)")
    p.add_argument("--output", default=None, help="write the raw launch times as JSON here")
    args = p.parse_args(argv)
    if args.passes < 1:
        p.error(f"--passes must be at least 1, got {args.passes}")
    if args.num_prompts < 2:
        p.error(f"--num-prompts must be at least 2, got {args.num_prompts}")
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        p.error(f"unknown modes {', '.join(bad)} (known: {', '.join(MODES)})")
    if not args.wait_ms > 0:
        p.error(f"--wait-ms must be positive (a GPU busy-wait before each launch), got {args.wait_ms:g}")
    model, fmt = resolve_model(args.model, None if args.model else args.shape)
    print(
        f"| mode | launches | waited (> {args.wait_ms / 4:g} ms) | median ms | max ms | decode median ms "
        "| mixed-step launches | their median ms | preemptions | pinned / device allocations (decode; mixed) |",
        flush=True,
    )
    print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
    runs, rows = [], []
    for mode in modes:  # a row as each mode ends: a long run shows its progress
        runs.append(
            run_mode(
                mode,
                model,
                fmt,
                args.wait_ms,
                num_prompts=args.num_prompts,
                sync_check=args.sync_check,
                passes=args.passes,
                arrivals=args.arrivals,
            )
        )
        r = summarize(runs[-1])
        rows.append(r)
        print(
            f"| {r['mode']} | {r['launches']} | {r['waited']} | {r['median_ms']:.2f} | {r['max_ms']:.1f} "
            f"| {r['decode_median_ms']:.2f} | {r['mixed_launches']} | {r['mixed_median_ms']:.2f} "
            f"| {r['preemptions']} | {r['decode_pinned_allocs']} / {r['decode_device_allocs']}; "
            f"{r['mixed_pinned_allocs']} / {r['mixed_device_allocs']} |",
            flush=True,
        )
        if r["kernel_variants_after_start"]:  # (outside the table: it would shift the columns)
            print(
                f"  {r['mode']}: {r['kernel_variants_after_start']} Triton variant(s) compiled or loaded after "
                f"start-up, first: {[v[:200] for v in runs[-1]['kernel_variants_first']]}",
                flush=True,
            )
        if args.output:
            with open(args.output, "w") as f:
                json.dump({"runs": runs, "summary": rows}, f)
    for line in draft_overheads(rows):
        print(line)
    from workers.model_runner import LAUNCH_PHASES

    print("\nWhere a launch's host time goes (medians, ms):")
    print(f"| mode | steps | {' | '.join(LAUNCH_PHASES)} |")
    print("|---|---|" + "---|" * len(LAUNCH_PHASES))
    for run in runs:
        for kind, medians in phase_medians(run).items():
            if medians:
                print(f"| {run['mode']} | {kind} | " + " | ".join(f"{m:.3f}" for m in medians) + " |")
    print("\nThe launching thread's CPU time against the launch's wall time (medians, ms; a gap: the")
    print("thread did not run, another thread of the worker holding the GIL, or it blocked):")
    print("| mode | steps | wall | thread CPU | CPU / wall |")
    print("|---|---|---|---|---|")
    for run in runs:
        for kind, (wall, cpu) in thread_time_medians(run).items():
            print(f"| {run['mode']} | {kind} | {wall:.3f} | {cpu:.3f} | {cpu / wall if wall else 0:.2f} |")
    return rows


if __name__ == "__main__":
    main()
