"""Registers and spill bytes of the one-launch decoder layer compiled for sm_90 (no GPU needed),
for the Triton installed where it runs: ``python notes/2026-12-05-decode-layer-registers.py``.

The H200 machine runs Triton 3.6, CI 3.9. To see 3.6 here:
``python3 -m venv --system-site-packages /tmp/v36 && /tmp/v36/bin/pip install --no-deps
triton==3.6.0 && /tmp/v36/bin/python notes/2026-12-05-decode-layer-registers.py``.
Rows: batch 1 or batched, each ``SYNCLESS_DECODE_LAYER_CONFIG`` of ``kernels.bench_decode_layer``
that changes the compiled code, as the engine launches it (barriers, PDL, L2 prefetches)."""

from __future__ import annotations

import os
import sys

sys.path[:0] = [os.path.join(os.path.dirname(__file__), ".."),
                os.path.join(os.path.dirname(__file__), "..", "tests")]

import triton  # noqa: E402

from kernels import decode_layer as dl  # noqa: E402
from test_kernels_compile import _compile, _resource_usage  # noqa: E402

SHAPES = {"qwen3-0.6b": (16, 8, 1024, 3072), "llama-3.1-8b": (32, 8, 4096, 14336)}
CONFIGS = [{}, dict(num_warps=4), dict(tile=16384), dict(tile=16384, num_warps=16),
           dict(att_dot=0), dict(att_dot=0, att_rows=32), dict(att_keys=32), dict(att_keys=128)]


def compile_layer(shape: str, batched: bool, cfg: dict) -> tuple[int, int]:
    hq, hk, h, inter = SHAPES[shape]
    cfg = dict(dl.DEFAULT_CONFIG, **cfg)
    group_p = triton.next_power_of_2(hq // hk)
    blocks = {}
    for name, k, rows in (("QKV", h, 1), ("O", hq * 128, 1), ("GU", h, 2), ("D", inter, 1)):
        bn, bk = dl._blocks(k, rows, cfg)
        if batched:  # 16-row tensor-core tiles
            bn, bk = dl.BATCH_BLOCK_N // rows, dl.BATCH_BLOCK_K
        blocks[f"BN_{name}"], blocks[f"BK_{name}"] = bn, bk
    big = shape.startswith("llama")  # 8B: weights stream with row blocks prefetched ahead
    dot = bool(cfg["att_dot"])
    const = dict(HQ=hq, HK=hk, HEAD_DIM=128, KV_BLOCK_SIZE=16, GROUP=hq // hk, GROUP_P=group_p,
                 SPLITS=16, SPLITS_P=16, ATT_DOT=dot, ATT_M=max(16, group_p) if dot else group_p,
                 ATT_BLOCK_N=cfg["att_keys"] if dot else
                 max(8, cfg["att_rows"] // (2 if batched else 1) // group_p),
                 Q_NORM=not big, K_NORM=not big, HAS_RES=True, GU_ROW_MUL=2, SS_P=256, **blocks,
                 **{f"RUN_{c}": True for c in "ABCDE"}, SYNC=True, PREFETCH=2 if big else 31,
                 PREFETCH_NEXT=True, ESZ=2, USE_PDL=True, KV_SPAN=256, LINE_ELEMS=64,
                 ROW_LINES=2, POLL_LOAD=True, SS_BLOCK=512 if batched else 4096,
                 **{f"AHEAD_{n}": cfg["ahead"] if big else 0 for n in ("QKV", "O", "GU", "D")},
                 BATCHED=batched, BLOCK_M=dl.MAX_BATCH, UPCAST=False, IEEE=False, PROFILE=False)
    ptrs = {n: "*i32" for n in ("bt_ptr", "seq_ptr", "bar_ptr", "err_ptr")}
    ptrs.update({n: "*fp32" for n in ("part_ptr", "lse_ptr", "ss_ptr", "cs_ptr")},
                pos_ptr="*i64", slot_ptr="*i64", prof_ptr="*i64")
    compiled = _compile(dl._decode_layer_kernel, const, ptrs,
                        floats=("eps", "qk_eps", "scale_log2"), aligned_ints=("H", "N_QKV", "INTER"),
                        options=dict(num_warps=cfg["num_warps"], num_stages=1))
    return _resource_usage(compiled.asm["cubin"])


def main() -> None:
    print(f"triton {triton.__version__}, sm_90; cells: registers a thread, spill bytes")
    print(f"{'config':34} " + " ".join(f"{s + (' b8' if b else ' b1'):>16}"
                                      for b in (False, True) for s in SHAPES))
    for cfg in CONFIGS:
        cells = []
        for batched in (False, True):
            for shape in SHAPES:
                regs, spill = compile_layer(shape, batched, cfg)
                cells.append(f"{regs:>10},{spill:<5}")
        name = ",".join(f"{k}={v}" for k, v in cfg.items()) or "default"
        print(f"{name:34} " + " ".join(f"{c:>16}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
