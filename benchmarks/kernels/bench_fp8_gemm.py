"""FP8 (e4m3) GEMM benchmark: ``kernels.fp8_gemm`` against bf16 ``F.linear`` and ``torch._scaled_mm``.

The Triton GEMM (with the per-token activation quantization of ``kernels.fp8_quant``) against
the bf16 ``F.linear`` (cuBLAS) and ``torch._scaled_mm`` (rowwise scales) on the Llama-3.1-8B
projections, batch 1 to 4096.

    python -m benchmarks.kernels.bench_fp8_gemm [--ms 1,8,32] [--shapes 8b_o,8b_down]
        [--fast-accum] [--output /tmp/fp8-gemm.json]

Timings as in ``benchmarks.kernels.timing``: CUDA-graph replay of back-to-back calls (CUDA
events), rotating over weight copies larger than L2 so every call reads its weights from HBM.
"fp8" includes the activation quantization (the layer as the model would run it), "gemm"
is the GEMM alone, "w-only" the weight-only path serving takes up to 16 rows (``ops.linear``:
the skinny GEMM widening the FP8 weight, no activation quantization); ``_scaled_mm`` is
timed with the same quantization. Bandwidth: the weight's bytes (2 a value for bf16, 1 for
fp8) over the time. Each output's error against the float32 product of the bf16 operands is
printed too (relative Frobenius norm).
"""

from __future__ import annotations

import argparse
import json
import platform

import torch

from benchmarks.kernels.timing import GEMM_SHAPES, gemm_args, graph_time_us, rotation_copies

MS = (1, 8, 32, 128, 256, 1024, 4096)
SHAPES = ("8b_qkv", "8b_o", "8b_gate_up", "8b_down")


def _rel_err(y: torch.Tensor, exact: torch.Tensor) -> float:
    return float((y.float() - exact).norm() / exact.norm().clamp_min(1e-30))


def _scaled_mm(xq, xs, wq, ws):
    """``torch._scaled_mm`` with rowwise scales (sm_89+; None where this build lacks it)."""
    if not hasattr(torch, "_scaled_mm"):
        return None
    return torch._scaled_mm(xq, wq.t(), scale_a=xs[:, None], scale_b=ws[None, :], out_dtype=torch.bfloat16)


def bench(ms: list[int], shapes: list[str], fast_accum: bool = False, device: str = "cuda") -> list[dict]:
    from kernels import ops
    from kernels.fp8_gemm import fp8_gemm_triton, select_fp8_config
    from kernels.fp8_quant import quantize_rows_triton
    from kernels.fp8_reference import quantize_weight_fp8

    dev, dt = torch.device(device), torch.bfloat16
    rows = []
    for name in shapes:
        n, k, _ = GEMM_SHAPES[name]
        copies = rotation_copies(n * k * 2)
        ws16 = [torch.randn(n, k, device=dev, dtype=dt) / k**0.5 for _ in range(copies)]
        # the fp8 copies (1 byte a value): enough of them to exceed L2 as well
        w8 = [quantize_weight_fp8(ws16[i % copies]) for i in range(rotation_copies(n * k))]
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=dt)
            cfg = dict(select_fp8_config(m, n, k), fast_accum=fast_accum)
            xq, xs = quantize_rows_triton(x)
            exact = x.float() @ ws16[0].float().T

            def fp8(wq, ws):
                q, s = quantize_rows_triton(x)
                return fp8_gemm_triton(q, s, wq, ws, config=cfg)

            def mm(wq, ws):
                q, s = quantize_rows_triton(x)
                return _scaled_mm(q, s, wq, ws)

            row = {"shape": name, "n": n, "k": k, "m": m, "config": cfg, "bf16_weight_bytes": n * k * 2}
            row["bf16_us"] = graph_time_us([lambda w=w: torch.nn.functional.linear(x, w) for w in ws16])
            row["bf16_err"] = _rel_err(torch.nn.functional.linear(x, ws16[0]), exact)
            row["fp8_us"] = graph_time_us([lambda p=p: fp8(*p) for p in w8])
            row["gemm_us"] = graph_time_us([lambda p=p: fp8_gemm_triton(xq, xs, *p, config=cfg) for p in w8])
            row["fp8_err"] = _rel_err(fp8(*w8[0]), exact)
            row["wonly_us"] = None
            if m <= ops.SKINNY_MAX_M:  # decode: what serving runs (weight-only skinny GEMM)
                wonly = [lambda p=p: ops.linear(x, p[0], weight_scale=p[1]) for p in w8]
                row["wonly_us"] = graph_time_us(wonly)
                row["wonly_err"] = _rel_err(wonly[0]()[0], exact)
            try:
                row["scaled_mm_err"] = _rel_err(mm(*w8[0]), exact)
                row["scaled_mm_us"] = graph_time_us([lambda p=p: mm(*p) for p in w8])
            except (RuntimeError, TypeError, AttributeError) as e:  # no rowwise fp8 here, or a shape it refuses
                row["scaled_mm_us"], row["scaled_mm_error"] = None, repr(e)[:160]
            for key in ("bf16", "fp8", "gemm", "wonly", "scaled_mm"):
                us, nbytes = row[f"{key}_us"], n * k * (2 if key == "bf16" else 1)
                row[f"{key}_gbps"] = None if us is None else nbytes / us / 1e3
            rows.append(row)
            _print_row(row)
        del ws16, w8
        torch.cuda.empty_cache()
    return rows


HEADER = (
    f"{'shape':11s} {'M':>5s} {'class':7s} {'split':>5s} | {'bf16 us':>8s} {'GB/s':>6s} | "
    f"{'fp8 us':>8s} {'GB/s':>6s} {'gemm us':>8s} {'w-only':>8s} | {'_scaled_mm':>10s} {'GB/s':>6s} | {'speedup':>8s} "
    f"{'err fp8':>8s} {'err mm':>8s}"
)


def _print_row(r: dict) -> None:
    smm = r["scaled_mm_us"]
    print(
        f"{r['shape']:11s} {r['m']:5d} {r['config']['kind']:7s} {r['config']['split_k']:5d} | "
        f"{r['bf16_us']:8.2f} {r['bf16_gbps']:6.0f} | {r['fp8_us']:8.2f} {r['fp8_gbps']:6.0f} {r['gemm_us']:8.2f} "
        + (f"{r['wonly_us']:8.2f} | " if r["wonly_us"] is not None else f"{'-':>8s} | ")
        + (f"{smm:10.2f} {r['scaled_mm_gbps']:6.0f}" if smm is not None else f"{'n/a':>10s} {'':6s}")
        + f" | {r['bf16_us'] / r['fp8_us']:7.2f}x {r['fp8_err']:8.4f} {r.get('scaled_mm_err', float('nan')):8.4f}",
        flush=True,
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ms", default=",".join(map(str, MS)), help="batch sizes (rows of x)")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"of {sorted(GEMM_SHAPES)}")
    p.add_argument("--fast-accum", action="store_true", help="Hopper's reduced-precision fp8 accumulation")
    p.add_argument("--output", help="write the rows (and the device) as JSON here")
    a = p.parse_args(argv)
    ms, shapes = gemm_args(p, a.ms, a.shapes)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    import triton

    print(HEADER)
    rows = bench(ms, shapes, fast_accum=a.fast_accum)
    if a.output:
        meta = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "host": platform.node(),
            "fast_accum": a.fast_accum,
        }
        with open(a.output, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=1)
        print(f"wrote {a.output}")


if __name__ == "__main__":
    main()
