"""The skinny GEMM's tuning table (``kernels/skinny_tuning.json``): each model shape's candidate
tiles timed against what runs without them, the winners written where ``kernels.skinny_gemm.
select_config`` reads them (``python -m benchmarks.kernels.bench --tune FILE [--weights fp8]``)."""

from __future__ import annotations

import json

import torch

from benchmarks.kernels.timing import GEMM_SHAPES, KIND, gemm_call_kwargs, graph_time_us, rotation_copies

TUNE_CANDIDATES = {  # M class -> (use_dot, block_n, block_k, num_warps, num_stages, prefetch)
    1: [
        (False, 8, 512, 4, 2, False),
        (False, 4, 1024, 4, 2, False),
        (False, 8, 1024, 4, 2, False),
        (False, 16, 512, 8, 2, False),
        (False, 8, 256, 2, 3, False),
        (False, 8, 512, 4, 2, True),
        (False, 4, 1024, 4, 2, True),
        (False, 4, 512, 2, 2, True),
    ],
    16: [
        (True, 32, 256, 4, 4, False),
        (True, 64, 128, 4, 4, False),
        (True, 16, 256, 4, 4, False),
        (True, 32, 128, 4, 5, False),
    ],
}
# FP8 weights: a tile of the same shape moves half the bytes, so deeper K tiles join in
TUNE_CANDIDATES_FP8 = {
    1: [
        (False, 8, 1024, 4, 2, False),
        (False, 8, 2048, 4, 2, False),
        (False, 4, 2048, 4, 2, False),
        (False, 16, 1024, 8, 2, False),
        (False, 4, 1024, 4, 2, True),
        (False, 4, 2048, 4, 2, True),
        (False, 8, 512, 4, 2, False),
    ],
    16: [
        (True, 32, 256, 4, 4, False),
        (True, 32, 512, 4, 3, False),
        (True, 64, 256, 4, 4, False),
        (True, 16, 512, 4, 4, False),
        (True, 64, 128, 4, 4, False),
        (True, 32, 128, 4, 5, False),
    ],
    # 17-64 rows: weight-only (16-bit activations, no quantization launch) against the
    # quantize + FP8 GEMM path serving runs there now
    32: [
        (True, 32, 256, 4, 4, False),
        (True, 64, 256, 4, 3, False),
        (True, 32, 512, 4, 3, False),
        (True, 64, 128, 4, 4, False),
        (True, 32, 128, 8, 4, False),  # small K tiles, 8 warps: the fused norm's registers
    ],
    64: [
        (True, 32, 256, 4, 3, False),
        (True, 64, 256, 8, 3, False),
        (True, 64, 128, 4, 4, False),
        (True, 128, 128, 8, 3, False),
        (True, 32, 64, 8, 4, False),
    ],
}
CONFIG_FIELDS = ("use_dot", "block_n", "block_k", "num_warps", "num_stages", "prefetch")


def bench_gemm(ms: list[int], fp8: bool = False, shapes: list[str] | None = None) -> list[dict]:
    """Each model shape's skinny candidates against its baseline at each M of its classes. 16-bit
    weights: the baseline is the unfused path (norm kernel + cuBLAS + act kernel). ``fp8``:
    per-row FP8 weights (no lm_head), M up to 64, the baseline is what serving runs without FP8
    entries (``without_fp8_entries``: the 16-bit entries' tiles, the unfused norm + weight-only
    GEMM + act, or past 16 rows the activation quantization + FP8 GEMM); past 16 rows the
    fused-norm shapes also time the norm kernel +
    plain weight-only GEMM + act composition (``best_unfused``)."""
    from kernels import ops
    from kernels.fp8_reference import quantize_weight_fp8
    from kernels.settings import current, overridden
    from kernels.skinny_gemm import load_table, m_class, skinny_linear_triton

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: smoke tests
    dt = torch.bfloat16
    candidates = TUNE_CANDIDATES_FP8 if fp8 else TUNE_CANDIDATES
    served = current().skinny_table  # (None outside an engine: the packaged table, as select_config reads it)
    served = load_table() if served is None else served
    rows = []
    for name, (n, k, variant) in GEMM_SHAPES.items():
        if shapes is not None and name not in shapes:
            continue
        if fp8 and variant == "logits":  # the lm_head stays 16-bit
            continue
        nbytes = n * k * (1 if fp8 else 2)
        copies = rotation_copies(nbytes)
        ws = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(copies)]
        scales = [None] * copies
        if fp8:
            ws, scales = map(list, zip(*(quantize_weight_fp8(w) for w in ws)))
        for m in ms:
            mc = m_class(m, fp8)  # 1 and 2..16 (FP8 also 17-32, 33-64); larger batches: GEMM kernels
            if mc is None:
                continue
            x = torch.randn(m, k, device=dev, dtype=dt)
            kw = gemm_call_kwargs(variant, m, k, dt, dev)
            saved = ops.SKINNY_MAX_M
            ops.SKINNY_MAX_M = saved if fp8 else 0  # 16-bit: the unfused path, norm + cuBLAS + act
            try:
                with overridden(skinny_table=without_fp8_entries(served)):
                    base = graph_time_us(
                        [lambda w=w, s=s: ops.linear(x, w, weight_scale=s, **kw) for w, s in zip(ws, scales)]
                    )
            finally:
                ops.SKINNY_MAX_M = saved
            row = {
                "shape": name,
                "n": n,
                "k": k,
                "m": m,
                "variant": variant,
                "weight_bytes": nbytes,
                "baseline_us": base,
                "baseline_tb_s": nbytes / base / 1e6,
                "configs": [],
            }
            for values in candidates[mc]:
                cfg = dict(zip(CONFIG_FIELDS, values))
                fns = [
                    lambda w=w, s=s, cfg=cfg: skinny_linear_triton(x, w, weight_scale=s, config=cfg, **kw)
                    for w, s in zip(ws, scales)
                ]
                row["configs"].append(_timed(cfg, fns, nbytes))
            row["best"] = _fastest(row["configs"])
            best = row["best"]
            row["speedup"] = base / best["us"] if best else None
            if fp8 and mc > 16 and variant != "plain":  # also norm kernel + plain weight-only + act
                row["unfused_configs"] = []
                for values in candidates[mc]:
                    cfg = dict(zip(CONFIG_FIELDS, values))
                    fns = [lambda w=w, s=s, cfg=cfg: _unfused(x, w, s, cfg, kw) for w, s in zip(ws, scales)]
                    row["unfused_configs"].append(_timed(cfg, fns, nbytes))
                row["best_unfused"] = _fastest(row["unfused_configs"])
            rows.append(row)
            print(
                f"gemm {name:12s}{' fp8' if fp8 else ''} M={m:3d}: "
                f"baseline {base:8.2f} us ({row['baseline_tb_s']:.2f} TB/s)"
                + (
                    f", best {best['us']:8.2f} us ({best['tb_s']:.2f} TB/s) "
                    f"dot={best['use_dot']} bn={best['block_n']} bk={best['block_k']} "
                    f"w={best['num_warps']} s={best['num_stages']} pf={best['prefetch']} "
                    f"-> {row['speedup']:.2f}x"
                    if best
                    else ", no config ran"
                ),
                flush=True,
            )
        del ws
        torch.cuda.empty_cache()
    return rows


def without_fp8_entries(table: dict[str, dict | None]) -> dict[str, dict | None]:
    """The table an FP8 tune measures its baseline with: FP8 shapes on their 16-bit entries, so
    a re-tune that finds the same tiles again keeps them (against a baseline that already ran
    them, noise alone would drop them)."""
    return {key: cfg for key, cfg in table.items() if not key.endswith("|fp8")}


def _timed(cfg: dict, fns, nbytes: int) -> dict:
    try:
        us = graph_time_us(fns)
    except Exception as e:  # a config that does not compile (resources)
        return {**cfg, "error": repr(e)[:200]}
    return {**cfg, "us": us, "tb_s": nbytes / us / 1e6}


def _fastest(configs: list[dict]) -> dict | None:
    ok = [c for c in configs if "us" in c]
    return min(ok, key=lambda c: c["us"]) if ok else None


def _unfused(x, w, s, cfg: dict, kw: dict):
    """What ``kernels.ops.fp8_route``'s "unfused" runs: norm kernel, weight-only plain GEMM, act."""
    from kernels import ops
    from kernels.skinny_gemm import skinny_linear_triton

    if kw.get("norm_weight") is not None:
        x, _ = ops.rms_norm(x, kw["norm_weight"], 1e-6, kw.get("residual"))
    y = skinny_linear_triton(x, w, weight_scale=s, config=cfg)[0]
    return ops._activate(y, kw.get("act"), kw.get("out_dtype"))


def tuned_entries(rows: list[dict], fp8: bool = False) -> dict[str, dict | None]:
    """A tuning table's entries from ``bench_gemm`` rows. 16-bit: the fastest candidate where
    it beats the unfused baseline, else null (the unfused path). ``fp8``: ``|fp8`` entries for
    the shapes where the fastest candidate beats what serving runs without FP8 entries; none elsewhere (the
    16-bit entry goes on applying). At 17-64 rows a fused-norm shape whose unfused composition
    won instead gets a null entry for its kind and the plain GEMM's tiles (``kernels.ops.fp8_route``)."""
    from kernels.skinny_gemm import m_class, tuning_key

    entries = {}
    for r in rows:
        mc = m_class(r["m"], fp8)
        best, unfused, base = r["best"], r.get("best_unfused"), r["baseline_us"]
        use = best is not None and best["us"] < base
        use_unfused = unfused is not None and unfused["us"] < base and not (use and best["us"] <= unfused["us"])
        key = tuning_key(KIND[r["variant"]], mc, r["n"], r["k"], fp8=fp8)
        if use_unfused:
            entries[key] = None
            entries[tuning_key("plain", mc, r["n"], r["k"], fp8=True)] = {f: unfused[f] for f in CONFIG_FIELDS}
        elif use or not fp8:
            entries[key] = {f: best[f] for f in CONFIG_FIELDS} if use else None
    return entries


def measured_keys(rows: list[dict], fp8: bool = False) -> set[str]:
    """The keys a tune's rows decide (an FP8 re-tune drops the old ones no candidate won again)."""
    from kernels.skinny_gemm import m_class, tuning_key

    keys = set()
    for r in rows:
        mc = m_class(r["m"], fp8)
        keys.add(tuning_key(KIND[r["variant"]], mc, r["n"], r["k"], fp8=fp8))
        if "unfused_configs" in r:
            keys.add(tuning_key("plain", mc, r["n"], r["k"], fp8=fp8))
    return keys


def merged_entries(
    old: dict[str, dict | None], new: dict[str, dict | None], fp8: bool, measured: set[str] = frozenset()
) -> dict[str, dict | None]:
    """A re-tune's table: the new entries over the old file's; an FP8 tune keeps the 16-bit
    entries and drops the old ``|fp8`` entries of keys it ``measured`` (where nothing won this
    time, the 16-bit entry or the quantized path applies again); a 16-bit tune keeps the
    ``|fp8`` entries and replaces the rest."""
    keep = {key: cfg for key, cfg in old.items() if (fp8 or key.endswith("|fp8")) and key not in measured}
    return {**keep, **new}


def tune(path: str, fp8: bool = False, shapes: list[str] | None = None) -> dict:
    """Measure M=1 and M=8 (FP8: also 32 and 64) on the model shapes; write the per-shape choices that
    ``kernels.skinny_gemm.select_config`` reads into ``path``, keeping the file's entries of
    the other weight type (16-bit: None = the unfused path won; ``fp8``: ``|fp8`` entries, added
    to the packaged table's when ``path`` does not exist yet)."""
    import datetime
    import os
    import sys

    import triton

    from kernels.skinny_gemm import TUNING_FILE

    rows = bench_gemm([1, 8, 32, 64] if fp8 else [1, 8], fp8=fp8, shapes=shapes)
    old = {}
    # an FP8 tune adds to the file's table, or to the packaged one's (a table without the 16-bit
    # entries would change the 16-bit and the untuned FP8 shapes' tiles when installed)
    source = path if os.path.exists(path) else (str(TUNING_FILE) if fp8 and TUNING_FILE.exists() else None)
    if source is not None:
        with open(source) as f:
            old = json.load(f)
    measured = measured_keys(rows, fp8) if fp8 else set()
    entries = merged_entries(old.get("entries", {}), tuned_entries(rows, fp8), fp8, measured)
    run = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
    }
    if fp8:  # the 16-bit tune's header stays; this run's goes beside it
        out = {**old, "entries": entries, "fp8": {**run, "measurements": rows}}
    else:
        out = {**run, "entries": entries, "measurements": rows, **({"fp8": old["fp8"]} if "fp8" in old else {})}
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(
        "tuned:",
        ", ".join(
            f"{r['shape']} M={r['m']}: {r['baseline_us']:.1f}->{r['best']['us']:.1f}us "
            f"{'skinny' if r['best']['us'] < r['baseline_us'] else ('as served' if fp8 else 'unfused')}"
            for r in rows
            if r["best"] is not None
        ),
        flush=True,
    )
    return out
