"""Batch-1 layout and overlap probes (decision data for docs/decisions.md, not a tuner).

    python -m benchmarks.kernels.bench --only probe --out /tmp/probe.json

* **gate|up layout**: the fused RMSNorm + gate|up + SiLU*mul GEMV with the stacked
  weight (gate rows, then up rows: two row sets a program) against the row-interleaved
  one (``act="silu_and_mul_pairs"``: one contiguous row set), a plain GEMV of the same
  bytes (the streaming ceiling of that shape), and the unfused RMSNorm + cuBLAS + SiLU*mul
  path; PDL off and on.

Timings: ``benchmarks.kernels.timing`` (CUDA-graph replay, weights rotated past L2).
"""

from __future__ import annotations

import torch

from benchmarks.kernels.timing import attention_caches, graph_time_us, rotation_copies, with_pdl

GATE_UP_SHAPES = {"8b_gate_up": (28672, 4096), "06b_gate_up": (6144, 1024)}
# (block_n, block_k, num_warps, num_stages, prefetch); block_n counts weight rows
PROBE_CANDIDATES = [
    (8, 1024, 4, 2, True),
    (8, 512, 4, 2, True),
    (8, 1024, 4, 2, False),
    (4, 1024, 4, 2, True),
    (16, 512, 8, 2, False),
    (16, 1024, 8, 2, True),
    (8, 2048, 8, 2, True),
    (8, 256, 2, 3, False),
]
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
        copies = rotation_copies(nbytes)
        ws = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(copies)]
        x = torch.randn(1, k, device=dev, dtype=dt)
        res = torch.randn(1, k, device=dev, dtype=dt)
        g = torch.ones(k, device=dev, dtype=dt)
        saved = ops.SKINNY_MAX_M
        ops.SKINNY_MAX_M = 0
        try:
            base = graph_time_us(
                [lambda w=w: ops.linear(x, w, residual=res, norm_weight=g, act="silu_and_mul") for w in ws]
            )
        finally:
            ops.SKINNY_MAX_M = saved
        row = {"shape": name, "n": n, "k": k, "weight_bytes": nbytes, "unfused_us": base, "variants": {}}
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
                    us = {
                        m: with_pdl(
                            m == "pdl",
                            lambda: graph_time_us(
                                [lambda w=w: skinny_linear_triton(x, w, config=cfg, **kw) for w in ws]
                            ),
                        )
                        for m in ("off", "pdl")
                    }
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
                parts.append(
                    f"{label} {b['us']:.2f} ({tb(b['us']):.2f} TB/s, bn{b['block_n']} "
                    f"bk{b['block_k']} w{b['num_warps']} pf{int(b['prefetch'])}) "
                    f"pdl {bp['pdl_us']:.2f}"
                )
        print(f"probe {name}: unfused {base:.2f} ({tb(base):.2f} TB/s) | " + " | ".join(parts), flush=True)
        ws = None  # free the copies before the next shape
        torch.cuda.empty_cache()
    return rows


def bench_probe() -> dict:
    return {"gate_up_layout": bench_gate_up_layout()}


ROPE_ATTN_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)


def bench_rope_attention(
    ctx: int = 512, bound: int = 1024, batches=ROPE_ATTN_BATCHES, device: str = "cuda", timer=graph_time_us
) -> list[dict]:
    """Decode attention with the rope + KV-write prologue inside (``rope=``) against the
    ``rope_kv`` launch followed by attention, per batch size (PDL off, one new token a
    request at position ``ctx``): the crossover behind ``ops.ROPE_IN_ATTENTION_MAX_TOKENS``.

        python -m benchmarks.kernels.bench --only rope-attention --out /tmp/rope-attn.json
    """
    from kernels.paged_attention import paged_attention_triton
    from kernels.rope_inline import DecodeRope
    from kernels.rope_kv import rope_and_write_kv_triton

    dev, dt, d, bs = torch.device(device), torch.bfloat16, 128, 16
    rows = []
    for name, hq, hkv, qk_norm in (("8b", 32, 8, False), ("06b", 16, 8, True)):
        for b in batches:
            _, caches = attention_caches(b, ctx, hkv, bound, d, bs, dev, dt)
            slots = [(c[2][:, ctx // bs].long() * bs + ctx % bs) for c in caches]
            qkv = torch.randn(b, (hq + 2 * hkv) * d, device=dev, dtype=dt)
            q = qkv[:, : hq * d].view(b, hq, d)
            k = qkv[:, hq * d : (hq + hkv) * d].view(b, hkv, d)
            v = qkv[:, (hq + hkv) * d :].view(b, hkv, d)
            seq = torch.full((b,), ctx + 1, device=dev, dtype=torch.int32)
            qsl = torch.arange(b + 1, device=dev, dtype=torch.int32)
            pos = torch.full((b,), ctx, device=dev, dtype=torch.int64)
            cs = torch.randn(bound, d, device=dev, dtype=torch.float32)
            w = torch.ones(d, device=dev, dtype=dt) if qk_norm else None

            def two(c, sl):
                qr = rope_and_write_kv_triton(pos, q, k, v, cs, c[0], c[1], sl, w, w, 1e-6)
                return paged_attention_triton(qr, c[0], c[1], c[2], seq, qsl, 1, bound, d**-0.5)

            def one(c, sl):
                return paged_attention_triton(
                    q, c[0], c[1], c[2], seq, qsl, 1, bound, d**-0.5, rope=DecodeRope(pos, k, v, cs, sl, w, w, 1e-6)
                )

            row = {"shape": name, "batch": b, "context": ctx, "bound": bound}
            for label, fn in (("two_launches", two), ("rope_in_attention", one)):
                try:
                    row[label + "_us"] = with_pdl(
                        False, lambda fn=fn: timer([lambda c=c, sl=sl: fn(c, sl) for c, sl in zip(caches, slots)])
                    )
                except Exception as e:  # resources
                    row[label + "_error"] = repr(e)[:160]
            rows.append(row)
            print(
                f"rope-attention {name} b={b:3d}: two launches "
                f"{row.get('two_launches_us', float('nan')):7.2f} us, fused "
                f"{row.get('rope_in_attention_us', float('nan')):7.2f} us",
                flush=True,
            )
            caches = None
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return rows
