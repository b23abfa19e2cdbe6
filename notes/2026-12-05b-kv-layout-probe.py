"""KV-cache page layout probe (H200 decision data, not shipped code).

The cache is ``[num_blocks, block_size, num_kv_heads, head_dim]`` (token-major, "NHD"): one
program's keys (one KV head) are 256-byte rows 2 KB apart. Head-major pages ("HND",
``[num_blocks, num_kv_heads, block_size, head_dim]``) give each program 4 KB contiguous runs
(16 rows). Every kernel addresses the cache through its strides, so the probe passes the
head-major memory as a permuted view of the same logical shape: same kernel, same values.

    python notes/2026-12-05b-kv-layout-probe.py [--out FILE]

Decode attention (one query token a request, the engine's own launch shape), CUDA-graph
replay, caches rotated past L2; checks the two layouts give bitwise equal outputs.
"""

from __future__ import annotations

import argparse
import json

import torch

from kernels.bench import _attention_caches, graph_time_us
from kernels.paged_attention import paged_attention_triton

CASES = [  # (batch, context, q heads, kv heads, graph bucket bound)
    (1, 512, 32, 8, 1024), (1, 4096, 32, 8, 4126), (8, 4096, 16, 8, 4126),
    (32, 512, 16, 8, 1024), (128, 512, 16, 8, 1024), (256, 512, 16, 8, 1024),
    (128, 4096, 16, 8, 4126),
]


def head_major(t: torch.Tensor) -> torch.Tensor:
    """The same logical [blocks, bs, hkv, d] tensor, stored [blocks, hkv, bs, d]."""
    return t.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="")
    a = p.parse_args()
    dev, dt, d, bs = torch.device("cuda"), torch.bfloat16, 128, 16
    rows = []
    for b, ctx, hq, hkv, bound in CASES:
        kv_bytes, nhd = _attention_caches(b, ctx, hkv, bound, d, bs, dev, dt)
        hnd = [(head_major(k), head_major(v), bt) for k, v, bt in nhd]
        q = torch.randn(b, hq, d, device=dev, dtype=dt)
        seq = torch.full((b,), ctx + 1, device=dev, dtype=torch.int32)
        qsl = torch.arange(b + 1, device=dev, dtype=torch.int32)

        def run(c):
            return paged_attention_triton(q, c[0], c[1], c[2], seq, qsl, 1, bound, d ** -0.5)

        same = torch.equal(run(nhd[0]), run(hnd[0]))
        us = {}
        for rep in range(2):  # alternate, twice: drift shows as a spread
            for name, cs in (("nhd", nhd), ("hnd", hnd)):
                us.setdefault(name, []).append(graph_time_us([lambda c=c: run(c) for c in cs]))
        row = {"batch": b, "context": ctx, "hq": hq, "hkv": hkv, "bound": bound,
               "kv_bytes": kv_bytes, "bitwise_equal": same, "us": us}
        rows.append(row)
        tb = {n: kv_bytes / min(v) / 1e6 for n, v in us.items()}
        print(f"kv-layout b{b:>3} ctx{ctx:>5} hq{hq}: NHD {min(us['nhd']):7.2f} us "
              f"({tb['nhd']:.2f} TB/s) | HND {min(us['hnd']):7.2f} us ({tb['hnd']:.2f} TB/s) | "
              f"HND/NHD {min(us['hnd']) / min(us['nhd']):.3f} | equal {same}", flush=True)
        del nhd, hnd
        torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
