"""Speculative decoding against plain decoding, and against the speedup its acceptance predicts.

For each batch size, the same greedy decode workload (random prompt ids, EOS
ignored) runs through ``cluster.LLM`` with async scheduling: plain decoding of
the target, plain decoding of the draft alone (to measure the cost ratio
``c = draft step time / target step time``), and speculative decoding with the
draft (and, with ``--self-draft``, with the target as its own draft, which pins
acceptance near 100 %). The prediction is Leviathan et al.'s improvement factor

    predicted = (1 - alpha^(k+1)) / ((1 - alpha) * (k * c + 1))

with ``alpha`` the measured per-draft acceptance rate (computed from the mean
accepted drafts per verify step) and ``c`` from the two plain runs measured
here. It assumes a verify step costs one target decode step, which holds while
decode is memory bound (small batches).

    python -m benchmarks.spec_decode --shape llama-3.1-8b --draft-shape qwen3-0.6b-llama3-vocab --self-draft

``--workload real-text`` measures prompt-lookup (n-gram) drafting instead, on a real model
(default: the embedded SmolLM2-135M-Instruct; ``--model DIR_OR_GGUF``): chat requests whose
answers copy from the prompt (``benchmarks.spec_text``: repeat / edit / comment / summarize
a code snippet), greedy, natural stops. It reports the n-gram acceptance rate (accepted /
drafted tokens), the speedup in output tokens/s over plain decoding of the same requests,
and whether the outputs are identical (greedy speculation must not change them).

    python -m benchmarks.spec_decode --workload real-text --batch-sizes 1,8
"""

from __future__ import annotations

import argparse
import json
import time

from benchmarks.common import hardware_info, versions
from benchmarks.shapes import resolve_model


def _run(llm, batch: int, prompt_len: int, out_len: int) -> dict:
    from cluster import SamplingParams

    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 997 + 10 for j in range(prompt_len)]} for i in range(batch)]
    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    st0 = dict(llm.engine.stats)
    llm.engine.timeline.clear()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    st = llm.engine.stats
    drafted = st.get("spec_draft_tokens", 0) - st0.get("spec_draft_tokens", 0)
    accepted = st.get("spec_accepted_tokens", 0) - st0.get("spec_accepted_tokens", 0)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    # device busy time per step and the idle gap before it (CUDA events; decode steps only)
    steps = [t for t in llm.engine.timeline if t[0] == batch and t[2] >= 0]
    steps = steps[3:-3] if len(steps) > 12 else steps
    dev_ms = 1e3 * sum(t[1] for t in steps) / max(1, len(steps))
    idle_ms = 1e3 * sum(t[2] for t in steps) / max(1, len(steps))
    return {
        "device_step_ms": dev_ms,
        "device_idle_ms": idle_ms,
        "batch": batch,
        "output_tokens": n_out,
        "elapsed_s": elapsed,
        "output_tokens_per_s": n_out / elapsed,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
    }


def _engine(model, fmt, batch_max, max_len, extra, **spec):
    from cluster import LLM

    return LLM(
        model=model,
        load_format=fmt,
        async_scheduling=True,
        max_num_seqs=batch_max,
        measure_device_timeline=True,
        max_model_len=max_len,
        **extra,
        **spec,
    )


def predicted_speedup(alpha: float, k: int, c: float) -> float:
    tokens = (k + 1) if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (k * c + 1)


def alpha_from_mean_accepted(mean_acc: float, k: int) -> float:
    """Solve E[accepted] = sum_{i=1..k} alpha^i for alpha (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(1, k + 1)) < mean_acc:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _run_chats(llm, convs: list, out_len: int) -> dict:
    """Greedy answers to ``convs`` (chat template applied), after a short warm-up request."""
    from cluster import SamplingParams

    llm.chat(convs[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    st0 = dict(llm.engine.stats)
    t0 = time.perf_counter()
    outs = llm.chat(convs, SamplingParams(temperature=0, max_tokens=out_len), use_tqdm=False)
    elapsed = time.perf_counter() - t0
    st = llm.engine.stats
    drafted = st.get("spec_draft_tokens", 0) - st0.get("spec_draft_tokens", 0)
    accepted = st.get("spec_accepted_tokens", 0) - st0.get("spec_accepted_tokens", 0)
    tokens = [o.outputs[0].token_ids for o in outs]
    n_out = sum(len(t) for t in tokens)
    return {
        "batch": len(convs),
        "output_tokens": n_out,
        "elapsed_s": elapsed,
        "output_tokens_per_s": n_out / elapsed,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "token_ids": tokens,
    }


def real_text_main(args) -> dict:
    """Plain decoding vs n-gram (prompt lookup) speculation on real chat requests."""
    from benchmarks.spec_text import conversations
    from cluster import LLM

    batches = [int(b) for b in args.batch_sizes.split(",")]
    extra = {"device": args.device, "max_model_len": args.max_model_len, "async_scheduling": not args.sync}
    if args.num_kv_blocks:
        extra["num_kv_blocks"] = args.num_kv_blocks
    ngram = {
        "speculative_method": "ngram_host" if args.sync and args.host_lookup else "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_min": args.lookup_min,
        "prompt_lookup_max": args.lookup_max,
    }
    runs: dict[str, dict[int, dict]] = {"plain": {}, "ngram": {}}
    model_name = None
    # --num-prompts: the same prompts at every batch size, at most b at a time (an engine per
    # batch size); else b prompts at once, one engine for all batch sizes
    groups = [[b] for b in batches] if args.num_prompts else [batches]
    for name, spec in (("plain", {}), ("ngram", ngram)):
        for group in groups:
            llm = LLM(model=args.model, **{**extra, "max_num_seqs": max(group)}, **spec)
            model_name = llm.engine.served_model_name
            try:
                for b in group:
                    runs[name][b] = _run_chats(llm, conversations(args.num_prompts or b), args.output_len)
                    runs[name][b]["batch"] = b
            finally:
                llm.shutdown()
    results = []
    for b in batches:
        plain, spec = runs["plain"][b], runs["ngram"][b]
        results.append(
            {
                "batch": b,
                "prompts": args.num_prompts or b,
                "k": args.k,
                "method": ngram["speculative_method"],
                "plain_tokens_per_s": plain["output_tokens_per_s"],
                "ngram_tokens_per_s": spec["output_tokens_per_s"],
                "output_tokens": plain["output_tokens"],
                "acceptance_rate": spec["acceptance_rate"],
                "accepted_per_output_token": spec["accepted_tokens"] / max(1, spec["output_tokens"]),
                "speedup": spec["output_tokens_per_s"] / plain["output_tokens_per_s"],
                "outputs_identical": spec["token_ids"] == plain["token_ids"],
            }
        )
    for r in runs.values():
        for run in r.values():
            run.pop("token_ids")
    out = {
        "benchmark": "spec_decode",
        "workload": "real-text",
        "model": model_name,
        "config": vars(args),
        "hardware": hardware_info(),
        "versions": versions(),
        "runs": {k: list(v.values()) for k, v in runs.items()},
        "results": results,
    }
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)
    print(
        f"model {model_name}, {ngram['speculative_method']} k={args.k} "
        f"lookup {args.lookup_min}..{args.lookup_max}, {'sync' if args.sync else 'async'} scheduling"
    )
    print(
        f"{'batch':>5} {'prompts':>7} {'out tok':>8} {'plain/s':>9} {'ngram/s':>9} {'accept':>7} "
        f"{'speedup':>8} {'same':>5}"
    )
    for r in results:
        print(
            f"{r['batch']:>5} {r['prompts']:>7} {r['output_tokens']:>8} {r['plain_tokens_per_s']:9.1f} "
            f"{r['ngram_tokens_per_s']:9.1f} "
            f"{r['acceptance_rate'] or 0:7.3f} {r['speedup']:8.3f} {r['outputs_identical']!s:>5}"
        )
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--workload",
        choices=("synthetic", "real-text"),
        default="synthetic",
        help="synthetic: random ids, draft-model speculation on --shape/--draft-shape; "
        "real-text: n-gram speculation on real chat requests (see above)",
    )
    p.add_argument(
        "--model", default=None, help="real-text: checkpoint directory or .gguf file (default: the embedded SmolLM2)"
    )
    p.add_argument("--lookup-min", type=int, default=1, help="real-text: prompt_lookup_min")
    p.add_argument("--lookup-max", type=int, default=3, help="real-text: prompt_lookup_max")
    p.add_argument("--max-model-len", type=int, default=1024, help="real-text: engine max_model_len")
    p.add_argument("--sync", action="store_true", help="real-text: synchronous scheduling")
    p.add_argument(
        "--num-prompts",
        type=int,
        default=0,
        help="real-text: run this many prompts at every batch size (max_num_seqs = batch); "
        "0: as many prompts as the batch size",
    )
    p.add_argument(
        "--host-lookup",
        action="store_true",
        help="real-text with --sync: speculative_method='ngram_host' (lookup on the driver)",
    )
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--draft-shape", default="qwen3-0.6b-llama3-vocab")
    p.add_argument("--self-draft", action="store_true", help="also run the target as its own draft")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--device", default="auto")
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--output", default="spec_decode.json")
    args = p.parse_args(argv)
    if args.workload == "real-text":
        return real_text_main(args)
    target, fmt = resolve_model(None, args.shape)
    draft, _ = resolve_model(None, args.draft_shape)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    max_len = args.prompt_len + args.output_len + 2 * args.k + 16
    extra = {"device": args.device}
    if args.num_kv_blocks:
        extra["num_kv_blocks"] = args.num_kv_blocks
    from tqdm.auto import tqdm

    configs = [
        ("target", target, {}),
        ("draft_alone", draft, {}),
        (
            "spec_draft",
            target,
            {"speculative_method": "draft_model", "speculative_model": draft, "num_speculative_tokens": args.k},
        ),
    ]
    if args.self_draft:
        configs.append(
            (
                "spec_self",
                target,
                {"speculative_method": "draft_model", "speculative_model": target, "num_speculative_tokens": args.k},
            )
        )
    runs: dict[str, dict[int, dict]] = {}
    for name, model, spec in tqdm(configs, desc="engines"):
        llm = _engine(model, fmt, max(batches), max_len, extra, **spec)
        try:
            runs[name] = {b: _run(llm, b, args.prompt_len, args.output_len) for b in batches}
        finally:
            llm.shutdown()
    results = []
    for b in batches:
        t, d = runs["target"][b], runs["draft_alone"][b]
        # decode step time ~ batch / throughput; c = draft step / target step
        c = t["output_tokens_per_s"] / d["output_tokens_per_s"]
        for name in [n for n, _, _ in configs if n.startswith("spec")]:
            r = runs[name][b]
            steps_rows = max(1, r["draft_tokens"] // args.k)
            mean_acc = r["accepted_tokens"] / steps_rows
            alpha = alpha_from_mean_accepted(mean_acc, args.k)
            pred = predicted_speedup(alpha, args.k, c if name == "spec_draft" else 1.0)
            actual = r["output_tokens_per_s"] / t["output_tokens_per_s"]
            results.append(
                {
                    "batch": b,
                    "config": name,
                    "k": args.k,
                    "target_tokens_per_s": t["output_tokens_per_s"],
                    "spec_tokens_per_s": r["output_tokens_per_s"],
                    "acceptance_rate": r["acceptance_rate"],
                    "mean_accepted_per_step": mean_acc,
                    "alpha": alpha,
                    "cost_ratio_c": c if name == "spec_draft" else 1.0,
                    "device_step_ms": r["device_step_ms"],
                    "device_idle_ms": r["device_idle_ms"],
                    "target_device_step_ms": t["device_step_ms"],
                    "speedup": actual,
                    "predicted_speedup": pred,
                    "actual_over_predicted": actual / pred,
                }
            )
    out = {
        "benchmark": "spec_decode",
        "config": vars(args),
        "hardware": hardware_info(),
        "versions": versions(),
        "runs": {k: list(v.values()) for k, v in runs.items()},
        "results": results,
    }
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)
    print(
        f"{'batch':>5} {'config':>10} {'plain/s':>9} {'spec/s':>9} {'accept':>7} {'c':>5} {'speedup':>8} "
        f"{'predicted':>9} {'ratio':>6} {'dev ms':>7} {'idle ms':>7}"
    )
    for r in results:
        print(
            f"{r['batch']:>5} {r['config']:>10} {r['target_tokens_per_s']:9.1f} {r['spec_tokens_per_s']:9.1f} "
            f"{r['acceptance_rate'] or 0:7.3f} {r['cost_ratio_c']:5.2f} {r['speedup']:8.3f} "
            f"{r['predicted_speedup']:9.3f} {r['actual_over_predicted']:6.3f} "
            f"{r['device_step_ms']:7.2f} {r['device_idle_ms']:7.2f}"
        )
    return out


if __name__ == "__main__":
    main()
