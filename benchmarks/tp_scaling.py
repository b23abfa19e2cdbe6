"""Tensor-parallel scaling from result files of one device run.

    python -m benchmarks.tp_scaling OUT/decode-tp*.json OUT/throughput-tp*.json

Decode files (``benchmarks.decode_roofline --tensor-parallel-size n``): each TP=n cell
is paired with the TP=1 cell of the same context at 1/n of its batch (the same
per-GPU batch). Scaling efficiency = tokens/s at TP=n over n x tokens/s at TP=1:
1.0 is linear; above 1.0 the TP=1 cell left bandwidth unused at its batch (a decode
step at batch 2 costs about what batch 1 does). Batch-1 latency is listed for every
TP size (a TP=n step reads 1/n of the weights per GPU, plus the collectives).

Throughput files (``benchmarks.throughput``): efficiency = output tokens/s at TP=n
over n x TP=1's, paired only when TP=n ran n times the prompts and ``max_num_seqs``
of TP=1 (the same per-GPU load); other files are listed unpaired.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def decode_tp(result: dict[str, Any]) -> int:
    return int(result.get("tensor_parallel_size") or 1)


def throughput_tp(result: dict[str, Any]) -> int:
    return int(result["args"].get("tensor_parallel_size") or 1)


def max_num_seqs(result: dict[str, Any]) -> int | None:
    """The engine's effective ``max_num_seqs`` (its config, defaults applied), else the flag."""
    cfg = (result.get("config") or {}).get("engine_config") or {}
    return (cfg.get("scheduler") or {}).get("max_num_seqs") or result["args"].get("max_num_seqs")


def by_tp(results: list[dict[str, Any]], tp_of) -> dict[int, dict[str, Any]]:
    """One result a TP size; two of the same size (an A/B) are compared one pair at a time."""
    out: dict[int, dict[str, Any]] = {}
    for r in results:
        n = tp_of(r)
        if n in out:
            raise SystemExit(
                f"two results at TP={n} among the files: pass one per TP size "
                "(an A/B of the same size is two invocations)"
            )
        out[n] = r
    return out


def decode_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per TP=n (n > 1) cell that has a TP=1 cell at the same per-GPU batch."""
    tps = by_tp(results, decode_tp)
    if 1 not in tps:
        raise SystemExit("no TP=1 decode result among the files: nothing to scale against")
    base = {(c["batch_size"], c["context_len"]): c for c in tps[1]["cells"] if "tokens_per_s" in c}
    rows = []
    for n in sorted(t for t in tps if t > 1):
        for c in tps[n]["cells"]:
            if "tokens_per_s" not in c or c["batch_size"] % n:
                continue
            one = base.get((c["batch_size"] // n, c["context_len"]))
            if one is None:
                continue
            rows.append(
                {
                    "tp": n,
                    "context_len": c["context_len"],
                    "batch_size": c["batch_size"],
                    "tp1_batch_size": one["batch_size"],
                    "tokens_per_s": c["tokens_per_s"],
                    "tp1_tokens_per_s": one["tokens_per_s"],
                    "efficiency": c["tokens_per_s"] / (n * one["tokens_per_s"]),
                    "step_ms": c["step_ms_median"],
                    "ratio": c["ratio"],
                }
            )
    return rows


def batch1_latency(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Batch-1 step time per (TP size, context) and its speed-up over TP=1."""
    cells = {
        (decode_tp(r), c["context_len"]): c
        for r in results
        for c in r["cells"]
        if c["batch_size"] == 1 and "step_ms_median" in c
    }
    return [
        {
            "tp": n,
            "context_len": ctx,
            "step_ms": c["step_ms_median"],
            "ratio": c["ratio"],
            "speedup": (cells[(1, ctx)]["step_ms_median"] / c["step_ms_median"]) if (1, ctx) in cells else None,
        }
        for (n, ctx), c in sorted(cells.items())
    ]


def throughput_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    tps = by_tp(results, throughput_tp)
    one = tps.get(1)
    rows = []
    for n, r in sorted(tps.items()):
        seqs = max_num_seqs(r)
        row = {
            "tp": n,
            "output_tokens_per_s": r["output_tokens_per_second"],
            "num_prompts": r["args"]["num_prompts"],
            "max_num_seqs": seqs,
        }
        if one is not None and n > 1 and seqs is not None and max_num_seqs(one) is not None:
            same_load = r["args"]["num_prompts"] == n * one["args"]["num_prompts"] and seqs == n * max_num_seqs(one)
            if same_load:
                row["efficiency"] = r["output_tokens_per_second"] / (n * one["output_tokens_per_second"])
        rows.append(row)
    return rows


def report(paths: list[str]) -> list[str]:
    results = [json.loads(Path(p).read_text()) for p in paths]
    decode = [r for r in results if r.get("benchmark") == "decode_roofline"]
    tput = [r for r in results if r.get("benchmark") == "throughput"]
    lines = []
    if decode:
        lines.append("decode, same per-GPU batch: tp ctx batch (tp1 batch) tok/s (tp1 tok/s) efficiency")
        for r in decode_rows(decode):
            lines.append(
                f"  TP{r['tp']} ctx{r['context_len']:<5d} b{r['batch_size']:<4d} (b{r['tp1_batch_size']:<4d}) "
                f"{r['tokens_per_s']:9.0f} ({r['tp1_tokens_per_s']:9.0f}) {r['efficiency']:.2f}"
            )
        lines.append("decode latency at batch 1: tp ctx step_ms ratio speedup")
        for r in batch1_latency(decode):
            sp = f"{r['speedup']:.2f}x" if r["speedup"] is not None else "-"
            lines.append(f"  TP{r['tp']} ctx{r['context_len']:<5d} {r['step_ms']:.3f} ms ratio {r['ratio']:.2f} {sp}")
    if tput:
        lines.append("offline throughput: tp prompts max_num_seqs output_tok/s efficiency")
        for r in throughput_rows(tput):
            eff = f"{r['efficiency']:.2f}" if "efficiency" in r else "-"
            lines.append(
                f"  TP{r['tp']} {r['num_prompts']:5d} {r['max_num_seqs']} {r['output_tokens_per_s']:9.0f} {eff}"
            )
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.tp_scaling",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("files", nargs="+", help="decode_roofline and/or throughput result JSONs")
    args = p.parse_args(argv)
    for path in args.files:
        if not Path(path).is_file():
            raise SystemExit(f"no such result file: {path}")
    print("\n".join(report(args.files)))


if __name__ == "__main__":
    main()
