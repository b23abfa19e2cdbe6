"""Batch-1 layout and overlap probes (H200 decision data, not a tuner).

    python -m kernels.bench --only probe --out /tmp/probe.json

* **gate|up layout**: the fused RMSNorm + gate|up + SiLU*mul GEMV with the stacked
  weight (gate rows, then up rows: two row sets a program) against the row-interleaved
  one (``act="silu_and_mul_pairs"``: one contiguous row set), a plain GEMV of the same
  bytes (the streaming ceiling of that shape), and the unfused RMSNorm + cuBLAS + SiLU*mul
  path; PDL off and on.
* **attention -> o_proj overlap**: decode attention followed by the o_proj GEMV that
  reads its output, as in a layer. Batch-1 attention keeps HBM mostly idle, so with PDL
  the GEMV's programs (launched early) can bulk-prefetch their weight rows into L2
  during it (``prefetch_l2`` in a tuning entry). Timed per pair, against each alone.

Timings as in ``kernels.bench`` (CUDA-graph replay, weights rotated past L2).
"""

from __future__ import annotations

import torch

from kernels.bench import L2_BYTES, _attention_caches, graph_time_us
from kernels.bench_gemv import _with_env, _with_pdl

GATE_UP_SHAPES = {"8b_gate_up": (28672, 4096), "06b_gate_up": (6144, 1024)}
# (block_n, block_k, num_warps, num_stages, prefetch); block_n counts weight rows
PROBE_CANDIDATES = [(8, 1024, 4, 2, True), (8, 512, 4, 2, True), (8, 1024, 4, 2, False),
                    (4, 1024, 4, 2, True), (16, 512, 8, 2, False), (16, 1024, 8, 2, True),
                    (8, 2048, 8, 2, True), (8, 256, 2, 3, False)]
# (name, hq, hkv, o_proj out, in): the decode attention and o_proj of each shape
ATTN_O_SHAPES = [("8b", 32, 8, 4096, 4096), ("06b", 16, 8, 1024, 2048)]


def _cfg(c):
    return dict(zip(("block_n", "block_k", "num_warps", "num_stages", "prefetch"), c), use_dot=False)


def bench_gate_up_layout() -> list[dict]:
    from kernels import ops
    from kernels.skinny_gemm import skinny_linear_triton

    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = []
    for name, (n, k) in GATE_UP_SHAPES.items():
        nbytes = n * k * 2
        copies = max(1, min(32, -(-4 * L2_BYTES // nbytes)))
        ws = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(copies)]
        x = torch.randn(1, k, device=dev, dtype=dt)
        res = torch.randn(1, k, device=dev, dtype=dt)
        g = torch.ones(k, device=dev, dtype=dt)
        saved = ops.SKINNY_MAX_M
        ops.SKINNY_MAX_M = 0
        try:
            base = graph_time_us([lambda w=w: ops.linear(x, w, residual=res, norm_weight=g,
                                                         act="silu_and_mul") for w in ws])
        finally:
            ops.SKINNY_MAX_M = saved
        row = {"shape": name, "n": n, "k": k, "weight_bytes": nbytes, "unfused_us": base,
               "variants": {}}
        variants = {
            "stacked": dict(residual=res, norm_weight=g, act="silu_and_mul"),
            "pairs": dict(residual=res, norm_weight=g, act="silu_and_mul_pairs"),
            "plain": dict(),
        }
        for label, kw in variants.items():
            out = []
            for c in PROBE_CANDIDATES:
                cfg = _cfg(c)
                try:
                    us = {m: _with_pdl(m == "pdl", lambda: graph_time_us(
                        [lambda w=w: skinny_linear_triton(x, w, config=cfg, **kw) for w in ws]))
                          for m in ("off", "pdl")}
                except Exception as e:  # resources
                    out.append({**cfg, "error": repr(e)[:160]})
                    continue
                out.append({**cfg, "us": us["off"], "pdl_us": us["pdl"]})
            row["variants"][label] = out
        rows.append(row)
        tb = lambda us: nbytes / us / 1e6  # noqa: E731
        parts = []
        for label, out in row["variants"].items():
            ok = [c for c in out if "us" in c]
            if ok:
                b = min(ok, key=lambda c: c["us"])
                bp = min(ok, key=lambda c: c["pdl_us"])
                parts.append(f"{label} {b['us']:.2f} ({tb(b['us']):.2f} TB/s, bn{b['block_n']} "
                             f"bk{b['block_k']} w{b['num_warps']} pf{int(b['prefetch'])}) "
                             f"pdl {bp['pdl_us']:.2f}")
        print(f"probe {name}: unfused {base:.2f} ({tb(base):.2f} TB/s) | " + " | ".join(parts),
              flush=True)
        del ws
        torch.cuda.empty_cache()
    return rows


def bench_attention_then_o(ctx: int = 512, bound: int = 1024) -> list[dict]:
    from kernels.paged_attention import paged_attention_triton
    from kernels.skinny_gemm import select_config, fallback_config, skinny_linear_triton

    dev, dt, d, bs = torch.device("cuda"), torch.bfloat16, 128, 16
    rows = []
    for name, hq, hkv, n, k in ATTN_O_SHAPES:
        _, caches = _attention_caches(1, ctx, hkv, bound, d, bs, dev, dt)
        copies = max(1, min(32, -(-4 * L2_BYTES // (n * k * 2))))
        ws = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(copies)]
        q = torch.randn(1, hq, d, device=dev, dtype=dt)
        seq = torch.full((1,), ctx + 1, device=dev, dtype=torch.int32)
        qsl = torch.arange(2, device=dev, dtype=torch.int32)
        cfg = select_config(1, n, k, "plain") or fallback_config(1)
        if cfg.get("kernel") == "gemv":
            cfg = fallback_config(1)
        x = torch.randn(1, k, device=dev, dtype=dt)

        def attn(c):
            return paged_attention_triton(q, c[0], c[1], c[2], seq, qsl, 1, bound, d ** -0.5)

        def pair(i, pre):
            c, w = caches[i % len(caches)], ws[i % len(ws)]
            o = attn(c).view(1, hq * d)
            return skinny_linear_triton(o, w, config=dict(cfg, prefetch_l2=pre))

        n_fns = max(len(caches), len(ws))
        row = {"shape": name, "o_config": cfg, "cases": {}}
        cases = {
            "attn": ("0", lambda pre: [lambda c=c: attn(c) for c in caches]),
            "o": ("0", lambda pre: [lambda w=w: skinny_linear_triton(
                x, w, config=dict(cfg, prefetch_l2=pre)) for w in ws]),
            "attn+o": ("0", lambda pre: [lambda i=i: pair(i, pre) for i in range(n_fns)]),
        }
        for label, (_, make) in cases.items():
            for mode, pre in (("off", 0), ("pdl", 0), ("pdl_l2_4096", 4096), ("pdl_l2_row", True)):
                if label == "attn" and pre:
                    continue
                try:
                    us = _with_env("SYNCLESS_L2_PREFETCH", "0", lambda: _with_pdl(
                        mode != "off", lambda: graph_time_us(make(pre))))
                except Exception as e:
                    row["cases"][f"{label}/{mode}"] = {"error": repr(e)[:160]}
                    continue
                row["cases"][f"{label}/{mode}"] = {"us": us}
        rows.append(row)
        print(f"probe attn->o {name}: " + ", ".join(
            f"{key} {v['us']:.2f}" for key, v in row["cases"].items() if "us" in v), flush=True)
        del caches, ws
        torch.cuda.empty_cache()
    return rows


def bench_probe() -> dict:
    return {"gate_up_layout": bench_gate_up_layout(), "attention_then_o": bench_attention_then_o()}
