"""Kernel microbenchmarks on one GPU: skinny GEMM configs vs cuBLAS, decode attention configs.

    python -m benchmarks.kernels.bench --out /tmp/kernel-bench.json
        [--only gemm|gemv|attention|attention-sweep[-big]|probe|rope-attention]
    python -m benchmarks.kernels.bench --tune kernels/skinny_tuning.json [--weights fp8]

Timings: ``benchmarks.kernels.timing`` (CUDA-graph replays over operand copies larger
than L2). The GEMM baseline is what the
model runs without the skinny path: RMSNorm kernel + cuBLAS + SiLU*mul kernel.
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.kernels.timing import (
    GEMM_SHAPES,
    KIND,
    attention_caches,
    gemm_call_kwargs,
    graph_time_us,
    rotation_copies,
)

TUNE_CANDIDATES = {  # M class -> (use_dot, block_n, block_k, num_warps, num_stages, prefetch)
    1: [
        (False, 8, 512, 4, 2, False),
        (False, 4, 1024, 4, 2, False),
        (False, 8, 1024, 4, 2, False),
        (False, 16, 512, 8, 2, False),
        (False, 8, 256, 2, 3, False),
        (False, 8, 512, 4, 2, True),
        (False, 4, 1024, 4, 2, True),
        (False, 4, 512, 2, 2, True),
    ],
    16: [
        (True, 32, 256, 4, 4, False),
        (True, 64, 128, 4, 4, False),
        (True, 16, 256, 4, 4, False),
        (True, 32, 128, 4, 5, False),
    ],
}
# FP8 weights: a tile of the same shape moves half the bytes, so deeper K tiles join in
TUNE_CANDIDATES_FP8 = {
    1: [
        (False, 8, 1024, 4, 2, False),
        (False, 8, 2048, 4, 2, False),
        (False, 4, 2048, 4, 2, False),
        (False, 16, 1024, 8, 2, False),
        (False, 4, 1024, 4, 2, True),
        (False, 4, 2048, 4, 2, True),
        (False, 8, 512, 4, 2, False),
    ],
    16: [
        (True, 32, 256, 4, 4, False),
        (True, 32, 512, 4, 3, False),
        (True, 64, 256, 4, 4, False),
        (True, 16, 512, 4, 4, False),
        (True, 64, 128, 4, 4, False),
        (True, 32, 128, 4, 5, False),
    ],
    # 17-64 rows: weight-only (16-bit activations, no quantization launch) against the
    # quantize + FP8 GEMM path serving runs there now
    32: [
        (True, 32, 256, 4, 4, False),
        (True, 64, 256, 4, 3, False),
        (True, 32, 512, 4, 3, False),
        (True, 64, 128, 4, 4, False),
    ],
    64: [
        (True, 32, 256, 4, 3, False),
        (True, 64, 256, 8, 3, False),
        (True, 64, 128, 4, 4, False),
        (True, 128, 128, 8, 3, False),
    ],
}
CONFIG_FIELDS = ("use_dot", "block_n", "block_k", "num_warps", "num_stages", "prefetch")


def bench_gemm(ms: list[int], fp8: bool = False, shapes: list[str] | None = None) -> list[dict]:
    """Each model shape's skinny candidates against its baseline at each M up to 16. 16-bit
    weights: the baseline is the unfused path (norm kernel + cuBLAS + act kernel). ``fp8``:
    per-row FP8 weights (no lm_head), M up to 64, the baseline is what serving runs now (the
    packaged table's tiles, the unfused norm + weight-only GEMM + act, or past 16 rows the
    activation quantization + FP8 GEMM)."""
    from kernels import ops
    from kernels.fp8_reference import quantize_weight_fp8
    from kernels.skinny_gemm import m_class, skinny_linear_triton

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: smoke tests
    dt = torch.bfloat16
    candidates = TUNE_CANDIDATES_FP8 if fp8 else TUNE_CANDIDATES
    rows = []
    for name, (n, k, variant) in GEMM_SHAPES.items():
        if shapes is not None and name not in shapes:
            continue
        if fp8 and variant == "logits":  # the lm_head stays 16-bit
            continue
        nbytes = n * k * (1 if fp8 else 2)
        copies = rotation_copies(nbytes)
        ws = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(copies)]
        scales = [None] * copies
        if fp8:
            ws, scales = map(list, zip(*(quantize_weight_fp8(w) for w in ws)))
        for m in ms:
            mc = m_class(m, fp8)  # 1 and 2..16 (FP8 also 17-32, 33-64); larger batches: GEMM kernels
            if mc is None:
                continue
            x = torch.randn(m, k, device=dev, dtype=dt)
            kw = gemm_call_kwargs(variant, m, k, dt, dev)
            saved = ops.SKINNY_MAX_M
            ops.SKINNY_MAX_M = saved if fp8 else 0  # 16-bit: the unfused path, norm + cuBLAS + act
            try:
                base = graph_time_us(
                    [lambda w=w, s=s: ops.linear(x, w, weight_scale=s, **kw) for w, s in zip(ws, scales)]
                )
            finally:
                ops.SKINNY_MAX_M = saved
            row = {
                "shape": name,
                "n": n,
                "k": k,
                "m": m,
                "variant": variant,
                "weight_bytes": nbytes,
                "baseline_us": base,
                "baseline_tb_s": nbytes / base / 1e6,
                "configs": [],
            }
            for values in candidates[mc]:
                cfg = dict(zip(CONFIG_FIELDS, values))
                try:
                    us = graph_time_us(
                        [
                            lambda w=w, s=s, cfg=cfg: skinny_linear_triton(x, w, weight_scale=s, config=cfg, **kw)
                            for w, s in zip(ws, scales)
                        ]
                    )
                except Exception as e:  # a config that does not compile (resources)
                    row["configs"].append({**cfg, "error": repr(e)[:200]})
                    continue
                row["configs"].append({**cfg, "us": us, "tb_s": nbytes / us / 1e6})
            ok = [c for c in row["configs"] if "us" in c]
            best = min(ok, key=lambda c: c["us"]) if ok else None
            row["best"] = best
            row["speedup"] = base / best["us"] if best else None
            rows.append(row)
            print(
                f"gemm {name:12s}{' fp8' if fp8 else ''} M={m:3d}: baseline {base:8.2f} us ({row['baseline_tb_s']:.2f} TB/s)"
                + (
                    f", best {best['us']:8.2f} us ({best['tb_s']:.2f} TB/s) "
                    f"dot={best['use_dot']} bn={best['block_n']} bk={best['block_k']} "
                    f"w={best['num_warps']} s={best['num_stages']} pf={best['prefetch']} "
                    f"-> {row['speedup']:.2f}x"
                    if best
                    else ", no config ran"
                ),
                flush=True,
            )
        del ws
        torch.cuda.empty_cache()
    return rows


ATTN_CASES = [  # (batch, context, hq, hkv, bound): the roofline cells' decode attention
    (1, 512, 32, 8, 1024),
    (1, 4096, 32, 8, 4128),
    (8, 512, 32, 8, 1024),
    (32, 4096, 32, 8, 4128),
    (128, 512, 32, 8, 1024),
    (256, 512, 32, 8, 1024),
    (256, 512, 16, 8, 1024),
    (128, 4096, 16, 8, 4128),
    (1, 512, 16, 8, 1024),
]
ATTN_CONFIGS = [
    None,
    dict(block_n=64, num_warps=2, num_stages=3),
    dict(block_n=128, num_warps=4, num_stages=3),
    dict(block_n=128, num_warps=8, num_stages=2),
    dict(block_n=32, num_warps=4, num_stages=4),
    dict(block_n=64, num_warps=4, num_stages=4),
]


def _engine_splits(b: int, hq: int, hkv: int, d: int, bound: int, dev) -> int:
    """The split count the engine's one-query-token launch takes for this shape on ``dev``."""
    import triton

    from kernels.paged_attention import _device_sms, launch_config

    return launch_config(b, b, hkv, triton.next_power_of_2(hq // hkv), d, 1, bound, _device_sms(dev)).num_splits


def bench_attention() -> list[dict]:
    from kernels.paged_attention import paged_attention_triton

    dev, dt, d, bs = torch.device("cuda"), torch.bfloat16, 128, 16
    rows = []
    for b, ctx, hq, hkv, bound in ATTN_CASES:
        kv_bytes, caches = attention_caches(b, ctx, hkv, bound, d, bs, dev, dt)
        q = torch.randn(b, hq, d, device=dev, dtype=dt)
        seq = torch.full((b,), ctx, device=dev, dtype=torch.int32)
        qsl = torch.arange(b + 1, device=dev, dtype=torch.int32)
        splits = _engine_splits(b, hq, hkv, d, bound, dev)
        row = {
            "batch": b,
            "context": ctx,
            "hq": hq,
            "hkv": hkv,
            "bound": bound,
            "kv_bytes": kv_bytes,
            "heuristic_splits": splits,
            "variants": [],
        }
        variants = [
            ("default (fused reduce)", dict()),
            ("reduce kernel", dict(fused_reduce=False)),
            ("no split", dict(num_splits=1)),
        ]
        if splits > 1:
            variants.append(("2x splits", dict(num_splits=min(64, 2 * splits))))
            variants.append(("half splits", dict(num_splits=max(1, splits // 2))))
        variants += [(f"cfg {c}", dict(config=c)) for c in ATTN_CONFIGS[1:] if b >= 32]
        for label, kw in variants:
            try:
                us = graph_time_us(
                    [
                        lambda c=c, kw=kw: paged_attention_triton(
                            q, c[0], c[1], c[2], seq, qsl, 1, bound, d**-0.5, **kw
                        )
                        for c in caches
                    ]
                )
            except Exception as e:
                row["variants"].append({"label": label, "error": repr(e)[:200]})
                continue
            row["variants"].append({"label": label, "us": us, "tb_s": kv_bytes / us / 1e6})
        rows.append(row)
        print(
            f"attn b={b:3d} ctx={ctx:5d} hq={hq} hkv={hkv} splits={splits}: "
            + ", ".join(f"{v['label']} {v['us']:.1f}us/{v['tb_s']:.2f}TB/s" for v in row["variants"] if "us" in v),
            flush=True,
        )
        del caches
        torch.cuda.empty_cache()
    return rows


SMALL_ATTN_CASES = [  # decode cells of the roofline grid that miss (b, ctx, hq, hkv, graph bucket)
    (1, 512, 16, 8, 1024),
    (1, 512, 32, 8, 1024),
    (8, 512, 16, 8, 1024),
    (8, 512, 32, 8, 1024),
    (1, 4096, 16, 8, 4126),
    (8, 4096, 16, 8, 4126),
    (32, 512, 16, 8, 1024),
    (128, 512, 16, 8, 1024),
]


BIG_ATTN_CASES = [(128, 512, 16, 8, 1024), (256, 512, 16, 8, 1024), (128, 512, 32, 8, 1024)]
SWEEP_TILES = ((64, 4, 3), (32, 4, 3), (16, 4, 2), (32, 2, 4), (64, 4, 2), (128, 4, 2))
BIG_SWEEP_TILES = (
    (64, 4, 2),
    (64, 4, 3),
    (64, 4, 4),
    (64, 8, 2),
    (64, 8, 3),
    (128, 8, 2),
    (128, 8, 3),
    (32, 4, 4),
    (32, 4, 6),
    (32, 2, 4),
)


def bench_attention_sweep(cases=None, tiles=SWEEP_TILES, splits_set=(1, 2, 4, 8, 16, 32)) -> list[dict]:
    """Split count x tile x pipeline depth for decode cells (graph replay); by default the
    small-batch cells, ``--only attention-sweep-big`` the mid/large batches at ctx 512."""
    from kernels.paged_attention import paged_attention_triton

    dev, dt, d, bs = torch.device("cuda"), torch.bfloat16, 128, 16
    rows = []
    for b, ctx, hq, hkv, bound in cases or SMALL_ATTN_CASES:
        _, caches = attention_caches(b, ctx, hkv, bound, d, bs, dev, dt)
        q = torch.randn(b, hq, d, device=dev, dtype=dt)
        seq = torch.full((b,), ctx + 1, device=dev, dtype=torch.int32)
        qsl = torch.arange(b + 1, device=dev, dtype=torch.int32)
        heur = _engine_splits(b, hq, hkv, d, bound, dev)
        res = []
        for splits in sorted({*splits_set, heur}):
            for bn, nw, st in tiles:
                cfg = dict(block_n=bn, num_warps=nw, num_stages=st)
                try:
                    us = graph_time_us(
                        [
                            lambda c=c: paged_attention_triton(
                                q, c[0], c[1], c[2], seq, qsl, 1, bound, d**-0.5, num_splits=splits, config=cfg
                            )
                            for c in caches
                        ]
                    )
                except Exception as e:  # resources
                    res.append({"splits": splits, **cfg, "error": repr(e)[:120]})
                    continue
                res.append({"splits": splits, **cfg, "us": us})
        ok = sorted((r for r in res if "us" in r), key=lambda r: r["us"])
        # the launch as the engine makes it (its own tiles, stages and splits)
        base = graph_time_us(
            [lambda c=c: paged_attention_triton(q, c[0], c[1], c[2], seq, qsl, 1, bound, d**-0.5) for c in caches]
        )
        rows.append(
            {
                "batch": b,
                "context": ctx,
                "hq": hq,
                "hkv": hkv,
                "bound": bound,
                "heuristic_splits": heur,
                "heuristic_us": base,
                "results": res,
            }
        )
        print(
            f"attn-sweep b={b:3d} ctx={ctx:5d} hq={hq} bound={bound}: heuristic {heur} splits "
            f"{base:.2f} us; best "
            + "; ".join(
                f"s{r['splits']} bn{r['block_n']} w{r['num_warps']} st{r['num_stages']} {r['us']:.2f}" for r in ok[:3]
            ),
            flush=True,
        )
        del caches
        torch.cuda.empty_cache()
    return rows


def tuned_entries(rows: list[dict], fp8: bool = False) -> dict[str, dict | None]:
    """A tuning table's entries from ``bench_gemm`` rows. 16-bit: the fastest candidate where
    it beats the unfused baseline, else null (the unfused path). ``fp8``: ``|fp8`` entries for
    the shapes where the fastest candidate beats what serving runs now; none elsewhere (the
    16-bit entry goes on applying)."""
    from kernels.skinny_gemm import m_class, tuning_key

    entries = {}
    for r in rows:
        mc = m_class(r["m"], fp8)
        best = r["best"]
        use = best is not None and best["us"] < r["baseline_us"]
        if fp8 and not use:
            continue
        key = tuning_key(KIND[r["variant"]], mc, r["n"], r["k"], fp8=fp8)
        entries[key] = {f: best[f] for f in CONFIG_FIELDS} if use else None
    return entries


def merged_entries(old: dict[str, dict | None], new: dict[str, dict | None], fp8: bool) -> dict[str, dict | None]:
    """A re-tune's table: the new entries over the old file's; an FP8 tune keeps the 16-bit
    entries, a 16-bit tune keeps the ``|fp8`` ones and replaces the rest."""
    keep = {key: cfg for key, cfg in old.items() if fp8 or key.endswith("|fp8")}
    return {**keep, **new}


def tune(path: str, fp8: bool = False, shapes: list[str] | None = None) -> dict:
    """Measure M=1 and M=8 (FP8: also 32 and 64) on the model shapes; write the per-shape choices that
    ``kernels.skinny_gemm.select_config`` reads into ``path``, keeping the file's entries of
    the other weight type (16-bit: None = the unfused path won; ``fp8``: ``|fp8`` entries, added
    to the packaged table's when ``path`` does not exist yet)."""
    import datetime
    import os
    import sys

    import triton

    rows = bench_gemm([1, 8, 32, 64] if fp8 else [1, 8], fp8=fp8, shapes=shapes)
    from kernels.skinny_gemm import TUNING_FILE

    old = {}
    # an FP8 tune adds to the file's table, or to the packaged one's (a table without the 16-bit
    # entries would change the 16-bit and the untuned FP8 shapes' tiles when installed)
    source = path if os.path.exists(path) else (str(TUNING_FILE) if fp8 and TUNING_FILE.exists() else None)
    if source is not None:
        with open(source) as f:
            old = json.load(f)
    entries = merged_entries(old.get("entries", {}), tuned_entries(rows, fp8), fp8)
    run = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
    }
    if fp8:  # the 16-bit tune's header stays; this run's goes beside it
        out = {**old, "entries": entries, "fp8": {**run, "measurements": rows}}
    else:
        out = {**run, "entries": entries, "measurements": rows, **({"fp8": old["fp8"]} if "fp8" in old else {})}
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(
        "tuned:",
        ", ".join(
            f"{r['shape']} M={r['m']}: {r['baseline_us']:.1f}->{r['best']['us']:.1f}us "
            f"{'skinny' if r['best']['us'] < r['baseline_us'] else ('as served' if fp8 else 'unfused')}"
            for r in rows
            if r["best"] is not None
        ),
        flush=True,
    )
    return out


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernels.bench", description=__doc__)
    p.add_argument("--out", default=None)
    p.add_argument(
        "--only",
        choices=("gemm", "gemv", "attention", "attention-sweep", "attention-sweep-big", "probe", "rope-attention"),
        default=None,
    )
    p.add_argument(
        "--tuning-out",
        metavar="JSON",
        default=None,
        help="with --only gemv: write the tuning table with the batch-1 winners",
    )
    p.add_argument("--ms", default="1,4,16")
    p.add_argument(
        "--tune",
        metavar="JSON",
        default=None,
        help="measure and write the skinny-GEMM tuning table (kernels/skinny_tuning.json)",
    )
    p.add_argument(
        "--weights",
        choices=("bf16", "fp8"),
        default="bf16",
        help="with --tune: tune for 16-bit weights (default) or add the FP8 weights' entries",
    )
    p.add_argument(
        "--shapes",
        default=None,
        help=f"with --tune: only these model shapes, comma-separated (default: all of {', '.join(GEMM_SHAPES)})",
    )
    a = p.parse_args(argv)
    shapes = a.shapes.split(",") if a.shapes else None
    if shapes is not None and (bad := [x for x in shapes if x not in GEMM_SHAPES]):
        p.error(f"unknown shapes {', '.join(bad)} (known: {', '.join(GEMM_SHAPES)})")
    if a.tune:
        return tune(a.tune, fp8=a.weights == "fp8", shapes=shapes)
    if a.weights != "bf16" or shapes is not None:
        p.error("--weights and --shapes go with --tune")
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    import triton

    res["triton"] = triton.__version__
    if a.only in (None, "gemm"):
        res["gemm"] = bench_gemm([int(x) for x in a.ms.split(",")])
    if a.only in (None, "attention"):
        res["attention"] = bench_attention()
    if a.only == "gemv":
        from benchmarks.kernels.bench_gemv import bench_gemv, write_tuning

        res["gemv"] = bench_gemv()
        if a.tuning_out:
            write_tuning(res["gemv"], a.tuning_out)
    if a.only == "attention-sweep":
        res["attention_sweep"] = bench_attention_sweep()
    if a.only == "attention-sweep-big":
        res["attention_sweep"] = bench_attention_sweep(BIG_ATTN_CASES, BIG_SWEEP_TILES, (1, 2))
    if a.only == "probe":
        from benchmarks.kernels.bench_probe import bench_probe

        res["probe"] = bench_probe()
    if a.only == "rope-attention":
        from benchmarks.kernels.bench_probe import bench_rope_attention

        res["rope_attention"] = bench_rope_attention()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
