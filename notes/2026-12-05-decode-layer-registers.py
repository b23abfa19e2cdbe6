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

from test_kernels_compile import LAYER_SHAPES, _resource_usage, compile_decode_layer  # noqa: E402

CONFIGS = [{}, dict(num_warps=4), dict(tile=16384), dict(tile=16384, num_warps=16),
           dict(att_dot=0), dict(att_dot=0, att_rows=32), dict(att_keys=32), dict(att_keys=128)]


def compile_layer(shape: str, batched: bool, cfg: dict) -> tuple[int, int]:
    return _resource_usage(compile_decode_layer(shape, batched, cfg).asm["cubin"])


def main() -> None:
    print(f"triton {triton.__version__}, sm_90; cells: registers a thread, spill bytes")
    print(f"{'config':34} " + " ".join(f"{s + (' b8' if b else ' b1'):>16}"
                                      for b in (False, True) for s in LAYER_SHAPES))
    for cfg in CONFIGS:
        cells = []
        for batched in (False, True):
            for shape in LAYER_SHAPES:
                regs, spill = compile_layer(shape, batched, cfg)
                cells.append(f"{regs:>10},{spill:<5}")
        name = ",".join(f"{k}={v}" for k, v in cfg.items()) or "default"
        print(f"{name:34} " + " ".join(f"{c:>16}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
