"""Prefill-shaped paged attention tiles (2026-12-05h probe, not a test or a tuner).

The throughput workload's prefill forward spends 3.55 ms of 18.3 in ``_paged_attention_kernel``
(16 prompts x 512 tokens, Qwen3-0.6B heads: 16 q, 8 kv, d 128; H100). This times that one
launch (``kernels.bench.graph_time_us``: a CUDA graph of back-to-back calls) for prefill tile variants, checks each output against the
shipped config's, and prints a table.

    python notes/2026-12-05h-prefill-attn-probe.py [PROMPTS] [LEN] [HQ] [HKV]
"""

import sys

import torch

from kernels import paged_attention as pa
from kernels.bench import graph_time_us

n_req, plen = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (16, 512)
hq, hkv = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else (16, 8)
d, bs, dev, dt = 128, 16, torch.device("cuda", 0), torch.bfloat16
per = -(-plen // bs)
n = n_req * plen
g = torch.Generator(device=dev).manual_seed(0)
q = torch.randn(n, hq, d, device=dev, dtype=dt, generator=g)
kc = torch.randn(n_req * per, bs, hkv, d, device=dev, dtype=dt, generator=g)
vc = torch.randn(n_req * per, bs, hkv, d, device=dev, dtype=dt, generator=g)
table = torch.arange(n_req * per, dtype=torch.int32, device=dev).view(n_req, per)
seq = torch.full((n_req,), plen, dtype=torch.int32, device=dev)
qsl = torch.arange(0, n + 1, plen, dtype=torch.int32, device=dev)
scale = d ** -0.5
shipped = pa.launch_config


def run(block_m=None, **cfg):
    def patched(*a, **k):
        lc = shipped(*a, **k)
        if block_m is None or lc.one_qblock:
            return lc
        group_p = a[3]
        block_q = block_m // group_p
        return lc._replace(block_m=block_m, block_q=block_q, grid0=a[1] // block_q + a[0])
    pa.launch_config = patched
    try:
        return pa.paged_attention_triton(q, kc, vc, table, seq, qsl, plen, plen, scale, eager=True,
                                         config=cfg or None)
    finally:
        pa.launch_config = shipped


ref = run()
flops = 4 * n_req * hq * d * plen * (plen + 1) / 2
rows = []
variants = [dict()] + [dict(block_m=m, block_n=bn, num_warps=w, num_stages=st)
                       for m in (64, 128) for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3)]
for v in variants:
    try:
        out = run(**v)
        err = (out.float() - ref.float()).abs().max().item()
        us = graph_time_us([lambda: run(**v)])
        rows.append((us, v, err))
    except Exception as exc:  # e.g. out of shared memory
        rows.append((float("inf"), v, f"{type(exc).__name__}: {str(exc)[:60]}"))
base = rows[0][0]
print(f"{n_req} x {plen}, hq {hq} hkv {hkv}: shipped {base:.1f} us ({flops / base / 1e6:.0f} TFLOP/s)")
for us, v, err in sorted(rows, key=lambda r: r[0])[:12]:
    print(f"  {us:8.1f} us  {base / us:5.2f}x  err {err if isinstance(err, str) else f'{err:.2e}'}  {v or 'shipped'}")
