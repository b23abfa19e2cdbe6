"""Kernel microbenchmarks on one GPU: skinny GEMM configs vs cuBLAS, decode attention configs.

    python -m benchmarks.kernels.bench --out /tmp/kernel-bench.json
        [--only gemm|gemv|attention|attention-sweep[-big]|probe|rope-attention]
    python -m benchmarks.kernels.bench --tune kernels/skinny_tuning.json [--weights fp8]

Timings: ``benchmarks.kernels.timing`` (CUDA-graph replays over operand copies larger
than L2). The GEMM baseline is what the model runs without the skinny path: RMSNorm kernel
+ cuBLAS + SiLU*mul kernel; with ``--weights fp8``, what serving runs without FP8 entries
(``kernels.ops.linear`` on the 16-bit entries: weight-only up to 16 rows, activation
quantization + FP8 GEMM above).
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.kernels.skinny_tune import bench_gemm, tune
from benchmarks.kernels.timing import GEMM_SHAPES, attention_caches, graph_time_us

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
