"""Prefix caching on a shared-prefix workload: TTFT and throughput with and without it.

    ray job submit --working-dir . -- python -m benchmarks.prefix_cache \\
        --shape llama-3.1-8b --num-prompts 200 --prefix-len 2000 --suffix-len 32 --output-len 64

Every request is one of ``--num-prefixes`` shared prefixes (a system prompt) plus
its own random suffix. Each mode (``--modes on,off``) gets a fresh engine: an
untimed warm-up on unrelated prompts, then

1. the batch: all requests submitted at once (offline, like ``vllm bench
   throughput``): vLLM's throughput fields, and TTFT (arrival to first token)
   mean / median / p90 / p99 over the requests;
2. TTFT probes: single requests one at a time, each a shared prefix plus a new
   suffix (the prefix is warm, as for the next turn of a chat).

The result (JSON) holds both modes, the prefix-cache stats (queries, hits, hit
rate, evictions), the on/off ratios, and the share of requests whose greedy
outputs agree. ``--smoke`` runs a tiny model on the CPU in seconds.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from benchmarks import common
from benchmarks.hf_baseline import throughput_fields

SMOKE = {"num_prompts": 8, "prefix_len": 40, "suffix_len": 5, "output_len": 4, "num_ttft_probes": 2, "num_warmup": 1}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.prefix_cache",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common.add_model_args(p)
    g = p.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=200)
    g.add_argument("--prefix-len", type=int, default=2000, help="tokens of each shared prefix")
    g.add_argument("--num-prefixes", type=int, default=1, help="distinct shared prefixes (round robin)")
    g.add_argument("--suffix-len", type=int, default=32, help="tokens of each request's own suffix")
    g.add_argument("--output-len", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--num-ttft-probes", type=int, default=8)
    g.add_argument("--num-warmup", type=int, default=2, help="untimed requests on unrelated prompts")
    g.add_argument("--modes", default="on,off", help="prefix caching on / off, in this order")
    g.add_argument("--smoke", action="store_true", help="tiny model on the CPU, a handful of requests")
    common.add_engine_args(p)
    common.add_output_args(p, "prefix_cache")
    args = p.parse_args(argv)
    if args.smoke:
        for k, v in SMOKE.items():
            if getattr(args, k) == p.get_default(k):
                setattr(args, k, v)
        if not args.shape and not args.model:
            args.shape = "tiny"
        args.device = args.device or "cpu"
        if args.max_num_batched_tokens is None:  # a few requests per step: later ones hit the cache
            args.max_num_batched_tokens = 64
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in ("on", "off") for m in modes):
        raise SystemExit(f"--modes takes 'on' and/or 'off', got {args.modes!r}")
    args.mode_list = modes
    for name in ("num_prompts", "prefix_len", "suffix_len", "output_len", "num_prefixes"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    return args


def workload(args: argparse.Namespace, vocab: int) -> dict[str, list[list[int]]]:
    rng = random.Random(args.seed)

    def toks(n):
        return [rng.randrange(3, vocab) for _ in range(n)]

    prefixes = [toks(args.prefix_len) for _ in range(args.num_prefixes)]
    total = args.prefix_len + args.suffix_len
    return {
        "batch": [prefixes[i % len(prefixes)] + toks(args.suffix_len) for i in range(args.num_prompts)],
        "probes": [prefixes[i % len(prefixes)] + toks(args.suffix_len) for i in range(args.num_ttft_probes)],
        "warmup": [toks(total) for _ in range(args.num_warmup)],
    }


def _ms_stats(values: list[float]) -> dict[str, float]:
    import numpy as np

    if not values:
        return {}
    a = np.asarray(values) * 1e3
    return {
        "mean_ms": float(a.mean()),
        "median_ms": float(np.median(a)),
        "p90_ms": float(np.percentile(a, 90)),
        "p99_ms": float(np.percentile(a, 99)),
        "min_ms": float(a.min()),
        "max_ms": float(a.max()),
    }


def _ttfts(outputs) -> list[float]:
    return [
        o.metrics.first_token_time - o.metrics.arrival_time
        for o in outputs
        if o.metrics and o.metrics.first_token_time is not None
    ]


def run_mode(
    args: argparse.Namespace,
    model_dir: str,
    load_format: str,
    opts: dict,
    on: bool,
    prompts: dict[str, list[list[int]]],
) -> dict[str, Any]:
    from cluster import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=model_dir, load_format=load_format, enable_prefix_caching=on, **opts)
    init_s = time.perf_counter() - t0
    try:
        sch = llm.engine.scheduler
        if prompts["warmup"]:
            llm.generate(
                [{"prompt_token_ids": p} for p in prompts["warmup"]],
                SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                use_tqdm=False,
            )
        before = sch.prefix_cache_stats()
        params = [
            SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=args.output_len, seed=i)
            for i in range(len(prompts["batch"]))
        ]
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts["batch"]], params, use_tqdm=True)
        elapsed = time.perf_counter() - start
        stats = sch.prefix_cache_stats()
        n_in = sum(len(o.prompt_token_ids) for o in outs)
        n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
        res: dict[str, Any] = {
            "prefix_caching": on,
            "engine_init_s": init_s,
            **throughput_fields(elapsed, len(outs), n_in, n_out),
            "ttft": _ms_stats(_ttfts(outs)),
            "num_preemptions": sch.num_preemptions,
        }
        res["prefix_cache"] = _window(before, stats)
        probe_ttft = []
        for p in prompts["probes"]:
            o = llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
            probe_ttft += _ttfts(o)
        res["probe_ttft"] = _ms_stats(probe_ttft)
        res["prefix_cache_total"] = sch.prefix_cache_stats()
        res["output_token_ids"] = [o.outputs[0].token_ids for o in outs]
        res["engine_config"] = llm.config.to_dict()
        res["device"] = llm.engine.device
        return res
    finally:
        llm.shutdown()


def _window(before: dict, after: dict) -> dict:
    """The batch's own prefix-cache counters (warm-up excluded)."""
    q = after["queries"] - before["queries"]
    h = after["hits"] - before["hits"]
    return dict(
        after, queries=q, hits=h, hit_rate=h / q if q else 0.0, evictions=after["evictions"] - before["evictions"]
    )


def print_table(runs: dict[str, dict]) -> None:
    print(
        f"{'caching':>8} {'req/s':>8} {'tok/s':>10} {'out tok/s':>10} {'TTFT mean':>10} {'TTFT p99':>10} "
        f"{'probe TTFT':>11} {'hit rate':>9}"
    )
    for mode, r in runs.items():
        print(
            f"{mode:>8} {r['requests_per_second']:8.2f} {r['tokens_per_second']:10.1f} "
            f"{r['output_tokens_per_second']:10.1f} {r['ttft'].get('mean_ms', 0):8.1f}ms "
            f"{r['ttft'].get('p99_ms', 0):8.1f}ms {r['probe_ttft'].get('mean_ms', 0):9.1f}ms "
            f"{r['prefix_cache']['hit_rate']:9.3f}",
            flush=True,
        )


def plot(result: dict[str, Any], path) -> None:
    plt = common.pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    runs = result["runs"]
    names = list(runs)
    a.bar(names, [runs[n]["output_tokens_per_second"] for n in names], color="tab:blue")
    a.set_ylabel("output tokens/s")
    a.set_xlabel("prefix caching")
    b.bar(names, [runs[n]["ttft"].get("mean_ms", 0) for n in names], label="batch mean", alpha=0.7)
    b.bar(names, [runs[n]["probe_ttft"].get("mean_ms", 0) for n in names], label="single request", alpha=0.7)
    b.set_ylabel("TTFT (ms)")
    b.legend()
    fig.suptitle(
        f"{result['config']['model_name']}: {result['config']['num_prompts']} requests, "
        f"{result['config']['prefix_len']}-token shared prefix"
    )
    common.save_figure(fig, path)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    out_path, png = common.output_paths(args, "prefix_cache")
    model_dir, load_format = common.model_and_format(args)
    opts = common.engine_options(args)
    opts.setdefault("max_model_len", args.prefix_len + args.suffix_len + args.output_len + 8)
    from benchmarks.datasets import vocab_size_of

    prompts = workload(args, vocab_size_of(model_dir))
    runs = {}
    for mode in args.mode_list:
        print(f"prefix caching {mode}: {args.num_prompts} requests, prefix {args.prefix_len} tokens", flush=True)
        runs[mode] = run_mode(args, model_dir, load_format, opts, mode == "on", prompts)
    print_table(runs)
    result = common.record("prefix_cache", args)
    result["config"] = {
        "model_name": args.shape or model_dir,
        "model_dir": model_dir,
        "load_format": load_format,
        "engine_options": opts,
        "num_prompts": args.num_prompts,
        "prefix_len": args.prefix_len,
        "num_prefixes": args.num_prefixes,
        "suffix_len": args.suffix_len,
        "output_len": args.output_len,
        "device": next(iter(runs.values()))["device"],
    }
    if "on" in runs and "off" in runs:
        on, off = runs["on"], runs["off"]
        result["ratio_on_over_off"] = {
            k: on[k] / off[k] for k in ("requests_per_second", "tokens_per_second", "output_tokens_per_second")
        }
        for key in ("ttft", "probe_ttft"):
            if on[key] and off[key] and on[key]["mean_ms"] > 0:
                result["ratio_on_over_off"][f"{key}_speedup"] = off[key]["mean_ms"] / on[key]["mean_ms"]
        pairs = list(zip(on["output_token_ids"], off["output_token_ids"]))
        same = sum(a == b for a, b in pairs)
        result["outputs_equal_fraction"] = same / len(pairs)
        # random-weight models have near-tied logits: in bf16 one flip ends a run of equal tokens,
        # so the tokens agreeing before the first difference say more than whole-output equality
        agree = [_common_prefix(a, b) for a, b in pairs]
        result["outputs_agreeing_prefix_tokens_mean"] = sum(agree) / len(agree)
        result["outputs_first_token_equal_fraction"] = sum(n > 0 for n in agree) / len(agree)
        print(
            f"caching on / off: output throughput {result['ratio_on_over_off']['output_tokens_per_second']:.2f}x, "
            f"outputs equal for {same}/{len(pairs)} requests, mean agreeing prefix "
            f"{result['outputs_agreeing_prefix_tokens_mean']:.1f} of {args.output_len} tokens",
            flush=True,
        )
    for r in runs.values():
        r.pop("output_token_ids")
    result["runs"] = runs
    result["worker_hardware"] = common.remote_hardware_info(1 if result["config"]["device"] == "cuda" else 0)
    result["ray_cluster"] = common.ray_cluster_info()
    common.write_json(out_path, result)
    if png:
        plot(result, png)
    return result


if __name__ == "__main__":
    main()
