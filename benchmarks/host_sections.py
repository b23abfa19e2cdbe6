"""Host time of a pipelined decode step, by section of ``ModelRunner.launch`` / ``finish``.

    python -m benchmarks.host_sections --shape qwen3-0.6b --batch-sizes 1,8 --context-lens 512
    python -m benchmarks.host_sections --driver --tokenizer DIR --batch-sizes 256 --context-lens 512

Runs ``benchmarks.decode_roofline``'s cells (same plans, same pipelining) with wall-clock
timers wrapped around the step's host-side functions. Each section's time is inclusive
(``launch`` contains ``build_step_inputs``, which contains ``to_device`` ...) and is a
median over the timed pipelined steps; ``wait`` is the time ``finish`` spends blocked on
the step's one event, so ``busy = step - wait`` is the host's own work a step. When
``busy`` is about the step, the host sets the pace, not the device. The timers add about
a microsecond a call: compare sections within one run, not with another benchmark.

``--driver`` times the driver's side of a decode step instead, without workers: the real
``Scheduler`` and ``OutputProcessor`` with a real tokenizer, fed sampled tokens of real
text, one result per step at each batch size. ``schedule`` and ``update`` (applying the
result) lie on the path from a result to the next plan; ``outputs`` (detokenizing, stop
strings, deltas) runs after the next plan was sent under async scheduling.
"""

from __future__ import annotations

import argparse
import inspect
import time
from collections.abc import Callable
from typing import Any

from benchmarks import common, decode_roofline

# (module or class path, attribute, section label); a staticmethod stays one
SECTIONS = [
    ("workers.model_runner:ModelRunner", "launch", "launch"),
    ("workers.model_runner", "build_step_inputs", "build_step_inputs"),
    ("workers.step_inputs", "to_device", "to_device (step inputs)"),
    ("workers.step_inputs", "prepare_inputs", "prepare_inputs"),
    ("workers.cuda_graphs:DecodeGraphs", "run", "graphs.run"),
    ("torch.cuda:CUDAGraph", "replay", "graph replay"),
    ("workers.model_runner", "build_sampling_batch", "build_sampling_batch"),
    ("workers.model_runner", "sample", "sample"),
    ("workers.model_runner:ModelRunner", "_commit_tokens", "commit tokens"),
    ("workers.pending_step:PendingStep", "start_copy", "start_copy"),
    ("workers.model_runner:ModelRunner", "finish", "finish"),
    ("torch.cuda:Event", "synchronize", "wait"),
    ("benchmarks.decode_roofline:Bench", "_decode_plan", "plan"),
]


class SectionTimers:
    """Wraps functions with accumulating wall-clock timers; ``restore`` undoes it."""

    def __init__(self):
        self.total: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._undo: list[Callable[[], None]] = []

    def wrap(self, target: str, attr: str, label: str) -> None:
        import importlib

        mod_name, _, cls_name = target.partition(":")
        owner = importlib.import_module(mod_name)
        if cls_name:
            owner = getattr(owner, cls_name)
        raw = inspect.getattr_static(owner, attr)
        static = isinstance(raw, staticmethod)
        fn = raw.__func__ if static else raw
        total, calls = self.total, self.calls

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                total[label] = total.get(label, 0.0) + time.perf_counter() - t
                calls[label] = calls.get(label, 0) + 1

        setattr(owner, attr, staticmethod(timed) if static else timed)
        self._undo.append(lambda: setattr(owner, attr, raw))

    def reset(self) -> None:
        self.total.clear()
        self.calls.clear()

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()


def run(conf: dict[str, Any]) -> list[dict[str, Any]]:
    """Every cell of ``conf``: median pipelined step and the host sections a step (us)."""
    import torch  # noqa: F401 - the CUDA classes must exist before wrapping

    timers = SectionTimers()
    for target, attr, label in SECTIONS:
        timers.wrap(target, attr, label)
    conf = dict(conf, bandwidth_bytes_per_s=1.0, profile_cells=set())
    bench = decode_roofline.Bench(conf)
    out = []
    try:
        for ctx in conf["context_lens"]:
            for b in conf["batch_sizes"]:
                out.append(_cell(bench, timers, b, ctx))
    finally:
        timers.restore()
    return out


def _cell(bench, timers: SectionTimers, batch: int, ctx: int) -> dict[str, Any]:
    piped_fn = bench._pipelined_steps
    box: dict[str, Any] = {}

    def piped(handles, start_len, n):
        warm = bench.conf["warmup"]
        piped_fn(handles, start_len, warm)  # untimed: JIT, allocator and graph warm-up
        timers.reset()
        times = piped_fn(handles, start_len + warm, n - warm)
        box["sections"] = {k: v / len(times) * 1e6 for k, v in timers.total.items()}
        box["calls"] = {k: v / len(times) for k, v in timers.calls.items()}
        return [0.0] * warm + times

    bench._pipelined_steps = piped
    try:
        cell = bench.cell(batch, ctx)
    finally:
        del bench._pipelined_steps
    if "skipped" in cell:
        return cell
    step_us = cell["step_ms_median"] * 1e3
    sections = box["sections"]
    # the median step, against mean sections: steps are steady once warm
    return {
        "batch_size": batch,
        "context_len": ctx,
        "step_us": step_us,
        "busy_us": step_us - sections.get("wait", 0.0),
        "sections_us": sections,
        "calls_per_step": box["calls"],
    }


def table(cells: list[dict[str, Any]]) -> str:
    labels = [label for _, _, label in SECTIONS]
    done = [c for c in cells if "skipped" not in c]
    head = f"{'section (us a step)':28s}" + "".join(
        f"{'b{}/{}'.format(c['batch_size'], c['context_len']):>12s}" for c in done
    )
    rows = [head]
    for label in ["step", "busy"] + labels:
        vals = []
        for c in done:
            v = c["step_us"] if label == "step" else c["busy_us"] if label == "busy" else c["sections_us"].get(label)
            vals.append(f"{v:12.1f}" if v is not None else f"{'-':>12s}")
        rows.append(f"{label:28s}" + "".join(vals))
    return "\n".join(rows)


# real text for the driver cells' sampled tokens (any tokenizer encodes it)
_TEXT = (
    "The engine schedules requests, ships typed plans to its workers and streams tokens back. "
    "Each worker keeps exact sequence lengths on the device; the driver knows upper bounds. "
    "Über-große Stapel, naïve café prices (3.50 €) and 数据 mix ASCII with multi-byte text. "
)


def sampled_ids(tok, n: int) -> tuple[list[int], str]:
    """At least ``n`` token ids for the driver cells and where they come from: ``"text"`` (real
    text encoded), or ``"vocabulary"`` where the tokenizer knows too little of it (a random-weight
    shape's word-level tokenizer reads it as unknown tokens, which decode to nothing: a
    detokenizer's window would then only grow), its non-special ids in a fixed shuffled order."""
    import random

    from benchmarks.datasets import mostly_unknown

    ids = tok.encode(_TEXT * (1 + 40 * n // len(_TEXT)), add_special_tokens=False)
    if not mostly_unknown(tok, ids):
        return ids, "text"
    special = set(tok.all_special_ids)
    plain = [i for i in range(len(tok)) if i not in special]
    random.Random(0).shuffle(plain)
    return plain * (1 + n // len(plain)), "vocabulary"


def driver_cells(
    tokenizer_dir: str, batch_sizes: list[int], prompt_len: int, steps: int, stop_strings: bool = True
) -> list[dict[str, Any]]:
    """Median driver time a decode step (us) at each batch size: ``schedule``, ``update``
    (``Scheduler.update_from_result``) and ``outputs`` (``OutputProcessor.process``).
    With ``stop_strings`` every request has two stop strings that never occur."""
    import statistics

    from transformers import AutoTokenizer

    from cluster.input_processor import InputProcessor
    from cluster.output_processor import OutputProcessor
    from cluster.scheduler import Scheduler
    from metadata.config import EngineConfig
    from metadata.sampling_params import SamplingParams
    from metadata.wire import SampledRow, StepResult

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids, source = sampled_ids(tok, prompt_len + steps)
    cells = []
    for b in batch_sizes:
        if len(ids) < b + prompt_len + steps:
            ids = ids * (1 + (b + prompt_len + steps) // len(ids))
        max_len = prompt_len + steps + 1
        cfg = EngineConfig.from_options(
            max_num_seqs=b,
            max_num_batched_tokens=b * prompt_len,
            num_kv_blocks=b * (max_len // 16 + 2),
            max_model_len=max_len,
        )
        sched = Scheduler(cfg, cfg.cache.num_kv_blocks, max_len)
        outputs = OutputProcessor(tok)
        inputs = InputProcessor(tok, (), len(tok), max_len, b * prompt_len, True, 0)
        future: dict[str, list[int]] = {}
        for i in range(b):
            sp = SamplingParams(
                temperature=0.0,
                max_tokens=steps,
                ignore_eos=True,
                stop=["\u241e never", "zz\u241f"] if stop_strings else None,
            )
            for r in inputs.make_requests(f"d{i}", {"prompt_token_ids": ids[i : i + prompt_len]}, sp, 1 << 30):
                outputs.add(r)
                sched.add(r)
                future[r.request_id] = ids[i + prompt_len : i + prompt_len + steps]
        times: dict[str, list[float]] = {"schedule": [], "update": [], "outputs": []}
        while sched.has_unfinished():
            t0 = time.perf_counter()
            step = sched.schedule()
            t1 = time.perf_counter()
            rows = [
                SampledRow(handle=h, token_ids=[future[r.request_id][len(r.output_token_ids)]])
                for h, r in step.sampled.items()
            ]
            result = StepResult(step_id=step.plan.step_id, outputs=rows)
            t2 = time.perf_counter()
            update = sched.update_from_result(step, result)
            t3 = time.perf_counter()
            outputs.process(update, sched)
            t4 = time.perf_counter()
            if len(step.plan.rows) == b and all(r.num_scheduled_tokens == 1 for r in step.plan.rows):
                for k, v in (("schedule", t1 - t0), ("update", t3 - t2), ("outputs", t4 - t3)):
                    times[k].append(v)
        med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
        cells.append(
            {
                "batch_size": b,
                "prompt_len": prompt_len,
                "decode_steps": len(times["update"]),
                "stop_strings": stop_strings,
                "sampled_tokens": source,
                "schedule_us": med["schedule"],
                "update_us": med["update"],
                "outputs_us": med["outputs"],
                "to_next_plan_us": med["schedule"] + med["update"],
                "total_us": sum(med.values()),
            }
        )
    return cells


def driver_table(cells: list[dict[str, Any]]) -> str:
    rows = [f"{'driver (us a decode step)':28s}" + "".join(f"{'b' + str(c['batch_size']):>12s}" for c in cells)]
    for key, label in (
        ("schedule_us", "schedule"),
        ("update_us", "update_from_result"),
        ("to_next_plan_us", "result -> next plan"),
        ("outputs_us", "outputs (after the plan)"),
        ("total_us", "total"),
    ):
        rows.append(f"{label:28s}" + "".join(f"{c[key]:12.1f}" for c in cells))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.host_sections",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common.add_model_args(p)
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--context-lens", default="512")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--cuda-graphs", choices=("on", "off"), default="on")
    p.add_argument(
        "--driver",
        action="store_true",
        help="time the driver's side of a decode step (schedule, update, outputs) instead",
    )
    p.add_argument("--tokenizer", help="--driver: the tokenizer directory (default: the model's)")
    p.add_argument("--no-stop-strings", action="store_true", help="--driver: requests without stop strings")
    common.add_output_args(p, "host_sections")
    args = p.parse_args(argv)
    if args.iters < 1 or args.warmup < 0:
        raise SystemExit("--iters must be >= 1 and --warmup >= 0")
    if args.driver:
        return _driver_main(args)
    model_dir, load_format = common.model_and_format(args)
    conf = {
        "model_dir": model_dir,
        "load_format": load_format,
        "model_name": args.shape or model_dir,
        "batch_sizes": decode_roofline._ints(args.batch_sizes),
        "context_lens": decode_roofline._ints(args.context_lens),
        "warmup": args.warmup,
        "iters": args.iters,
        "cuda_graphs": args.cuda_graphs,
        "device": args.device,
        "dtype": "auto",
        "block_size": 16,
        "engine_options": {},
        "gpu_memory_utilization": 0.9,
        "profile_steps": 0,
        "temperature": 0.0,
    }
    cells = run(conf)
    print(table(cells), flush=True)
    out_path, _ = common.output_paths(args, "host_sections")
    result = common.record("host_sections", args, config=conf, cells=cells)
    common.write_json(out_path, result)
    return result


def _driver_main(args) -> dict[str, Any]:
    tokenizer = args.tokenizer or common.model_and_format(args)[0]
    conf = {
        "tokenizer": tokenizer,
        "batch_sizes": decode_roofline._ints(args.batch_sizes),
        "prompt_len": decode_roofline._ints(args.context_lens)[0],
        "steps": args.iters,
        "stop_strings": not args.no_stop_strings,
    }
    cells = driver_cells(tokenizer, conf["batch_sizes"], conf["prompt_len"], conf["steps"], conf["stop_strings"])
    print(driver_table(cells), flush=True)
    out_path, _ = common.output_paths(args, "host_sections")
    result = common.record("host_sections", args, config=conf, cells=cells)
    common.write_json(out_path, result)
    return result


if __name__ == "__main__":
    main()
