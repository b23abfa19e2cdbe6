"""Batch-1 MLP block sweep: the one-launch block (``kernels.mlp_block``) against the three
launches it replaces (``ops.mlp_block`` with ``SYNCLESS_FUSED_MLP=0``), PDL off and on.

    python -m kernels.bench --only mlp-block --out /tmp/mlp.json --tuning-out /tmp/tuning.json

Timings as in ``kernels.bench``. ``--tuning-out`` writes the current tuning table (the
packaged one, or ``SYNCLESS_SKINNY_TUNING``'s) with an ``mlp_block|m1|HxAxI`` entry per
shape: the fastest config, or null where the unfused launches won (PDL off; a ``-pdl``
file for PDL on).
"""

from __future__ import annotations

import json
import os

import torch

from kernels.bench import graph_time_us, rotation_copies
from kernels.bench_gemv import _with_env, _with_pdl

SHAPES = {"8b": (4096, 4096, 14336), "06b": (1024, 2048, 3072)}  # (H, A = Hq * D, I)
# FMA form: (block_n, block_k, num_warps, ctas_per_sm, depth: register tiles ahead)
_FMA = [(8, 1024, 8, 2, 1), (16, 512, 8, 2, 1), (32, 512, 16, 1, 1), (16, 1024, 16, 2, 1),
        (8, 1024, 8, 2, 2), (16, 512, 8, 2, 2), (16, 512, 16, 1, 2), (8, 2048, 16, 1, 2)]
# tensor-core form (cp.async pipeline): (block_n, block_k, num_warps, ctas_per_sm, stages, pre_l2)
_DOT = [(64, 128, 4, 2, 3, 0), (64, 128, 4, 2, 4, 0), (32, 256, 4, 2, 4, 0), (64, 256, 8, 1, 3, 0),
        (32, 512, 8, 1, 3, 0), (64, 128, 4, 2, 4, 1024), (32, 256, 4, 2, 4, 1024)]
CANDIDATES = ([dict(zip(("block_n", "block_k", "num_warps", "ctas_per_sm", "depth"), c))
               for c in _FMA]
              + [dict(zip(("block_n", "block_k", "num_warps", "ctas_per_sm", "num_stages",
                           "pre_l2"), c), use_dot=True) for c in _DOT])
KEYS = ("block_n", "block_k", "num_warps", "ctas_per_sm", "depth", "use_dot", "num_stages",
        "pre_l2")


def _unfused(on: bool, fn):
    return _with_env("SYNCLESS_FUSED_MLP", "0" if on else "1", fn)


def bench_mlp_block() -> list[dict]:
    from kernels import ops
    from kernels.mlp_block import mlp_block_triton

    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = []
    for name, (h, a, inter) in SHAPES.items():
        nbytes = (h * a + 3 * inter * h) * 2
        copies = rotation_copies(nbytes)
        ws = [tuple(torch.randn(*s, device=dev, dtype=dt) * 0.02
                    for s in ((h, a), (2 * inter, h), (h, inter))) for _ in range(copies)]
        attn = torch.randn(1, a, device=dev, dtype=dt)
        res = torch.randn(1, h, device=dev, dtype=dt)
        nw = torch.ones(h, device=dev, dtype=dt)

        def unfused_us(pdl_on):
            return _with_pdl(pdl_on, lambda: _unfused(True, lambda: graph_time_us(
                [lambda w=w: ops.mlp_block(attn, w[0], res, nw, 1e-5, w[1], w[2])
                 for w in ws])))

        row = {"shape": name, "h": h, "a": a, "inter": inter, "weight_bytes": nbytes,
               "unfused_us": unfused_us(False), "unfused_pdl_us": unfused_us(True),
               "fused": []}
        for cand in CANDIDATES:
            cfg = dict(cand)
            try:
                us = {m: _with_pdl(m == "pdl", lambda cfg=cfg: graph_time_us(
                    [lambda w=w: mlp_block_triton(attn, w[0], res, nw, 1e-5, w[1], w[2],
                                                  config=cfg) for w in ws]))
                      for m in ("off", "pdl")}
            except Exception as e:  # resources
                row["fused"].append({**cfg, "error": repr(e)[:200]})
                continue
            row["fused"].append({**cfg, "us": us["off"], "pdl_us": us["pdl"]})
        ok = [c for c in row["fused"] if "us" in c]
        row["best"] = min(ok, key=lambda c: c["us"]) if ok else None
        row["best_pdl"] = min(ok, key=lambda c: c["pdl_us"]) if ok else None
        rows.append(row)
        tb = lambda us: nbytes / us / 1e6  # noqa: E731
        b, bp = row["best"], row["best_pdl"]
        print(f"mlp-block {name}: unfused {row['unfused_us']:7.2f} us ({tb(row['unfused_us']):.2f} "
              f"TB/s) pdl {row['unfused_pdl_us']:7.2f} | fused "
              + (f"{b['us']:7.2f} ({tb(b['us']):.2f}) {[b.get(k) for k in KEYS]} | fused-pdl "
                 f"{bp['pdl_us']:7.2f} ({tb(bp['pdl_us']):.2f}) {[bp.get(k) for k in KEYS]}"
                 if b else "none ran"), flush=True)
        del ws
        torch.cuda.empty_cache()
    return rows


def write_tuning(rows: list[dict], path: str) -> None:
    from kernels.mlp_block import tuning_key
    from kernels.skinny_gemm import TUNING_ENV, TUNING_FILE

    src = os.environ.get(TUNING_ENV, "").strip() or str(TUNING_FILE)
    try:
        with open(src) as f:
            base = json.load(f)
    except (OSError, ValueError):
        base = {"entries": {}}
    for pdl_on, p in ((False, path), (True, path.replace(".json", "") + "-pdl.json")):
        t, u = ("pdl_us", "unfused_pdl_us") if pdl_on else ("us", "unfused_us")
        entries = dict(base.get("entries", {}))
        for r in rows:
            ok = [c for c in r["fused"] if t in c]
            best = min(ok, key=lambda c: c[t]) if ok else None
            use = best is not None and best[t] < r[u]
            entries[tuning_key(r["h"], r["a"], r["inter"])] = (
                {k: best[k] for k in KEYS if k in best} if use else None)
        with open(p, "w") as f:
            json.dump(dict(base, entries=entries, mlp_block_measurements=rows), f, indent=1)
