"""Mid-batch GEMM sweep: ``kernels.tile_gemm`` configs against cuBLAS (``F.linear``) on the
Qwen3-0.6B decode projections at batch 16-256, where cuBLAS streams the weights at 1.3-2 TB/s.
(The 16-row class also stands for batches 2-16, where the model otherwise takes the skinny
GEMM for some shapes: the table's baseline there is cuBLAS, so A/B a new 16-row entry end to
end.)

    python -m benchmarks.kernels.bench_tile_gemm --out /tmp/tile-gemm.json [--ms 32,128] [--shapes 06b_o]
        [--tuning-out kernels/tile_gemm_tuning.json]

Timings as in ``benchmarks.kernels.timing``: CUDA-graph replay of back-to-back calls over weight copies
larger than L2 (so every call reads its weights from HBM). The logits shape is compared
with ``F.linear(...).float()`` (the path the model takes there today). Every config's output
is checked against cuBLAS's before it is timed.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from benchmarks.kernels.timing import GEMM_SHAPES, gemm_args, graph_time_us, rotation_copies

# A config replaces cuBLAS only when it is this much faster (run-to-run noise of one shape).
WIN_MARGIN = 0.95
SHAPES = ("06b_qkv", "06b_o", "06b_gate_up", "06b_down", "06b_lm_head")


def candidates(m: int, k: int) -> list[dict]:
    """Tile configs worth timing at batch ``m`` (one ``BLOCK_M`` tile covers 16-128 rows)."""
    out = []
    if m <= 16:  # the 2-16-row class: one 16-row tile; N=1024 projections need split-K
        # (split 1: no split sum at all, for the wide qkv and gate|up)
        grid = [(16, bn, bk, split) for bn, bk, split in itertools.product((32, 64), (64, 128), (1, 2, 4, 8, 16))]
    else:
        grid = [
            (bm, bn, bk, split)
            for bm in sorted({min(max(32, m), 128), 64} if m >= 128 else {max(32, m)})
            for bn, bk, split in itertools.product((32, 64, 128), (64, 128), (1, 2, 4, 8))
        ]
    for bm, bn, bk, split in grid:
        if k % (split * bk) or (bm == 128 and bn == 128 and bk == 128):
            continue
        out.append(
            dict(
                block_m=bm,
                block_n=bn,
                block_k=bk,
                split_k=split,
                num_warps=8 if bm * bn >= 128 * 64 else 4,
                num_stages=4 if bk == 64 else 3,
            )
        )
    return out


def bench(ms: list[int], shapes: list[str]) -> list[dict]:
    from kernels.activation import silu_and_mul_triton
    from kernels.tile_gemm import tile_linear_triton

    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = []
    for name in shapes:
        n, k, variant = GEMM_SHAPES[name]
        logits = name.endswith("lm_head")
        out_dtype = torch.float32 if logits else None
        # gate|up: the model's row-pair layout, SiLU*mul fused here vs cuBLAS + its kernel
        act = "silu_and_mul_pairs" if variant == "norm_act_pairs" else None
        ws = [torch.randn(n, k, device=dev, dtype=dt) / k**0.5 for _ in range(rotation_copies(n * k * 2))]
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=dt)
            if logits:

                def base(w):
                    return torch.nn.functional.linear(x, w).float()
            elif act:

                def base(w):
                    return silu_and_mul_triton(torch.nn.functional.linear(x, w), pairs=True)
            else:

                def base(w):
                    return torch.nn.functional.linear(x, w)

            ref = base(ws[0]).float()
            cublas_us = graph_time_us([lambda w=w: base(w) for w in ws])
            res, ok = _sweep(m, k, ws, ref, lambda w, c: tile_linear_triton(x, w, c, out_dtype=out_dtype, act=act))
            if variant == "plain" and not logits:  # o_proj, down: feed residual + RMSNorm
                res_n = _bench_add_norm(x, ws, n, k, m)
            else:
                res_n = None
            row = {
                "shape": name,
                "n": n,
                "k": k,
                "m": m,
                "weight_bytes": n * k * 2,
                "cublas_us": cublas_us,
                "results": res,
                "best": ok[0] if ok else None,
                "ref_max_abs": ref.abs().max().item(),
                "add_norm": res_n,
            }
            rows.append(row)
            print(
                f"tile-gemm {name:12s} M={m:3d}: cuBLAS {cublas_us:7.2f} us; best "
                + "; ".join(_describe(r) for r in ok[:3])
                + (f"  -> {cublas_us / ok[0]['us']:.2f}x" if ok else ""),
                flush=True,
            )
        del ws
        torch.cuda.empty_cache()
    return rows


def _bench_add_norm(x, ws, n: int, k: int, m: int) -> dict:
    """GEMM + residual add + RMSNorm: cuBLAS then ``kernels.rms_norm`` against the tile
    GEMM's partials summed, added and normalised in one launch."""
    from kernels.rms_norm import rms_norm_triton
    from kernels.tile_gemm import tile_linear_add_norm_triton

    res = torch.randn(m, n, device=x.device, dtype=x.dtype)
    nw = torch.rand(n, device=x.device, dtype=x.dtype) + 0.5
    base_us = graph_time_us([lambda w=w: rms_norm_triton(torch.nn.functional.linear(x, w), nw, 1e-6, res) for w in ws])
    ref = rms_norm_triton(torch.nn.functional.linear(x, ws[0]), nw, 1e-6, res)[0].float()
    out, ok = _sweep(m, k, ws, ref, lambda w, c: tile_linear_add_norm_triton(x, w, c, res, nw, 1e-6)[0])
    if ok:
        print(
            f"tile-gemm   +add+norm  M={m:3d}: cuBLAS+rms_norm {base_us:7.2f} us; best " + _describe(ok[0]), flush=True
        )
    return {"cublas_norm_us": base_us, "best": ok[0] if ok else None, "results": out}


def _sweep(m: int, k: int, ws, ref, run) -> tuple[list[dict], list[dict]]:
    """Every candidate config's ``run(weight, config)``: checked against ``ref`` (max abs
    error), timed over the weight copies ``ws``. Returns (all results, the timed ones
    fastest first)."""
    res = []
    for cfg in candidates(m, k):
        try:
            err = (run(ws[0], cfg).float() - ref).abs().max().item()
            us = graph_time_us([lambda w=w, c=cfg: run(w, c) for w in ws])
        except Exception as e:  # resources (shared memory) or a compile failure
            res.append({**cfg, "error": repr(e)[:160]})
            continue
        res.append({**cfg, "us": us, "max_abs_err": err})
    return res, sorted((r for r in res if "us" in r), key=lambda r: r["us"])


def _describe(r: dict) -> str:
    return (
        f"bm{r['block_m']} bn{r['block_n']} bk{r['block_k']} s{r['split_k']} {r['us']:.2f} (err {r['max_abs_err']:.3g})"
    )


def tuning_table(rows: list[dict], device: str | None = None) -> dict:
    """The ``kernels.tile_gemm`` tuning file of a sweep: per (M class, N, K), the fastest
    config where it beat cuBLAS by ``WIN_MARGIN``, else null (cuBLAS)."""
    from kernels.tile_gemm import CONFIG_KEYS, m_class, tuning_key

    entries, why = {}, {}
    for r in rows:
        mc = m_class(r["m"])
        if mc is None or mc != r["m"]:
            continue  # only a class's own batch size speaks for it
        kinds = [("plain", r["best"], r["cublas_us"])]
        if r.get("add_norm"):
            kinds.append(("add_norm", r["add_norm"]["best"], r["add_norm"]["cublas_norm_us"]))
        for kind, best, base in kinds:
            key = tuning_key(mc, r["n"], r["k"], kind)
            win = best is not None and best["us"] < WIN_MARGIN * base
            entries[key] = {c: best[c] for c in CONFIG_KEYS} if win else None
            why[key] = (
                f"{r['shape']}: cuBLAS {base:.2f} us, tile {best['us']:.2f} us"
                if best is not None
                else f"{r['shape']}: no config ran"
            )
    return {
        "device": device or torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "command": "python -m benchmarks.kernels.bench_tile_gemm --tuning-out",
        "entries": entries,
        "measured": why,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--ms", default="32,64,128,256")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--tuning-out", help="write the winners as a kernels.tile_gemm tuning file")
    a = p.parse_args(argv)
    ms, shapes = gemm_args(p, a.ms, a.shapes)
    rows = bench(ms, shapes)
    with open(a.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tile_gemm": rows}, f, indent=1)
    if a.tuning_out:
        with open(a.tuning_out, "w") as f:
            json.dump(tuning_table(rows), f, indent=1)


if __name__ == "__main__":
    main()
