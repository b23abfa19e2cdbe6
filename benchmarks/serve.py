"""Online serving benchmark against a running ``cluster.serve``, comparable with ``vllm bench serve``.

    python -m cluster.serve --model DIR &          # or any OpenAI-compatible server
    ray job submit --working-dir . -- python -m benchmarks.serve --shape qwen3-0.6b \\
        --host HEAD_IP --port 8000 --request-rate 8 --num-prompts 500

Requests arrive as a Poisson process (``--request-rate``, gamma with
``--burstiness``; ``inf`` sends all at once), optionally capped at
``--max-concurrency`` in flight. Reports, as vLLM does, ``request_throughput``,
``output_throughput``, ``total_token_throughput`` and mean / median / std /
p90 / p99 of ``ttft_ms``, ``tpot_ms``, ``itl_ms`` and ``e2el_ms``.
``--backend grpc`` streams over ``syncless.v1.Generation/Generate`` instead.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any, AsyncIterator

import numpy as np

from benchmarks import common
from benchmarks.datasets import SampleRequest, add_dataset_args, get_requests, vocab_size_of
from benchmarks.serve_client import GrpcClient, HttpClient, RequestFuncOutput

METRICS = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    g = p.add_argument_group("server")
    g.add_argument("--backend", choices=("http", "grpc"), default="http")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=None, help="default 8000 (http) / 50051 (grpc)")
    g.add_argument("--base-url", default=None, help="http: overrides --host/--port")
    g.add_argument("--served-model-name", default=None, help="default: the server's first model")
    g.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for the server")
    g.add_argument("--request-timeout", type=float, default=6 * 3600.0)
    g.add_argument(
        "--prompt-format",
        choices=("token_ids", "text"),
        default="token_ids",
        help="http: send token-id prompts (exact lengths) or their decoded text",
    )
    common.add_model_args(p)
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the --model/--shape one)")
    p.add_argument("--vocab-size", type=int, default=None, help="random prompts' vocabulary if no model is given")
    add_dataset_args(p)
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s; inf = all at once")
    g.add_argument(
        "--request-rates",
        type=_rates,
        default=None,
        help="comma-separated rates (e.g. 2,8,32,inf): one run each against the same server, "
        "then a table of throughput, TTFT and TPOT (median / p99); overrides --request-rate",
    )
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    g.add_argument("--max-concurrency", type=int, default=None)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    g.add_argument("--metric-percentiles", default="90,99")
    g.add_argument("--disable-warmup", action="store_true", help="skip the untimed first test request")
    g = p.add_argument_group("launch (optional)")
    g.add_argument(
        "--launch-server",
        action="store_true",
        help="start `python -m cluster.serve` for the model with the engine flags below "
        "(--data-parallel-size, --tensor-parallel-size, ...) on free ports, benchmark it, stop it",
    )
    g.add_argument("--server-log", default=None, help="--launch-server: the server's log file (default: a temp file)")
    common.add_engine_args(p)
    common.add_output_args(p, "serve")
    return p.parse_args(argv)


def _rates(text: str) -> list[float]:
    try:
        rates = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"rates must be numbers or inf, got {text!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be positive (inf: all at once), got {text!r}")
    return rates


def sweep_table(runs: list[dict[str, Any]]) -> str:
    """One markdown row a rate: request and output throughput, TTFT and TPOT median / p99."""
    lines = [
        "| rate (req/s) | req/s | output tok/s | TTFT median / p99 (ms) | TPOT median / p99 (ms) | failed |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in runs:
        ttft = f"{r.get('median_ttft_ms', float('nan')):.1f} / {r.get('p99_ttft_ms', float('nan')):.1f}"
        tpot = f"{r.get('median_tpot_ms', float('nan')):.2f} / {r.get('p99_tpot_ms', float('nan')):.2f}"
        lines.append(
            f"| {r['config']['request_rate']:g} | {r['request_throughput']:.2f} | {r['output_throughput']:.1f} "
            f"| {ttft} | {tpot} | {r['failed']} |"
        )
    return "\n".join(lines)


async def arrivals(
    requests: list[SampleRequest], rate: float, burstiness: float, seed: int
) -> AsyncIterator[tuple[int, SampleRequest]]:
    """``vllm bench serve``'s arrival process: gamma intervals of mean 1/rate."""
    rng = np.random.default_rng(seed)
    for i, req in enumerate(requests):
        yield i, req
        if rate == float("inf") or i == len(requests) - 1:
            continue
        await asyncio.sleep(float(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness))))


def _p_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def calculate_metrics(
    requests: list[SampleRequest],
    outputs: list[RequestFuncOutput],
    duration: float,
    selected: list[str],
    percentiles: list[float],
) -> dict[str, Any]:
    """vLLM's metrics: per-request TPOT, ITL over all chunk gaps, throughput over the run."""
    out_lens, ttfts, tpots, itls, e2els, errors = [], [], [], [], [], []
    completed = total_input = 0
    for req, o in zip(requests, outputs):
        if not o.success:
            out_lens.append(0)
            errors.append(o.error)
            continue
        out_lens.append(o.output_tokens)
        total_input += o.prompt_len or req.prompt_len
        if o.output_tokens > 1:
            tpots.append((o.latency - o.ttft) / (o.output_tokens - 1))
        itls += o.itl
        ttfts.append(o.ttft)
        e2els.append(o.latency)
        completed += 1
    total_output = sum(out_lens)
    res: dict[str, Any] = {
        "duration": duration,
        "completed": completed,
        "failed": len(outputs) - completed,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / duration,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
    }
    series = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}
    for m in selected:
        vals = np.asarray(series[m] or [0.0]) * 1000.0
        res[f"mean_{m}_ms"] = float(np.mean(vals))
        res[f"median_{m}_ms"] = float(np.median(vals))
        res[f"std_{m}_ms"] = float(np.std(vals))
        for p in percentiles:
            res[f"p{_p_word(p)}_{m}_ms"] = float(np.percentile(vals, p))
    res.update(
        input_lens=[r.prompt_len for r in requests],
        output_lens=out_lens,
        ttfts=ttfts,
        itls=[o.itl for o in outputs],
        e2els=e2els,
        tpots=tpots,
        errors=errors,
    )
    return res


def print_report(res: dict[str, Any], args: argparse.Namespace, selected: list[str], percentiles: list[float]) -> None:
    print("{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="))
    rows = [
        ("Successful requests:", res["completed"]),
        ("Failed requests:", res["failed"]),
        ("Benchmark duration (s):", f"{res['duration']:.2f}"),
        ("Total input tokens:", res["total_input_tokens"]),
        ("Total generated tokens:", res["total_output_tokens"]),
        ("Request throughput (req/s):", f"{res['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{res['output_throughput']:.2f}"),
        ("Total Token throughput (tok/s):", f"{res['total_token_throughput']:.2f}"),
    ]
    for k, v in rows:
        print(f"{k:<40}{v:<10}")
    for m in selected:
        print("{s:{c}^50}".format(s=METRICS[m], c="-"))
        name = m.upper()
        print(f"{'Mean ' + name + ' (ms):':<40}{res[f'mean_{m}_ms']:<10.2f}")
        print(f"{'Median ' + name + ' (ms):':<40}{res[f'median_{m}_ms']:<10.2f}")
        for p in percentiles:
            print(f"{'P' + _p_word(p) + ' ' + name + ' (ms):':<40}{res[f'p{_p_word(p)}_{m}_ms']:<10.2f}")
    print("=" * 50, flush=True)
    if res["errors"]:
        print(f"first error: {res['errors'][0]}", flush=True)


async def run(args: argparse.Namespace, client, requests: list[SampleRequest]) -> tuple[list, float]:
    from tqdm.auto import tqdm

    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    bar = tqdm(total=len(requests), desc="requests", dynamic_ncols=True)

    async def one(i: int, req: SampleRequest) -> RequestFuncOutput:
        if sem is None:
            o = await client.send(req, args.temperature, args.seed + i)
        else:
            async with sem:
                o = await client.send(req, args.temperature, args.seed + i)
        bar.update(1)
        return o

    start = time.perf_counter()
    tasks = []
    async for i, req in arrivals(requests, args.request_rate, args.burstiness, args.seed):
        tasks.append(asyncio.create_task(one(i, req)))
    outputs = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    bar.close()
    return list(outputs), duration


def _tokenizer_and_vocab(args: argparse.Namespace, server_info: dict) -> tuple[Any, int | None, str | None]:
    model_dir = None
    if args.shape or args.model:
        model_dir, _ = common.model_and_format(args)
    tok_dir = args.tokenizer or model_dir
    tok = None
    # token-id prompts of the random dataset need only the vocabulary size
    needed = args.tokenizer or args.prompt_format == "text" or args.dataset != "random"
    if tok_dir and needed:
        from cluster.model_source import load_tokenizer

        tok = load_tokenizer(model_dir or tok_dir, args.tokenizer)  # a GGUF file's own too
    vocab = args.vocab_size or (vocab_size_of(model_dir) if model_dir else None)
    vocab = vocab or int(server_info.get("vocab_size") or 0) or None
    return tok, vocab, model_dir


def plot(res: dict[str, Any], selected: list[str], path: Path) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, len(selected), figsize=(4 * len(selected), 3.6), squeeze=False)
    series = {
        "ttft": res["ttfts"],
        "tpot": res["tpots"],
        "itl": [x for r in res["itls"] for x in r],
        "e2el": res["e2els"],
    }
    for ax, m in zip(axes[0], selected):
        v = np.sort(np.asarray(series[m], dtype=float) * 1000.0)
        if len(v):
            ax.plot(v, np.arange(1, len(v) + 1) / len(v))
        ax.set_xlabel(f"{m.upper()} (ms)")
        ax.set_ylabel("fraction of requests" if m != "itl" else "fraction of gaps")
        ax.set_title(METRICS[m], fontsize=9)
        ax.grid(alpha=0.3)
    fig.suptitle(
        f"{res['config']['backend']} rate={res['config']['request_rate']} "
        f"concurrency={res['config']['max_concurrency']}",
        fontsize=10,
    )
    common.save_figure(fig, path)


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    opts = common.engine_options(args)
    if opts and not args.launch_server:
        raise SystemExit(
            f"engine flags ({', '.join(sorted(opts))}) configure a server this benchmark "
            "launches: add --launch-server, or pass them to your own `python -m cluster.serve`"
        )
    if not args.launch_server:
        return await _sweep(args)
    from benchmarks.serve_client import launch_server

    model_dir, load_format = common.model_and_format(args)
    with launch_server(model_dir, load_format, opts, args.server_log, args.ready_timeout) as (http, grpc):
        args.host, args.base_url = "127.0.0.1", None
        args.port = http if args.backend == "http" else grpc
        res = await _sweep(args, opts)
    return res


async def _sweep(args: argparse.Namespace, launched: dict[str, Any] | None = None) -> dict[str, Any]:
    """``--request-rates``: one run a rate against the same server (one JSON with every run)."""
    if not args.request_rates:
        return await _amain(args, launched)
    runs = []
    for rate in args.request_rates:
        args.request_rate = rate
        runs.append(await _amain(args, launched, write=False))
    table = sweep_table(runs)
    print(table, flush=True)
    result = common.record("serve", args)
    result.update(runs=runs, table=table)
    common.write_json(common.output_paths(args, "serve")[0], result)
    return result


async def _amain(
    args: argparse.Namespace, launched: dict[str, Any] | None = None, write: bool = True
) -> dict[str, Any]:
    out_path, png = common.output_paths(args, "serve")
    selected = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    bad = [m for m in selected if m not in METRICS]
    if bad:
        raise SystemExit(f"--percentile-metrics: unknown {bad}; choose from {', '.join(METRICS)}")
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    if args.backend == "http":
        url = args.base_url or f"http://{args.host}:{args.port or 8000}"
        client = HttpClient(url, args.served_model_name, args.request_timeout, args.prompt_format)
        endpoint = url
    else:
        endpoint = f"{args.host}:{args.port or 50051}"
        client = GrpcClient(endpoint, args.served_model_name, args.request_timeout)
    async with client:
        server_info = await client.wait_ready(args.ready_timeout)
        tok, vocab, model_dir = _tokenizer_and_vocab(args, server_info)
        if isinstance(client, HttpClient):
            client.tokenizer = tok
        if args.dataset == "random" and vocab is None:
            raise SystemExit("random prompts need the vocabulary: give --shape, --model or --vocab-size")
        requests = get_requests(args, vocab or 0, tok)
        if not args.disable_warmup:
            first = await client.send(requests[0], args.temperature, args.seed)
            if not first.success:
                raise SystemExit(f"the initial test request failed: {first.error}")
        print(
            f"{args.backend} {endpoint}: {len(requests)} requests, rate {args.request_rate}, "
            f"burstiness {args.burstiness}, max concurrency {args.max_concurrency}",
            flush=True,
        )
        outputs, duration = await run(args, client, requests)
    res = calculate_metrics(requests, outputs, duration, selected, percentiles)
    print_report(res, args, selected, percentiles)
    result = common.record("serve", args)
    result.update(res)
    result["config"] = {
        "backend": args.backend,
        "endpoint": endpoint,
        "served_model": client.model or None,
        "server_info": server_info,
        "model_dir": model_dir,
        "dataset": args.dataset,
        "num_prompts": len(requests),
        "request_rate": args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "temperature": args.temperature,
        "prompt_format": args.prompt_format,
        "percentiles": percentiles,
        "launched_server_options": launched,
    }
    if write:
        common.write_json(out_path, result)
        if png:
            plot(result, selected, png)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return asyncio.run(amain(parse_args(argv)))


if __name__ == "__main__":
    main()
