"""Offline throughput, comparable with ``vllm bench throughput``.

    ray job submit --working-dir . -- python -m benchmarks.throughput \\
        --shape qwen3-0.6b --input-len 1024 --output-len 128 --num-prompts 1000

Prints and writes (JSON) ``elapsed_time``, ``num_requests``, ``total_num_tokens``,
``requests_per_second``, ``tokens_per_second`` and ``output_tokens_per_second``
(vLLM's names), with the hardware, versions and full configuration. ``--baseline hf``
runs the same workload through transformers' ``generate_batch`` and adds the ratio.
It also measures the device's copy bandwidth and matmul rate (a Ray task on the
engine's kind of device, after the engine is shut down) and reports the workload's
own ``roofline`` (decode weight + KV bytes over the bandwidth, plus prefill FLOPs
over the matmul rate; see ``workload_roofline``) and the ``achieved_fraction`` of it.
"""

from __future__ import annotations

import argparse
import sys
import statistics
import time
from typing import Any

from benchmarks import common
from benchmarks.common import phase_medians, thread_time_medians
from benchmarks.datasets import SampleRequest, add_dataset_args, get_requests, vocab_size_of
from benchmarks.hf_baseline import hf_available, run_hf, throughput_fields, token_prompts_of


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.throughput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common.add_model_args(p)
    add_dataset_args(p)
    g = p.add_argument_group("run")
    g.add_argument("--temperature", type=float, default=1.0, help="as vllm bench: 1.0, top_p 1.0, ignore_eos")
    g.add_argument(
        "--num-warmup",
        type=int,
        default=4,
        help="untimed warm-up requests (first kernel compilation), 4 output tokens each",
    )
    g.add_argument(
        "--baseline",
        choices=("none", "hf"),
        default="none",
        help="hf: also run the workload through transformers' generate_batch",
    )
    g.add_argument("--hf-attn-implementation", default="paged|sdpa")
    common.add_engine_args(p)
    common.add_output_args(p, "throughput")
    return p.parse_args(argv)


def _worker_call(engine, method: str) -> list:
    """``method`` on every worker actor of ``engine``, their results in rank order."""
    import ray

    return ray.get([getattr(w, method).remote() for w in engine.executor.workers])


def run_engine(llm, requests: list[SampleRequest], temperature: float, num_warmup: int) -> dict[str, Any]:
    from metadata.sampling_params import SamplingParams

    if num_warmup > 0:
        warm = [r.prompt for r in requests[:num_warmup]]
        llm.generate(warm, SamplingParams(temperature=temperature, max_tokens=4, ignore_eos=True), use_tqdm=False)
    prompts = [r.prompt for r in requests]
    params = [
        SamplingParams(temperature=temperature, top_p=1.0, ignore_eos=True, max_tokens=r.expected_output_len, seed=i)
        for i, r in enumerate(requests)
    ]
    engine = llm.engine  # None under data parallelism: the replicas report their own counters
    before = dict(engine.stats) if engine is not None else {}
    if engine is not None:
        engine.timeline.clear()
        _worker_call(engine, "clear_launch_times")
    t0_mono = time.monotonic()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    if engine is not None:
        stats = {k: v - before.get(k, 0) for k, v in engine.stats.items()}  # the timed run only
    else:
        import msgspec

        stats = {"replicas": [msgspec.to_builtins(x) for x in llm.data_parallel.stats()]}
    n_in = sum(len(o.prompt_token_ids) for o in outputs)
    n_out = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    finish = sorted(
        (o.metrics.finished_time - t0_mono) for o in outputs if o.metrics and o.metrics.finished_time is not None
    )
    res = {**throughput_fields(elapsed, len(outputs), n_in, n_out), "finish_times_s": finish, "engine_stats": stats}
    if engine is not None:  # rank 0's launches: every step, and the steps no decode graph fits
        launches = _worker_call(engine, "stats")[0]
        res["worker_launch_ms"] = {
            "steps": len(launches["launch_ms"]),
            "median": statistics.median(launches["launch_ms"]) if launches["launch_ms"] else 0.0,
            "mixed_steps": len(launches["mixed_launch_ms"]),
            "mixed_median": statistics.median(launches["mixed_launch_ms"]) if launches["mixed_launch_ms"] else 0.0,
            "phases": phase_medians(launches),  # decode / mixed: median ms of each LAUNCH_PHASES
            "thread_time": thread_time_medians(launches),  # decode / mixed: (wall, thread CPU) median ms
        }
    if engine is not None and engine.timeline:  # measure_device_timeline: where the device's time went
        busy = sum(t[1] for t in engine.timeline)
        idle = sum(t[2] for t in engine.timeline if t[2] >= 0)
        res["device_timeline"] = {
            "steps": len(engine.timeline),
            "device_busy_s": busy,
            "device_idle_s": idle,
            "busy_fraction_of_elapsed": busy / elapsed,
            # per step: (rows, device seconds, idle seconds before it; -1: unknown)
            "per_step": [list(t) for t in engine.timeline],
        }
    return res


def measure_ceilings(device: str) -> dict[str, Any]:
    """The device's copy bandwidth (read + write bytes of a large copy) and dense matmul
    rate (bf16 8192^3 on a GPU, fp32 1024^3 on the CPU), measured where this runs."""
    import torch

    from benchmarks.roofline_model import measure_bandwidth

    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    bw = measure_bandwidth(dev, (2048 if dev.type == "cuda" else 128) << 20, 10 if dev.type == "cuda" else 3)
    return {
        "bandwidth_bytes_per_s": bw["bandwidth_bytes_per_s"],
        "bandwidth_method": bw["method"],
        **common.measure_matmul_rate(dev),
    }


def workload_roofline(
    arch,
    dtype_bytes: int,
    tp: int,
    prompt_lens: list[int],
    output_lens: list[int],
    max_num_seqs: int,
    ceilings: dict[str, Any],
    proj_bytes: int | None = None,
    kv_dtype_bytes: int | None = None,
) -> dict[str, Any]:
    """The workload's own floor on one GPU of the TP group (every rank reads its shard at once).

    Decode: at least ``max(max(o - 1), ceil(sum(o - 1) / max_num_seqs))`` steps, each
    reading every weight matrix once; every decode token reads its request's KV so far
    (``p + j`` tokens for the ``j``-th). Bytes over the measured copy bandwidth.
    Prefill: ``2 * matmul params`` FLOPs per prompt token, causal attention
    ``2 * p^2 * heads * head_dim`` per layer, one LM-head row per request; FLOPs over the
    measured matmul rate. Decode compute and prefill weight reads are not counted.
    ``proj_bytes`` / ``kv_dtype_bytes``: bytes per element of the decoder projections and the
    KV cache where they differ from ``dtype_bytes`` (1 with FP8 weights / an FP8 KV cache;
    the prefill FLOPs then still count at the measured 16-bit rate, a conservative floor)."""
    h, d = arch.hidden_size, arch.head_dim
    qkv_out = (arch.num_heads + 2 * arch.num_kv_heads) * d
    layer = h * qkv_out + arch.num_heads * d * h + 3 * arch.intermediate_size * h
    layer_extra = 2 * h + (qkv_out if arch.qkv_bias else 0) + (2 * d if arch.qk_norm else 0)
    lm_head = arch.vocab_size * h
    pb = dtype_bytes if proj_bytes is None else proj_bytes
    weight_bytes_step = (arch.num_layers * (layer * pb + layer_extra * dtype_bytes) + (h + lm_head) * dtype_bytes) / tp
    decode = [max(0, o - 1) for o in output_lens]
    steps = max(max(decode, default=0), -(-sum(decode) // max(1, max_num_seqs)))
    kv_tok = arch.kv_bytes_per_token(dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes, tp)
    kv_bytes = sum(kv_tok * (o * p + o * (o - 1) // 2) for p, o in zip(prompt_lens, decode))
    flops = (
        sum(
            2 * arch.num_layers * layer * p + 2 * arch.num_layers * p * p * arch.num_heads * d + 2 * lm_head
            for p in prompt_lens
        )
        / tp
    )
    bw, rate = ceilings["bandwidth_bytes_per_s"], ceilings["matmul_flops_per_s"]
    mem_s = (steps * weight_bytes_step + kv_bytes) / bw
    comp_s = flops / rate
    total_out = sum(output_lens)
    return {
        **ceilings,
        "decode_steps": steps,
        "weight_bytes_per_step": weight_bytes_step,
        "weight_bytes_total": steps * weight_bytes_step,
        "kv_bytes_total": kv_bytes,
        "prefill_flops": flops,
        "decode_memory_s": mem_s,
        "prefill_compute_s": comp_s,
        "roofline_s": mem_s + comp_s,
        "roofline_output_tokens_per_s": total_out / (mem_s + comp_s),
    }


def _remote(fn, device: str, *args):
    """Run ``fn`` in a Ray task on the engine's kind of device."""
    import ray

    gpu = device == "cuda"
    task = ray.remote(num_cpus=0 if gpu else 1, num_gpus=1 if gpu else 0)(fn)
    return ray.get(task.remote(*args))


def print_summary(res: dict[str, Any], label: str = "") -> None:
    print(
        f"{label}Throughput: {res['requests_per_second']:.2f} requests/s, "
        f"{res['tokens_per_second']:.2f} total tokens/s, "
        f"{res['output_tokens_per_second']:.2f} output tokens/s"
    )
    print(f"{label}Total num prompt tokens:  {res['total_num_prompt_tokens']}")
    print(f"{label}Total num output tokens:  {res['total_num_output_tokens']}", flush=True)
    st, tl = res.get("engine_stats") or {}, res.get("device_timeline")
    if "driver_wait_s" in st:
        print(
            f"{label}Driver: schedule {st.get('driver_schedule_s', 0):.3f} s, process "
            f"{st.get('driver_process_s', 0):.3f} s, waiting on workers {st['driver_wait_s']:.3f} s; "
            f"worker launch (host) {st.get('worker_launch_s', 0):.3f} s over {st.get('steps', 0)} steps"
        )
    host = host_against_device(res)
    if host:
        print(f"{label}{host}")
    wl = res.get("worker_launch_ms")
    if wl and wl["steps"]:
        print(
            f"{label}Worker launch per step (host, rank 0): median {wl['median']:.2f} ms over {wl['steps']} steps; "
            f"steps no decode graph fits (prefill, mixed): {wl['mixed_steps']}, median {wl['mixed_median']:.2f} ms"
        )
        from workers.model_runner import LAUNCH_PHASES

        for kind, medians in wl.get("phases", {}).items():
            if medians:
                split = ", ".join(f"{name} {m:.2f}" for name, m in zip(LAUNCH_PHASES, medians))
                print(f"{label}  {kind} launch, median ms by phase: {split}")
        for kind, (wall, cpu) in wl.get("thread_time", {}).items():
            print(f"{label}  {kind} launch, median ms: wall {wall:.2f}, the launching thread's CPU {cpu:.2f}")
    if tl:
        print(
            f"{label}Device: busy {tl['device_busy_s']:.3f} s, idle between steps {tl['device_idle_s']:.3f} s "
            f"({100 * tl['busy_fraction_of_elapsed']:.1f} % of elapsed busy)",
            flush=True,
        )


def host_against_device(res: dict[str, Any]) -> str | None:
    """One line: a step's host time (the worker's launch; the driver's scheduling and result
    processing, one thread) beside its device time, means over the timed steps, and whether
    both host parts stay below it (the device sets the pace). The device time is the busy
    time of ``measure_device_timeline`` where it ran, else the elapsed time a step (an upper
    bound: idle gaps included). None without the engine's counters."""
    st, tl = res.get("engine_stats") or {}, res.get("device_timeline")
    steps = st.get("steps", 0)
    if not steps:
        return None
    launch = 1e3 * st.get("worker_launch_s", 0.0) / steps
    driver = 1e3 * (st.get("driver_schedule_s", 0.0) + st.get("driver_process_s", 0.0)) / steps
    if tl and tl["steps"]:
        device, what = 1e3 * tl["device_busy_s"] / tl["steps"], "device busy"
    else:
        device, what = 1e3 * res["elapsed_time"] / steps, "elapsed (device time unmeasured)"
    verdict = "below" if max(launch, driver) < device else "NOT below"
    return (
        f"Per step (means over {steps}): {what} {device:.2f} ms; host: worker launch {launch:.2f} ms, "
        f"driver schedule + process {driver:.2f} ms: {verdict} the device time"
    )


def plot(result: dict[str, Any], path) -> None:
    plt = common.pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    t = result.get("finish_times_s") or []
    a.step([0.0, *t], list(range(len(t) + 1)), where="post", label="syncless")
    a.set_xlabel("time since start (s)")
    a.set_ylabel("requests finished")
    a.set_title(f"{result['config']['model_name']}: {result['num_requests']} requests")
    a.grid(alpha=0.3)
    names, vals = ["syncless"], [result["output_tokens_per_second"]]
    base = result.get("baseline") or {}
    if "output_tokens_per_second" in base:
        names.append("transformers")
        vals.append(base["output_tokens_per_second"])
    b.bar(names, vals, color=["tab:blue", "tab:orange"][: len(vals)])
    b.set_ylabel("output tokens/s")
    b.set_title("output throughput")
    common.save_figure(fig, path)


def _roofline(model_dir, engine_cfg, device, opts, requests, res) -> dict[str, Any] | None:
    """Measure the ceilings on the engine's kind of device (after the engine is gone) and
    put the run against the workload's roofline; failures are reported, not raised."""
    try:
        from workers.models.arch import load_arch

        arch = load_arch(model_dir)
        dtype = engine_cfg["model"]["dtype"]
        nbytes = {"float32": 4, "bfloat16": 2, "float16": 2}.get(dtype, 2 if device == "cuda" else 4)
        tp = int(engine_cfg.get("parallel", {}).get("tensor_parallel_size", 1) or 1)
        ceil = _remote(measure_ceilings, device, device)
        roof = workload_roofline(
            arch,
            nbytes,
            tp,
            [r.prompt_len for r in requests],
            [r.expected_output_len for r in requests],
            engine_cfg["scheduler"]["max_num_seqs"],
            ceil,
            proj_bytes=1 if engine_cfg["model"].get("quantization") == "fp8" or arch.quantization == "fp8" else None,
            kv_dtype_bytes=1 if engine_cfg["cache"].get("kv_cache_dtype", "auto").startswith("fp8") else None,
        )
    except Exception as exc:  # the throughput numbers stand on their own
        print(f"workload roofline: not computed ({exc!r})", file=sys.stderr)
        return {"error": repr(exc)}
    roof["achieved_fraction"] = roof["roofline_s"] / res["elapsed_time"]
    print(
        f"Workload roofline: {roof['roofline_s']:.3f} s (decode memory {roof['decode_memory_s']:.3f} s over "
        f"{roof['bandwidth_bytes_per_s'] / 1e9:.0f} GB/s, prefill compute {roof['prefill_compute_s']:.3f} s "
        f"over {roof['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s) = "
        f"{roof['roofline_output_tokens_per_s']:.0f} output tok/s; achieved "
        f"{100 * roof['achieved_fraction']:.1f} % of it",
        flush=True,
    )
    return roof


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    out_path, png = common.output_paths(args, "throughput")
    model_dir, load_format = common.model_and_format(args)
    opts = common.engine_options(args)
    if args.baseline == "hf" and hf_available():
        raise SystemExit(f"--baseline hf: {hf_available()}")
    from cluster import LLM

    t0 = time.perf_counter()
    llm = LLM(model=model_dir, load_format=load_format, **opts)
    init_s = time.perf_counter() - t0
    tokenizer = llm.get_tokenizer()
    requests = get_requests(args, vocab_size_of(model_dir), tokenizer)
    core = llm.engine or llm.data_parallel  # one engine, or the data-parallel replicas' front
    max_model_len = core.max_model_len
    too_long = [r for r in requests if r.prompt_len + r.expected_output_len > max_model_len]
    if too_long:
        raise SystemExit(
            f"{len(too_long)} requests exceed max_model_len {max_model_len}; "
            "lower --input-len/--output-len or raise --max-model-len"
        )
    device = core.device
    engine_cfg = llm.config.to_dict()
    print(f"engine ready in {init_s:.1f} s on {device}; running {len(requests)} requests", flush=True)
    res = run_engine(llm, requests, args.temperature, args.num_warmup)
    llm.shutdown()
    print_summary(res)
    roof = _roofline(model_dir, engine_cfg, device, opts, requests, res)
    result = common.record("throughput", args)
    result.update(res)
    result["config"] = {
        "model_name": args.shape or model_dir,
        "model_dir": model_dir,
        "load_format": load_format,
        "engine_options": opts,
        "engine_config": engine_cfg,
        "device": device,
        "engine_init_s": init_s,
        "max_model_len": max_model_len,
        "dataset": args.dataset,
        "num_prompts": len(requests),
    }
    if roof is not None:
        result["roofline"] = roof
    result["worker_hardware"] = common.remote_hardware_info(1 if device == "cuda" else 0)
    result["ray_cluster"] = common.ray_cluster_info()
    if args.baseline == "hf":
        prompts = token_prompts_of(requests, tokenizer)
        base = _remote(
            run_hf,
            device,
            model_dir,
            load_format,
            prompts,
            [r.expected_output_len for r in requests],
            engine_cfg["model"]["dtype"],
            args.hf_attn_implementation,
            device,
        )
        result["baseline"] = base
        if "error" not in base and not base.get("output_tokens_per_second"):
            base["error"] = "transformers generate_batch produced no output tokens (see its log)"
        if "error" in base:
            print(f"baseline hf: {base['error']}", file=sys.stderr)
        else:
            print_summary(base, "[transformers] ")
            result["ratio_vs_baseline"] = {
                k: res[k] / base[k] for k in ("requests_per_second", "tokens_per_second", "output_tokens_per_second")
            }
            print(
                f"syncless / transformers output tokens/s: "
                f"{result['ratio_vs_baseline']['output_tokens_per_second']:.2f}x",
                flush=True,
            )
    common.write_json(out_path, result)
    if png:
        plot(result, png)
    return result


if __name__ == "__main__":
    main()
