"""Batch-1 decoder layer: the one-launch kernel (``kernels.decode_layer``) against the layer as
the model otherwise runs it (``SYNCLESS_DECODE_LAYER=0``: norm+QKV, rope+attention, o_proj,
norm+gate|up, down, with the RMSNorm handoff), PDL on as in serving, per config.

    python -m kernels.bench --only decode-layer --out /tmp/decode-layer.json

Real ``DecoderLayer`` modules of the Qwen3-0.6B and Llama-3.1-8B shapes (random weights),
batches of 1 and 8 requests (one token each) at context 512 and 4096, timed as CUDA-graph replays of a chain through enough
layer copies that their weights exceed L2 (every layer streams from HBM; each layer's
``next_layer`` is the following copy, as in the model). Reports us a layer and the
effective bandwidth (weights + the KV read, over the time), and where a launch of the
default config spends its time (per-program timestamps between phases and barriers).
"""

from __future__ import annotations

import torch

from kernels.bench import graph_time_us, rotation_copies
from kernels.bench_gemv import _with_env

SHAPE_NAMES = ("qwen3-0.6b", "llama-3.1-8b")
CONTEXTS = (512, 4096)
BATCHES = (1, 8)
BLOCK = 16
# the default, without each prefetch, bigger weight tiles (more bytes in flight an SM), and
# the attention's tiles: 32 tensor-core keys, or FMA (att_dot=0, the first default) of 64 or
# 32 rows. Compiled for sm_90 by the H200's Triton 3.6, none spills but att_dot=0 at the 8B's
# batch 1 (8 bytes); 4 or 16 warps spill (notes/2026-12-05-triton36-registers.md).
CONFIGS = [{}, dict(prefetch=0), dict(prefetch_next=0), dict(tile=16384), dict(att_keys=32),
           dict(att_dot=0), dict(att_dot=0, att_rows=32)]


def _layers(name: str, copies: int):
    from benchmarks.shapes import shape_dir
    from workers.distributed import TPGroup
    from workers.models.arch import load_arch
    from workers.models.llama import DecoderLayer
    from workers.models.rope import cos_sin_cache

    arch = load_arch(shape_dir(name))
    layers = []
    with torch.no_grad():
        for _ in range(copies):
            layer = DecoderLayer(arch, TPGroup(), torch.bfloat16).cuda()
            for pname, p in layer.named_parameters():
                if "norm" in pname:
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02)
            layers.append(layer)
    cs = cos_sin_cache(arch.head_dim, max(CONTEXTS), arch.rope_theta, arch.rope_scaling,
                       torch.float32).cuda()
    return arch, layers, cs


def _step(batch: int, ctx: int, num_kv_heads: int, head_dim: int, copies: int):
    """A decode step of ``batch`` requests at ``ctx`` tokens (their own blocks)."""
    from metadata.attention_metadata import AttentionMetadata

    dev = torch.device("cuda")
    per = -(-max(CONTEXTS) // BLOCK)
    table = torch.arange(batch * per, dtype=torch.int32, device=dev).view(batch, per)
    pos = torch.full((batch,), ctx - 1, dtype=torch.int64, device=dev)
    slots = table[:, (ctx - 1) // BLOCK].long() * BLOCK + (ctx - 1) % BLOCK
    meta = AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=dev),
        query_start_loc_cpu=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device=dev),
        seq_lens_upper_bound=torch.full((batch,), ctx, dtype=torch.int32),
        block_table=table, slot_mapping=slots, positions=pos, num_reqs=batch,
        num_actual_tokens=batch, max_query_len=1, max_seq_len_upper_bound=max(CONTEXTS),
        bounds_are_exact=True, eager=False)
    kvs = [tuple(torch.randn(batch * per, BLOCK, num_kv_heads, head_dim, device=dev,
                             dtype=torch.bfloat16) for _ in range(2)) for _ in range(copies)]
    return meta, kvs


def _profile_phases(layers, h, res, meta, kvs, cs, copies: int) -> dict:
    """One eager chain through the layer copies with per-program timestamps
    (``decode_layer_triton(profile=)``): for each stretch between two stamps, the median
    over programs and layers (ns), and the median whole-launch span (first start to last
    end)."""
    from kernels import pdl
    from kernels.decode_layer import PROFILE_STAMPS, decode_layer_triton

    p = pdl.sm_count(h.device)
    bufs = torch.zeros(copies, p, 32, dtype=torch.int64, device=h.device)
    with pdl.step_tokens(h.shape[0]):
        for i in range(copies):
            nxt = layers[(i + 1) % copies].self_attn.qkv_proj.weight
            decode_layer_triton(h, res, layers[i].layer_weights(), meta.positions, cs, *kvs[i],
                                meta.slot_mapping, meta.block_table, meta.seq_lens,
                                meta.max_seq_len_upper_bound, layers[i].self_attn.scale,
                                next_qkv=nxt, profile=bufs[i])
    torch.cuda.synchronize()
    n = len(PROFILE_STAMPS)
    # ns (%globaltimer, comparable across SMs; it may tick in ~1 us steps on some parts)
    # and SM cycles (%clock64: fine-grained, one SM's own)
    return {"ns": summarize_profile(bufs[:, :, :n].cpu()),
            "cycles": summarize_profile(bufs[:, :, 16:16 + n].cpu())}


def summarize_profile(ns: torch.Tensor) -> dict:
    """``ns``: ``[launches, programs, stamps]`` timestamps (``PROFILE_STAMPS`` order; the
    keys say ns, the unit is whatever the stamps count). For
    each stretch between consecutive stamps, its median and max over every program of every
    launch; and the median over launches of the span from the first start to the last end."""
    from kernels.decode_layer import PROFILE_STAMPS

    ns = ns.double()
    steps = ns[:, :, 1:] - ns[:, :, :-1]
    names = [f"{a} -> {b}" for a, b in zip(PROFILE_STAMPS, PROFILE_STAMPS[1:])]
    span = ns[:, :, -1].amax(1) - ns[:, :, 0].amin(1)
    return {"stretch_ns_median": dict(zip(names, steps.flatten(0, 1).median(0).values.tolist())),
            "stretch_ns_max": dict(zip(names, steps.amax((0, 1)).tolist())),
            "span_ns_median": float(span.median())}


def bench_decode_layer() -> list[dict]:
    from kernels import pdl
    from kernels.decode_layer import CONFIG_ENV

    rows = []
    for name in SHAPE_NAMES:  # PDL as in serving: auto, batch-1 passes only
        probe_arch, probe, _ = _layers(name, 1)
        wbytes = sum(p.numel() * p.element_size() for p in probe[0].parameters())
        del probe
        copies = max(2, rotation_copies(wbytes))
        arch, layers, cs = _layers(name, copies)
        for batch, ctx in ((b, c) for b in BATCHES for c in CONTEXTS):
            h = torch.randn(batch, arch.hidden_size, device="cuda", dtype=torch.bfloat16)
            res = torch.randn(batch, arch.hidden_size, device="cuda", dtype=torch.bfloat16)
            meta, kvs = _step(batch, ctx, arch.num_kv_heads, arch.head_dim, copies)
            kv_bytes = batch * 2 * ctx * arch.num_kv_heads * arch.head_dim * 2
            fns = [lambda i=i: layers[i](h, res, meta.positions, meta, kvs[i], cs,
                                         layers[(i + 1) % copies]) for i in range(copies)]

            def timed(switch: str, cfg: str = "", fns=fns, batch=batch):
                def run():
                    return _with_env(CONFIG_ENV, cfg, lambda: graph_time_us(fns))

                with pdl.step_tokens(batch):
                    return _with_env("SYNCLESS_PDL", "auto", lambda: _with_env(
                        "SYNCLESS_DECODE_LAYER", switch, run))

            row = {"shape": name, "batch": batch, "context": ctx, "weight_bytes": wbytes,
                   "kv_bytes": kv_bytes,
                   "copies": copies, "op_by_op_us": timed("0"), "one_launch": []}
            for cand in CONFIGS:
                cfg = ",".join(f"{k}={v}" for k, v in cand.items())
                try:
                    row["one_launch"].append({**cand, "us": timed("1", cfg)})
                except Exception as e:  # a config the compiler or the device refuses
                    row["one_launch"].append({**cand, "error": repr(e)[:300]})
            ok = [c for c in row["one_launch"] if "us" in c]
            row["best"] = min(ok, key=lambda c: c["us"]) if ok else None
            try:
                with_env = lambda fn: _with_env("SYNCLESS_PDL", "auto", fn)  # noqa: E731
                row["profile"] = with_env(lambda: _profile_phases(layers, h, res, meta, kvs, cs,
                                                                   copies))
                for unit in ("ns", "cycles"):
                    prof = row["profile"][unit]
                    print(f"  phases (median {unit} a program, eager chain): "
                          + ", ".join(f"{k.split(' -> ')[1]} {v:.0f}"
                                      for k, v in prof["stretch_ns_median"].items())
                          + f"; launch span {prof['span_ns_median']:.0f}", flush=True)
            except Exception as e:  # profiling is extra: never lose the timings for it
                row["profile"] = {"error": repr(e)[:300]}
            rows.append(row)
            tb = lambda us: (wbytes + kv_bytes) / us / 1e6  # noqa: E731
            base, best = row["op_by_op_us"], row["best"]
            print(f"decode-layer {name} b{batch} ctx {ctx}: op-by-op {base:7.2f} us ({tb(base):.2f} TB/s)"
                  + (f" | one launch default {ok[0]['us']:7.2f} ({tb(ok[0]['us']):.2f}) best "
                     f"{best['us']:7.2f} ({tb(best['us']):.2f}) "
                     f"{ {k: v for k, v in best.items() if k != 'us'} }" if ok else
                     " | one launch: none ran"), flush=True)
        del layers
        torch.cuda.empty_cache()
    return rows
