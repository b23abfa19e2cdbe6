"""Where a one-token decode attention launch spends its time: each program's ``%globaltimer``
at fixed points (``paged_attention_triton(stamps=...)``), over a CUDA graph of launches as the
engine chains them (optionally each after the QKV projection that feeds it).

    python -m kernels.bench_attention_stamps --out /tmp/attn-stamps.json

Offsets are from the launch's first program start; ``gap`` is that start minus the end of
the kernel before it (the previous attention's last program, or the QKV GEMV's end as seen
by ``after_wait``). Medians over the graph's launches.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

STAMP_NAMES = ("start", "pre_wait", "after_wait", "q_ready", "tiles_done", "arrived", "merged",
               "end")
CASES = (  # (name, batch, context, hq, hkv, q/k norm, bound)
    ("8b", 1, 512, 32, 8, False, 1024), ("06b", 1, 512, 16, 8, True, 1024),
    ("8b", 8, 512, 32, 8, False, 1024), ("8b", 1, 4096, 32, 8, False, 4128),
)


def summarize(stamps: torch.Tensor) -> dict:
    """``stamps``: int64 ``[launches, programs + 1, 32]`` (0 = not written), launches in graph
    order. Per stamp: the median over launches (all but the first) of the earliest, median
    and latest program's offset from the launch's first start, in us; plus the gap from the
    previous launch's last ``end`` stamp and each launch's span."""
    ns = stamps[..., : len(STAMP_NAMES)].double()
    per = {n: {"first": [], "median": [], "last": []} for n in STAMP_NAMES}
    gaps, spans = [], []
    prev_end = None
    for call in ns:
        written = call[:, 0] > 0
        if not bool(written.any()):
            prev_end = None
            continue
        t0 = call[written, 0].min()
        ends = call[:, STAMP_NAMES.index("end")]
        end = ends[ends > 0].max() if bool((ends > 0).any()) else None
        if prev_end is not None:
            gaps.append(float(t0 - prev_end) / 1e3)
            for k, name in enumerate(STAMP_NAMES):
                col = call[:, k]
                col = col[col > 0]
                if col.numel():
                    off = (col - t0) / 1e3
                    per[name]["first"].append(float(off.min()))
                    per[name]["median"].append(float(off.quantile(0.5)))
                    per[name]["last"].append(float(off.max()))
            if end is not None:
                spans.append(float(end - t0) / 1e3)
        prev_end = end
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return {"gap_us": med(gaps), "span_us": med(spans), "launches": len(spans),
            "stamps_us": {n: {k: med(v) for k, v in d.items()} for n, d in per.items()}}


def _case(name, b, ctx, hq, hkv, qk_norm, bound, with_qkv: bool) -> dict:
    from kernels import ops, pdl
    from kernels.bench import _attention_caches
    from kernels.paged_attention import paged_attention_triton
    from kernels.rope_inline import DecodeRope

    dev, dt, d, bs = torch.device("cuda"), torch.bfloat16, 128, 16
    _, caches = _attention_caches(b, ctx, hkv, bound, d, bs, dev, dt)
    hidden = hq * d
    w_qkv = (torch.randn((hq + 2 * hkv) * d, hidden, device=dev, dtype=dt) * 0.02
             if with_qkv else None)
    x = torch.randn(b, hidden, device=dev, dtype=dt)
    qkv0 = torch.randn(b, (hq + 2 * hkv) * d, device=dev, dtype=dt)
    seq = torch.full((b,), ctx + 1, device=dev, dtype=torch.int32)
    qsl = torch.arange(b + 1, device=dev, dtype=torch.int32)
    pos = torch.full((b,), ctx, device=dev, dtype=torch.int64)
    cs = torch.randn(bound, d, device=dev, dtype=torch.float32)
    w = torch.ones(d, device=dev, dtype=dt) if qk_norm else None
    slots = [(c[2][:, ctx // bs].long() * bs + ctx % bs) for c in caches]
    programs = b * hkv * 64
    stamps = torch.zeros(len(caches), programs + 1, 32, device=dev, dtype=torch.int64)

    def call(i):
        qkv = ops.linear(x, w_qkv)[0] if with_qkv else qkv0  # (y, new_residual)
        q = qkv[:, : hq * d].view(b, hq, d)
        k = qkv[:, hq * d: (hq + hkv) * d].view(b, hkv, d)
        v = qkv[:, (hq + hkv) * d:].view(b, hkv, d)
        c = caches[i]
        return paged_attention_triton(q, c[0], c[1], c[2], seq, qsl, 1, bound, d ** -0.5,
                                      rope=DecodeRope(pos, k, v, cs, slots[i], w, w, 1e-6),
                                      stamps=stamps[i])

    with pdl.step_tokens(b):  # as the engine declares its passes (PDL's auto mode reads it)
        for i in range(len(caches)):
            call(i)
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side), torch.cuda.graph(g, stream=side):
            for i in range(len(caches)):
                call(i)
    torch.cuda.current_stream().wait_stream(side)
    for _ in range(3):
        g.replay()
    stamps.zero_()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    g.replay()
    stop.record()
    stop.synchronize()
    res = summarize(stamps.cpu())
    res["us_per_launch"] = start.elapsed_time(stop) * 1e3 / len(caches)
    return {"shape": name, "batch": b, "context": ctx, "bound": bound, "after_qkv": with_qkv, **res}


def main(argv=None) -> list[dict]:
    from kernels import pdl

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    rows = []
    for case in CASES:
        for with_qkv in (False, True):
            try:
                r = _case(*case, with_qkv=with_qkv)
            except Exception as e:  # one broken case must not hide the others' stamps
                print(f"stamps {case[0]} b{case[1]} ctx{case[2]} qkv={int(with_qkv)}: "
                      f"failed: {type(e).__name__}: {e}", flush=True)
                continue
            r["pdl"], r["preload"] = pdl.mode(), pdl.attention_preload()
            rows.append(r)
            s = r["stamps_us"]
            print(f"stamps {r['shape']} b{r['batch']} ctx{r['context']} qkv={int(with_qkv)}: "
                  f"{r['us_per_launch']:.2f} us a launch (qkv incl.), gap {r['gap_us']}, span "
                  f"{r['span_us']}; " + " ".join(
                      f"{n} {s[n]['first']:.2f}/{s[n]['median']:.2f}/{s[n]['last']:.2f}"
                      for n in STAMP_NAMES if s[n]["median"] is not None), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
