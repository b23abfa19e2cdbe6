"""Batch-1 GEMV sweep: the persistent GEMV (``kernels.gemv``) against the tuned skinny GEMM
and the unfused path (RMSNorm + cuBLAS + SiLU*mul), PDL off and on.

    python -m benchmarks.kernels.bench --only gemv --out /tmp/gemv.json --tuning-out /tmp/tuning.json

Timings: ``benchmarks.kernels.timing`` (CUDA-graph replay of back-to-back calls over weight
copies larger than L2). ``--tuning-out`` writes the packaged tuning table with every
batch-1 entry replaced by the fastest of the three (PDL off), for the ``skinny_tuning``
option or to commit as ``kernels/skinny_tuning.json``.
"""

from __future__ import annotations

import json

import torch

from benchmarks.kernels.timing import (
    GEMM_SHAPES,
    KIND,
    gemm_call_kwargs,
    graph_time_us,
    rotation_copies,
    with_pdl,
)

# (block_n, block_k, num_warps, ctas_per_sm, pre_l2 bytes). One CTA an SM leaves room for
# the next kernel's CTAs to launch early under PDL and load their first tiles.
GEMV_CANDIDATES = [
    (8, 1024, 8, 2, 0),
    (4, 1024, 8, 4, 0),
    (2, 2048, 8, 4, 0),
    (16, 512, 8, 2, 0),
    (8, 1024, 8, 1, 0),
    (4, 1024, 8, 1, 0),
    (16, 512, 8, 1, 0),
    (4, 2048, 8, 1, 0),
    (8, 1024, 4, 1, 0),
    (8, 1024, 8, 1, 8192),
    (4, 1024, 8, 1, 16384),
    (16, 512, 8, 1, 4096),
    (16, 1024, 16, 1, 0),
    (8, 2048, 16, 1, 0),
    (16, 1024, 8, 1, 0),
    (16, 1024, 16, 2, 0),
]
# skinny tensor-core path at batch 1 (x padded to 16 rows; W streamed by the software
# pipeline): (use_dot, block_n, block_k, num_warps, num_stages, prefetch)
SKINNY_DOT_CANDIDATES = [
    (True, 32, 256, 4, 4, False),
    (True, 64, 128, 4, 5, False),
    (True, 16, 512, 4, 3, False),
    (True, 32, 512, 8, 3, False),
]
GEMV_KEYS = ("block_n", "block_k", "num_warps", "ctas_per_sm", "pre_l2")


def bench_gemv() -> list[dict]:
    from kernels import ops
    from kernels.gemv import gemv_triton
    from kernels.skinny_gemm import fallback_config, kind_of, select_config, skinny_linear_triton

    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = []
    for name, (n, k, variant) in GEMM_SHAPES.items():
        nbytes = n * k * 2
        copies = rotation_copies(nbytes)
        ws = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(copies)]
        x = torch.randn(1, k, device=dev, dtype=dt)
        kw = gemm_call_kwargs(variant, 1, k, dt, dev)
        saved = ops.SKINNY_MAX_M
        ops.SKINNY_MAX_M = 0
        try:
            base = graph_time_us([lambda w=w: ops.linear(x, w, **kw) for w in ws])
        finally:
            ops.SKINNY_MAX_M = saved
        kind = kind_of("norm_weight" in kw, kw.get("act"), variant == "logits")
        skinny_cfg = select_config(1, n, k, kind)
        if skinny_cfg is not None and skinny_cfg.get("kernel") == "gemv":
            skinny_cfg = None  # a table that already routes here: compare with the default
        skinny_cfg = skinny_cfg or fallback_config(1)

        def skinny(pdl_on):
            return with_pdl(
                pdl_on,
                lambda: graph_time_us([lambda w=w: skinny_linear_triton(x, w, config=skinny_cfg, **kw) for w in ws]),
            )

        row = {
            "shape": name,
            "n": n,
            "k": k,
            "variant": variant,
            "weight_bytes": nbytes,
            "baseline_us": base,
            "skinny_config": skinny_cfg,
            "skinny_us": skinny(False),
            "skinny_pdl_us": skinny(True),
            "gemv": [],
            "skinny_dot": [],
        }
        for cand in SKINNY_DOT_CANDIDATES:
            cfg = dict(zip(("use_dot", "block_n", "block_k", "num_warps", "num_stages", "prefetch"), cand))
            try:
                us = {
                    mode: with_pdl(
                        mode == "pdl",
                        lambda cfg=cfg: graph_time_us(
                            [lambda w=w: skinny_linear_triton(x, w, config=cfg, **kw) for w in ws]
                        ),
                    )
                    for mode in ("off", "pdl")
                }
            except Exception as e:  # resources
                row["skinny_dot"].append({**cfg, "error": repr(e)[:200]})
                continue
            row["skinny_dot"].append({**cfg, "us": us["off"], "pdl_us": us["pdl"]})
        for cand in GEMV_CANDIDATES if kw.get("act") != "silu_and_mul_pairs" else ():
            cfg = dict(zip(GEMV_KEYS, cand))  # (the GEMV reads only the stacked gate|up)
            modes = ("pdl",) if cfg["pre_l2"] else ("off", "pdl")
            try:
                us = {
                    mode: with_pdl(
                        mode == "pdl",
                        lambda cfg=cfg: graph_time_us([lambda w=w: gemv_triton(x, w, config=cfg, **kw) for w in ws]),
                    )
                    for mode in modes
                }
            except Exception as e:  # resources
                row["gemv"].append({**cfg, "error": repr(e)[:200]})
                continue
            row["gemv"].append({**cfg, "us": us.get("off", float("inf")), "pdl_us": us["pdl"]})
        ok = [c for c in row["gemv"] if "pdl_us" in c]
        best = min(ok, key=lambda c: c["us"]) if ok else None
        best_pdl = min(ok, key=lambda c: c["pdl_us"]) if ok else None
        dots = [c for c in row["skinny_dot"] if "us" in c]
        row["gemv_best"], row["gemv_best_pdl"] = best, best_pdl
        row["skinny_dot_best"] = min(dots, key=lambda c: c["us"]) if dots else None
        rows.append(row)
        tb = lambda us: nbytes / us / 1e6  # noqa: E731
        d = row["skinny_dot_best"]
        print(
            f"gemv {name:12s}: unfused {base:6.2f} us ({tb(base):.2f} TB/s) | skinny "
            f"{row['skinny_us']:6.2f} pdl {row['skinny_pdl_us']:6.2f} | dot "
            + (f"{d['us']:6.2f} pdl {d['pdl_us']:6.2f} bn{d['block_n']}" if d else "-")
            + (
                f" | gemv {best['us']:6.2f} ({tb(best['us']):.2f}) "
                + " ".join(f"{c[k_]}" for k_ in GEMV_KEYS for c in [best])
                + f" | gemv-pdl {best_pdl['pdl_us']:6.2f} ({tb(best_pdl['pdl_us']):.2f}) "
                + " ".join(f"{c[k_]}" for k_ in GEMV_KEYS for c in [best_pdl])
                if best
                else " | gemv none ran"
            ),
            flush=True,
        )
        ws = None  # free the copies before the next shape
        torch.cuda.empty_cache()
    return rows


def tuning_from(rows: list[dict], base_table: dict, pdl_on: bool = False) -> dict:
    """The packaged tuning table with each batch-1 entry set to the fastest of unfused
    (null), the skinny config, the skinny tensor-core candidates and the persistent GEMV
    candidates, timed with PDL off (or on: ``pdl_on``; the unfused path has no PDL)."""
    from kernels.skinny_gemm import tuning_key

    t = "pdl_us" if pdl_on else "us"
    entries = dict(base_table.get("entries", {}))
    for r in rows:
        key = tuning_key(KIND[r["variant"]], 1, r["n"], r["k"])
        options = [(r["baseline_us"], None), (r["skinny_pdl_us"] if pdl_on else r["skinny_us"], r["skinny_config"])]
        options += [
            (c[t], {k_: c[k_] for k_ in ("use_dot", "block_n", "block_k", "num_warps", "num_stages", "prefetch")})
            for c in r.get("skinny_dot", [])
            if t in c
        ]
        options += [(c[t], {"kernel": "gemv", **{k_: c[k_] for k_ in GEMV_KEYS}}) for c in r.get("gemv", []) if t in c]
        entries[key] = min(options, key=lambda o: o[0])[1]
    return dict(base_table, entries=entries)


def write_tuning(rows: list[dict], path: str) -> None:
    """``path`` (PDL off) and ``path`` with ``-pdl`` before ``.json`` (PDL on)."""
    from kernels.skinny_gemm import TUNING_FILE

    try:
        base = json.loads(TUNING_FILE.read_text())
    except (OSError, ValueError):
        base = {"entries": {}}
    for pdl_on, p in ((False, path), (True, path.replace(".json", "") + "-pdl.json")):
        out = tuning_from(rows, base, pdl_on)
        out["gemv_measurements"] = rows
        with open(p, "w") as f:
            json.dump(out, f, indent=1)
