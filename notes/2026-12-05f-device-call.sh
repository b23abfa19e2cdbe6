#!/usr/bin/env bash
# Run in 2026-12-05g on an H100 (notes/2026-12-05g-results.md). SYNCLESS_TILE_FUSED_SUM and
# SYNCLESS_ATTN_PREFETCH were removed after it (measured slower / within noise), with
# tests/test_gpu_tile_gemm_fused.py: this script is kept as the record of what ran.
# 2026-12-05f device call (written for the next session; no device was lent after call 2b):
#   1. the eager warm-up GPU tests (enforce_eager: zero variants after start-up);
#   2. the decode attention GPU kernel tests (SYNCLESS_ATTN_PREFETCH on and off);
#   3. the fused tile split sum GPU tests (kernels vs two launches, eager and graph replays;
#      greedy == transformers with graphs in the 16-row class);
#   4. decode A/Bs (decode_roofline, ms / ratio): SYNCLESS_ATTN_PREFETCH (both shapes,
#      b8/32/128, ctx 512/4096); SYNCLESS_TILE_FUSED_SUM and the 0.6B gate_up m16 tile entry
#      (Qwen3-0.6B b8/16/32/128).
# About 500 s on an H100: run it alone in one call, from the repo root, after
# `source .devbundle/install.sh`, with OUT set. `... call.sh b` instead: the 2-16-row tile sweep
# with the split sums fused (split 1 now among the candidates), then the 0.6B b8/16 decode
# steps with that table against no tile path (about 120 s; on an H200 the issue-3 grid first,
# about 90 s more).
set -uo pipefail
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p "$O"
S=notes/2026-12-04h-device-run.sh
if [ "${1:-a}" = b ]; then
  case "$(nvidia-smi --query-gpu=name --format=csv,noheader)" in  # the issue's own card
    *H200*) GRID_TIMEOUT=150 OUT=$O bash $S grid;; esac
  SYNCLESS_TILE_FUSED_SUM=1 TILE_MS=16 TILE_SHAPES=06b_o,06b_down,06b_gate_up,06b_qkv TILE_B=8,16 \
    OUT=$O bash $S tile
  exit
fi
t0=$(date +%s)
timeout 220 python -m pytest -q -m gpu tests/test_gpu_tile_gemm_fused.py tests/test_gpu_tile_gemm.py \
  tests/test_gpu_engine.py -k "eager or fused or layer_ops" -rs > "$O/gpu-tests.log" 2>&1
echo "eager + fused GPU tests rc=$? $(( $(date +%s) - t0 )) s"; tail -3 "$O/gpu-tests.log"
timeout 90 python -m pytest -q -m gpu tests/test_kernels_gpu_decode.py -k "decode_attention" -rs \
  > "$O/attn-tests.log" 2>&1; echo "attention kernel tests rc=$?"; tail -2 "$O/attn-tests.log"
SHAPES=qwen3-0.6b AB_VARIANTS="def tfs1 gate gatefs" AB_B=8,16,32,128 OUT=$O timeout 150 bash $S attnab
mv "$O/ab-qwen3-0.6b-def.json" "$O/ab-qwen3-0.6b-def-tile.json"  # the next A/B has its own "def"
AB_VARIANTS="def apf1" AB_B=8,32,128 OUT=$O timeout 200 bash $S attnab
echo "== verdicts (faster/slower: the runs' [min, max] ranges apart; else noise)"
python -m benchmarks.roofline_table --base "$O/ab-qwen3-0.6b-def-tile.json" \
  "$O"/ab-qwen3-0.6b-{tfs1,gate,gatefs}.json
for shape in llama-3.1-8b qwen3-0.6b; do
  python -m benchmarks.roofline_table --base "$O/ab-$shape-def.json" "$O/ab-$shape-apf1.json"
done
