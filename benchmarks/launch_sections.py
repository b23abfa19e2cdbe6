"""Host time of a served launch, by section, for mixed and decode steps apart.

    python -m benchmarks.launch_sections --shape qwen3-0.6b --arrivals staggered --num-prompts 128

Runs ``benchmarks.launch_wait``'s workload (by default with staggered arrivals: a prompt
placed beside the running decode rows nearly every step) in a real engine, with wall-clock
timers (``benchmarks.host_sections.SectionTimers``) around the step's host-side functions
inside worker 0, and attributes each launch's section time to its kind: *mixed* when a
prompt's tokens are placed in it (no decode graph fits), else *decode*. Sections are
inclusive (``build_window`` contains ``place new requests``, which rides in its copy); the
table gives the mean microseconds a launch and the calls a launch of each. ``launch`` is the
whole of ``ModelRunner.launch``; what its sections leave is the launch's own Python. Time the
second pass (``--passes 2``, the default): the first includes every step shape's first use.
"""

from __future__ import annotations

import argparse
import json

from benchmarks.launch_wait import ARRIVALS, MODES, make_llm, rich_sampling, workload
from benchmarks.shapes import resolve_model

SECTIONS = [
    ("workers.model_runner:ModelRunner", "launch", "launch"),
    ("workers.device_state:DeviceState", "release", "release"),
    ("workers.device_state:DeviceState", "stage", "stage new requests (host)"),
    ("workers.device_state:DeviceState", "_validate", "stage: validate"),
    ("workers.device_state:DeviceState", "place", "place new requests (device)"),
    ("workers.device_state:DeviceState", "placement", "place new requests (in the input launch)"),
    ("kernels.place", "place_requests", "place_requests"),
    ("workers.device_state", "to_device", "to_device (sampling options)"),
    ("workers.host_staging:PinnedStaging", "copy", "staging copy (every to_device)"),
    ("workers.host_staging:PinnedStaging", "_slot", "staging: find a free pinned buffer"),
    ("workers.model_runner", "build_step_inputs", "build_step_inputs"),
    ("workers.step_inputs", "build_window", "build_window"),
    ("workers.step_inputs", "to_device", "to_device (step inputs)"),
    ("workers.step_inputs", "prepare_inputs", "prepare_inputs"),
    ("workers.input_graphs:InputGraphs", "load", "input graph: copy into the stage"),
    ("workers.input_graphs:InputGraphs", "run", "input graph: replay"),
    ("workers.cuda_graphs:DecodeGraphs", "run", "decode graph run"),
    ("workers.mixed_graphs:MixedGraphs", "logits", "mixed graph logits"),
    ("torch.cuda:CUDAGraph", "replay", "graph replay"),
    ("workers.model_runner", "sampling_rows", "sampling_rows"),
    ("workers.model_runner", "build_sampling_batch", "build_sampling_batch"),
    ("workers.device_state:OptionTensors", "get", "sampling options"),
    ("workers.model_runner", "sample", "sample"),
    ("workers.model_runner:ModelRunner", "_commit_tokens", "commit tokens"),
    ("workers.pending_step:PendingStep", "start_copy", "start_copy"),
]


def _arm(actor) -> None:
    """(On the worker.) Time the sections, attributed to each launch's kind."""
    from benchmarks.host_sections import SectionTimers

    timers = SectionTimers()
    for target, attr, label in SECTIONS:
        timers.wrap(target, attr, label)
    runner = actor.runner
    inner = runner.launch  # (the timed class method, bound: this wrapper sits outside it)
    state = {"timers": timers, "kinds": {}}
    actor._launch_sections = state

    def launch(plan):
        if not plan.rows:
            return inner(plan)
        before = (dict(timers.total), dict(timers.calls))
        out = inner(plan)
        kind = "decode" if runner._decode_graph_step else "mixed"
        k = state["kinds"].setdefault(kind, {"launches": 0, "us": {}, "calls": {}})
        k["launches"] += 1
        for label, v in timers.total.items():
            k["us"][label] = k["us"].get(label, 0.0) + (v - before[0].get(label, 0.0)) * 1e6
            k["calls"][label] = k["calls"].get(label, 0) + timers.calls[label] - before[1].get(label, 0)
        return out

    runner.launch = launch


def _reset(actor) -> None:
    actor._launch_sections["kinds"].clear()


def _collect(actor) -> dict:
    return actor._launch_sections["kinds"]


def run_mode(
    mode: str,
    model: str,
    fmt: str,
    arrivals: str = "staggered",
    num_prompts: int = 128,
    prompt_len: int = 200,
    max_num_seqs: int = 32,
    vocab: int = 1000,
    passes: int = 2,
) -> dict:
    """``{kind: {"launches": n, "us": {section: mean us a launch}, "calls": {section: calls a
    launch}}}`` of worker 0 over the last pass."""
    import ray

    llm = make_llm(mode, model, fmt, max_num_seqs)
    try:
        prompts, params = workload(num_prompts, prompt_len, vocab, arrivals=arrivals, rich=rich_sampling(mode))
        llm.generate([{"prompt_token_ids": prompts[0][:50]}], params[0], use_tqdm=False)  # warm-up
        worker = llm.engine.executor.workers[0]
        ray.get(worker.__ray_call__.remote(_arm))
        for n in range(passes):
            if n:
                prompts, params = workload(
                    num_prompts, prompt_len, vocab, seed=n, arrivals=arrivals, rich=rich_sampling(mode)
                )
            ray.get(worker.__ray_call__.remote(_reset))  # only the last pass counts
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        kinds = ray.get(worker.__ray_call__.remote(_collect))
    finally:
        llm.shutdown()
    for k in kinds.values():
        n = max(k["launches"], 1)
        k["us"] = {s: v / n for s, v in k["us"].items()}
        k["calls"] = {s: v / n for s, v in k["calls"].items()}
    return kinds


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-0.6b", help="random-weight model shape (default: qwen3-0.6b)")
    p.add_argument("--model", default=None, help="a local checkpoint instead of --shape")
    p.add_argument("--modes", default="async", help=f"comma-separated subset of {', '.join(MODES)} (default: async)")
    p.add_argument("--arrivals", choices=ARRIVALS, default="staggered", help="the workload (default: staggered)")
    p.add_argument("--num-prompts", type=int, default=128, help="prompts a pass (default: 128)")
    p.add_argument("--passes", type=int, default=2, help="passes; the last is timed (default: 2)")
    p.add_argument("--output", default=None, help="write the sections as JSON here")
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        p.error(f"unknown modes {', '.join(bad)} (known: {', '.join(MODES)})")
    if args.passes < 1 or args.num_prompts < 2:
        p.error("--passes must be at least 1 and --num-prompts at least 2")
    model, fmt = resolve_model(args.model, None if args.model else args.shape)
    runs = {}
    for mode in modes:
        runs[mode] = run_mode(mode, model, fmt, args.arrivals, args.num_prompts, passes=args.passes)
        for kind, k in sorted(runs[mode].items()):
            print(f"\n{mode}, {kind} launches: {k['launches']} (mean us a launch, calls a launch)")
            print("| section | us | calls |\n|---|---|---|")
            for label in (s[2] for s in SECTIONS):
                if label in k["us"]:
                    print(f"| {label} | {k['us'][label]:.1f} | {k['calls'][label]:.2f} |")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(runs, f)
    return runs


if __name__ == "__main__":
    main()
