"""Batch-1 GEMV sweep: the persistent GEMV (``kernels.gemv``) against the tuned skinny GEMM
and the unfused path (RMSNorm + cuBLAS + SiLU*mul), PDL off and on.

    python -m kernels.bench --only gemv --out /tmp/gemv.json --tuning-out /tmp/tuning.json

Timings as in ``kernels.bench`` (CUDA-graph replay of back-to-back calls over weight
copies larger than L2). ``--tuning-out`` writes the packaged tuning table with every
batch-1 entry replaced by the fastest of the three (PDL off), for
``SYNCLESS_SKINNY_TUNING`` or to commit as ``kernels/skinny_tuning.json``.
"""

from __future__ import annotations

import json
import os

import torch

from kernels.bench import GEMM_SHAPES, KIND, L2_BYTES, _gemm_call_kwargs, graph_time_us

# (block_n, block_k, num_warps, ctas_per_sm)
GEMV_CANDIDATES = [(4, 1024, 4, 2), (4, 1024, 4, 4), (4, 1024, 8, 4), (8, 1024, 8, 2),
                   (8, 512, 4, 4), (2, 2048, 8, 4), (4, 2048, 8, 2), (8, 512, 8, 4),
                   (2, 1024, 4, 8), (16, 512, 8, 2)]


def _with_pdl(on: bool, fn):
    old = os.environ.get("SYNCLESS_PDL")
    os.environ["SYNCLESS_PDL"] = "1" if on else "0"
    try:
        return fn()
    finally:
        if old is None:
            os.environ.pop("SYNCLESS_PDL", None)
        else:
            os.environ["SYNCLESS_PDL"] = old


def bench_gemv() -> list[dict]:
    from kernels import ops
    from kernels.gemv import gemv_triton
    from kernels.skinny_gemm import kind_of, select_config, skinny_linear_triton

    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = []
    for name, (n, k, variant) in GEMM_SHAPES.items():
        nbytes = n * k * 2
        copies = max(1, min(32, -(-4 * L2_BYTES // nbytes)))
        ws = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(copies)]
        x = torch.randn(1, k, device=dev, dtype=dt)
        kw = _gemm_call_kwargs(variant, 1, k, dt, dev)
        saved = ops.SKINNY_MAX_M
        ops.SKINNY_MAX_M = 0
        try:
            base = graph_time_us([lambda w=w: ops.linear(x, w, **kw) for w in ws])
        finally:
            ops.SKINNY_MAX_M = saved
        kind = kind_of("norm_weight" in kw, "act" in kw, variant == "logits")
        skinny_cfg = select_config(1, n, k, kind)
        if skinny_cfg is not None and skinny_cfg.get("kernel") == "gemv":
            skinny_cfg = None  # a table that already routes here: compare with the default
        from kernels.skinny_gemm import fallback_config
        skinny_cfg = skinny_cfg or fallback_config(1)

        def skinny(pdl_on):
            return _with_pdl(pdl_on, lambda: graph_time_us(
                [lambda w=w: skinny_linear_triton(x, w, config=skinny_cfg, **kw) for w in ws]))

        row = {"shape": name, "n": n, "k": k, "variant": variant, "weight_bytes": nbytes,
               "baseline_us": base, "skinny_config": skinny_cfg, "skinny_us": skinny(False),
               "skinny_pdl_us": skinny(True), "gemv": []}
        for bn, bk, nw, cps in GEMV_CANDIDATES:
            cfg = dict(block_n=bn, block_k=bk, num_warps=nw, ctas_per_sm=cps)
            try:
                us = graph_time_us([lambda w=w, cfg=cfg: gemv_triton(x, w, config=cfg, **kw)
                                    for w in ws])
            except Exception as e:  # resources
                row["gemv"].append({**cfg, "error": repr(e)[:200]})
                continue
            row["gemv"].append({**cfg, "us": us, "tb_s": nbytes / us / 1e6})
        ok = sorted((c for c in row["gemv"] if "us" in c), key=lambda c: c["us"])
        best = ok[0] if ok else None
        if best is not None:
            cfg = {key: best[key] for key in ("block_n", "block_k", "num_warps", "ctas_per_sm")}
            best["pdl_us"] = _with_pdl(True, lambda: graph_time_us(
                [lambda w=w: gemv_triton(x, w, config=cfg, **kw) for w in ws]))
        row["gemv_best"] = best
        rows.append(row)
        tb = lambda us: nbytes / us / 1e6  # noqa: E731
        print(f"gemv {name:12s}: unfused {base:7.2f} us ({tb(base):.2f} TB/s), skinny "
              f"{row['skinny_us']:7.2f} (pdl {row['skinny_pdl_us']:7.2f}), gemv best "
              + (f"{best['us']:7.2f} ({tb(best['us']):.2f} TB/s, pdl {best['pdl_us']:7.2f}) "
                 f"bn{best['block_n']} bk{best['block_k']} w{best['num_warps']} "
                 f"cps{best['ctas_per_sm']}" if best else "none ran"), flush=True)
        del ws
        torch.cuda.empty_cache()
    return rows


def tuning_from(rows: list[dict], base_table: dict) -> dict:
    """The packaged tuning table with each batch-1 entry set to the fastest of unfused
    (null), the skinny config, and the best persistent GEMV config (PDL off)."""
    from kernels.skinny_gemm import tuning_key

    entries = dict(base_table.get("entries", {}))
    for r in rows:
        key = tuning_key(KIND[r["variant"]], 1, r["n"], r["k"])
        options = [(r["baseline_us"], None), (r["skinny_us"], r["skinny_config"])]
        if r["gemv_best"] is not None:
            g = r["gemv_best"]
            options.append((g["us"], {"kernel": "gemv", **{key_: g[key_] for key_ in (
                "block_n", "block_k", "num_warps", "ctas_per_sm")}}))
        entries[key] = min(options, key=lambda o: o[0])[1]
    return dict(base_table, entries=entries)


def write_tuning(rows: list[dict], path: str) -> None:
    from kernels.skinny_gemm import TUNING_FILE

    try:
        base = json.loads(TUNING_FILE.read_text())
    except (OSError, ValueError):
        base = {"entries": {}}
    out = tuning_from(rows, base)
    out["gemv_measurements"] = rows
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
