"""Decode attention A/B on the GPU (graph replay): the kernel of 74998da (stop 16), of HEAD
before stop 20 and of the working tree, at split/tile configs, for the decode cells whose
attention is not fused with rope. Run from the repo root with old74/ holding 74998da's
kernels (git archive 74998da | tar -x -C old74) and old74/pa_head.py the pre-stop-20 file."""
import importlib.util
import json
import os
import sys

import torch

sys.path.insert(0, ".")
from kernels.bench import _attention_caches, graph_time_us  # noqa: E402
from kernels.paged_attention import choose_num_splits  # noqa: E402


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


import kernels.paged_attention as cur  # noqa: E402
impls = {"stop16": _load("pa_stop16", "old74/kernels/paged_attention.py"),
         "head": _load("pa_head", "old74/pa_head.py"), "tree": cur}
dev, dt, d, bs = torch.device("cuda"), torch.bfloat16, 128, 16
CFGS = [None, (4, 128, 4, 2), (5, 128, 4, 2), (5, 64, 4, 2), (8, 64, 4, 2), (9, 64, 4, 3), (9, 64, 4, 2)]
out = []
for b, ctx, hq, hkv, bound in [(8, 4096, 32, 8, 4124), (8, 4096, 16, 8, 4124), (32, 4096, 32, 8, 4124),
                               (32, 512, 16, 8, 1024), (8, 512, 16, 8, 1024)]:
    kv_bytes, caches = _attention_caches(b, ctx, hkv, bound, d, bs, dev, dt)
    q = torch.randn(b, hq, d, device=dev, dtype=dt)
    seq = torch.full((b,), ctx + 1, device=dev, dtype=torch.int32)
    qsl = torch.arange(b + 1, device=dev, dtype=torch.int32)
    heur = choose_num_splits(b, hkv, 1, bound)
    row = {"case": [b, ctx, hq, hkv, bound], "kv_bytes": kv_bytes, "heuristic_splits": heur, "us": {}}
    for cfg in CFGS:
        kw = {} if cfg is None else dict(num_splits=cfg[0], config=dict(block_n=cfg[1], num_warps=cfg[2], num_stages=cfg[3]))
        label = "default" if cfg is None else "s%d bn%d w%d st%d" % cfg
        for name, mod in impls.items():
            us = graph_time_us([lambda c=c, mod=mod: mod.paged_attention_triton(
                q, c[0], c[1], c[2], seq, qsl, 1, bound, d ** -0.5, **kw) for c in caches])
            row["us"][f"{name} {label}"] = us
    out.append(row)
    print(f"b{b} ctx{ctx} hq{hq} (heuristic {heur} splits, {kv_bytes / 1e6:.0f} MB):", flush=True)
    for cfg in CFGS:
        label = "default" if cfg is None else "s%d bn%d w%d st%d" % cfg
        print(f"   {label:18s}" + "".join(f" {n} {row['us'][f'{n} {label}']:6.1f}" for n in impls), flush=True)
    del caches
    torch.cuda.empty_cache()
json.dump(out, open(os.environ.get("OUT", "/tmp") + "/attn-ab.json", "w"), indent=1)
