"""GPU idle time between consecutive decode steps with the real Ray driver in the loop.

For async and synchronous scheduling at each batch size, runs a decode-heavy
workload through ``cluster.LLM`` with ``measure_device_timeline`` on: each
worker step records CUDA events at its start and end, and reports its device
time and the idle gap since the previous step's end. Reports idle / step time
over steady-state decode steps, the driver's CPU time per step (scheduling +
output processing) and the ``StepPlan`` size per scheduled request.

    python -m benchmarks.async_idle --shape qwen3-0.6b --batch-sizes 1,64
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks.common import hardware_info, versions
from benchmarks.shapes import resolve_model


def run_cell(model: str, fmt: str, batch: int, async_on: bool, prompt_len: int, out_len: int, extra: dict) -> dict:
    from cluster import LLM, SamplingParams

    llm = LLM(
        model=model,
        load_format=fmt,
        async_scheduling=async_on,
        measure_device_timeline=True,
        max_num_seqs=batch,
        max_model_len=prompt_len + out_len + 8,
        **extra,
    )
    try:
        prompts = [{"prompt_token_ids": [(7 * i + j) % 1000 + 10 for j in range(prompt_len)]} for i in range(batch)]
        sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        eng = llm.engine
        eng.timeline.clear()
        base = dict(eng.stats)
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        steps = [t for t in eng.timeline if t[0] == batch and t[2] >= 0]
        steady = steps[5:-5] if len(steps) > 20 else steps
        busy = sum(t[1] for t in steady)
        idle = sum(t[2] for t in steady)
        n_steps = eng.stats["steps"] - base["steps"]
        driver = (
            eng.stats.get("driver_schedule_s", 0)
            - base.get("driver_schedule_s", 0)
            + eng.stats.get("driver_process_s", 0)
            - base.get("driver_process_s", 0)
        )
        rows = eng.stats.get("plan_rows", 0) - base.get("plan_rows", 0)
        return {
            "batch": batch,
            "async_scheduling": async_on,
            "decode_steps": len(steady),
            "mean_step_ms": 1e3 * busy / max(1, len(steady)),
            "median_idle_ms": 1e3 * statistics.median([t[2] for t in steady]) if steady else None,
            "idle_fraction": idle / busy if busy else None,
            "driver_cpu_ms_per_step": 1e3 * driver / max(1, n_steps),
            "plan_bytes_per_request": (eng.stats["plan_bytes"] - base["plan_bytes"]) / max(1, rows),
            "output_tokens_per_s": batch * out_len / elapsed,
        }
    finally:
        llm.shutdown()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--model", default=None)
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=200)
    p.add_argument("--device", default="auto")
    p.add_argument("--output", default="async_idle.json")
    args = p.parse_args(argv)
    model, fmt = resolve_model(args.model, None if args.model else args.shape)
    extra = {"device": args.device}
    from tqdm.auto import tqdm

    cells = [(b, a) for b in map(int, args.batch_sizes.split(",")) for a in (False, True)]
    results = [
        run_cell(model, fmt, b, a, args.prompt_len, args.output_len, extra) for b, a in tqdm(cells, desc="cells")
    ]
    out = {
        "benchmark": "async_idle",
        "config": vars(args),
        "hardware": hardware_info(),
        "versions": versions(),
        "results": results,
    }
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)
    print(
        f"{'batch':>5} {'async':>5} {'step ms':>8} {'idle ms':>8} {'idle %':>7} {'drv ms':>7} {'B/req':>6} {'tok/s':>8}"
    )
    for r in results:
        frac = r["idle_fraction"]
        print(
            f"{r['batch']:>5} {str(r['async_scheduling']):>5} {r['mean_step_ms']:8.3f} "
            f"{(r['median_idle_ms'] or 0):8.3f} {100 * frac if frac is not None else float('nan'):7.2f} "
            f"{r['driver_cpu_ms_per_step']:7.3f} {r['plan_bytes_per_request']:6.1f} {r['output_tokens_per_s']:8.0f}"
        )
    return out


if __name__ == "__main__":
    main()
