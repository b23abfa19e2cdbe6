"""Decode step time per (batch size, context length) against the memory roofline.

    ray job submit --working-dir . -- python -m benchmarks.decode_roofline \\
        --shape llama-3.1-8b --batch-sizes 1,8,32,128,256 --context-lens 512,4096 --plot

It first measures the device's copy bandwidth itself (a large ``torch`` copy:
bytes read + written over time, CUDA events on a GPU, ``perf_counter`` on the
CPU), then drives a ``workers.model_runner.ModelRunner`` directly with step
plans (``metadata.wire`` structs). Each cell places ``batch`` requests whose
device state claims ``context`` tokens of KV already computed (no prefill is
run: the cache holds zeros, which costs attention exactly what real values
cost), then times decode steps of one token per request, pipelined as under async
scheduling (step k+1 launched before step k's tokens are read; the serial time,
each step waited for before the next, is reported too). The roofline of a
step is (weight bytes + KV bytes read) / measured bandwidth; ``ratio`` is the
measured step time over it (1.0 = at the roofline). ``floor_ratio`` divides by a floor taken
phase by phase instead (``phase_floor_s``: GEMMs at the larger of their weight read and their
FLOPs over a matmul rate measured in the same run, then the KV read), which large batches
of large models reach before the memory roofline.

Inside ``ray job submit`` (or with ``--placement ray``) the measurement runs in
a Ray task holding one GPU (one CPU on a CPU-only cluster); otherwise in-process.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from benchmarks import common
from benchmarks.decode_bench import Bench, measure  # noqa: F401 - Bench: benchmarks.host_sections


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.decode_roofline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common.add_model_args(p)
    p.add_argument("--batch-sizes", default="1,8,32,128,256")
    p.add_argument("--context-lens", default="512,4096")
    p.add_argument("--warmup", type=int, default=5, help="untimed decode steps per cell")
    p.add_argument("--iters", type=int, default=20, help="timed decode steps per cell")
    p.add_argument("--cuda-graphs", choices=("on", "off"), default="on")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument(
        "--bandwidth-mib", type=int, default=None, help="copy-bandwidth buffer size (default 2048 on GPU, 256 on CPU)"
    )
    p.add_argument("--bandwidth-iters", type=int, default=10)
    p.add_argument(
        "--placement",
        choices=("auto", "local", "ray"),
        default="auto",
        help="auto: a Ray task inside `ray job submit`, else in-process",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="shard the model over this many devices (one Ray actor per rank; NCCL on "
        "GPUs, gloo on CPUs); the roofline is per rank: its weight and KV shards "
        "over its own measured copy bandwidth",
    )
    p.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument(
        "--skinny-max-m",
        type=int,
        default=None,
        help="decode batches up to this size use the fused Triton skinny GEMM "
        "(kernels.ops.SKINNY_MAX_M; 0 = cuBLAS + separate norm/act kernels)",
    )
    p.add_argument(
        "--profile",
        action="append",
        default=[],
        metavar="BATCH,CONTEXT",
        help="also profile this cell's decode steps (torch.profiler): per-step kernel "
        "time by kernel name, in the result and printed (repeatable)",
    )
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples every row with its own seed"
    )
    common.add_output_args(p, "decode_roofline")
    return p.parse_args(argv)


def _ints(text: str) -> list[int]:
    return sorted({int(x) for x in text.split(",") if x.strip()})


def plot(result: dict[str, Any], path) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, ctx in enumerate(result["config"]["context_lens"]):
        cells = [c for c in result["cells"] if c["context_len"] == ctx and "skipped" not in c]
        if not cells:
            continue
        bs = [c["batch_size"] for c in cells]
        color = f"C{i}"
        ax.plot(bs, [c["step_ms_median"] for c in cells], "o-", color=color, label=f"measured, context {ctx}")
        ax.plot(bs, [c["roofline_ms"] for c in cells], "--", color=color, label=f"roofline, context {ctx}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode step time (ms)")
    bw = result["bandwidth"]["bandwidth_bytes_per_s"] / 1e9
    ax.set_title(
        f"{result['config']['model_name']} on {result['device']} ({bw:.0f} GB/s copy), graphs: {result['cuda_graphs']}",
        fontsize=9,
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    common.save_figure(fig, path)


def _run_placed(conf: dict[str, Any], placement: str, tp_size: int = 1) -> dict[str, Any]:
    if tp_size > 1:
        from benchmarks import decode_tp

        return decode_tp.run(conf, tp_size)
    use_ray = placement == "ray" or (placement == "auto" and common.in_ray_job())
    if not use_ray:
        return dict(measure(conf), placement="in-process")
    import ray

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS") or "auto", log_to_driver=True)
    gpu = conf["device"] != "cpu" and ray.cluster_resources().get("GPU", 0) > 0
    task = ray.remote(num_cpus=0 if gpu else 1, num_gpus=1 if gpu else 0)(measure)
    return dict(ray.get(task.remote(conf)), placement=f"ray task ({'1 GPU' if gpu else '1 CPU'})")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    out_path, png = common.output_paths(args, "decode_roofline")
    model_dir, load_format = common.model_and_format(args)
    opts = common.engine_options(argparse.Namespace(engine_option=args.engine_option))
    conf = {
        "model_dir": model_dir,
        "load_format": load_format,
        "model_name": args.shape or model_dir,
        "batch_sizes": _ints(args.batch_sizes),
        "context_lens": _ints(args.context_lens),
        "warmup": args.warmup,
        "iters": args.iters,
        "cuda_graphs": args.cuda_graphs,
        "device": args.device,
        "dtype": args.dtype,
        "block_size": args.block_size,
        "engine_options": opts,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "bandwidth_mib": args.bandwidth_mib,
        "bandwidth_iters": args.bandwidth_iters,
        "skinny_max_m": args.skinny_max_m,
        "profile_cells": [[int(v) for v in c.split(",")] for c in args.profile],
        "profile_steps": args.profile_steps,
        "temperature": args.temperature,
    }
    if args.iters < 1 or args.warmup < 0:
        raise SystemExit("--iters must be >= 1 and --warmup >= 0")
    if args.tensor_parallel_size < 1:
        raise SystemExit(f"--tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}")
    if args.tensor_parallel_size > 1 and args.placement == "local":
        raise SystemExit("--tensor-parallel-size > 1 runs one Ray actor per rank; drop --placement local")
    if not args.temperature >= 0:
        raise SystemExit(f"--temperature must be >= 0, got {args.temperature}")
    res = _run_placed(conf, args.placement, args.tensor_parallel_size)
    result = common.record("decode_roofline", args, config=conf, **res)
    common.write_json(out_path, result)
    if png:
        plot(result, png)
    return result


if __name__ == "__main__":
    main()
