#!/usr/bin/env bash
# 2026-12-05f device call A: eager warm-up GPU tests, the decode attention GPU tests (early
# prefetch on/off), the 0.6B gate_up m16 tile A/B, and the SYNCLESS_ATTN_PREFETCH decode A/B
# (both shapes, b8/32/128, ctx 512/4096), and the fused tile split sum (test + 0.6B b8/16 A/B).
# About 480 s on an H100: run it alone in one call.
# Run from the repo root on the device after `source .devbundle/install.sh`.
set -uo pipefail
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p "$O"
t0=$(date +%s)
timeout 280 python -m pytest -q -m gpu tests/test_gpu_tile_gemm.py tests/test_gpu_engine.py \
  -k "eager" -rs > "$O/eager-tests.log" 2>&1; echo "eager tests rc=$? $(( $(date +%s) - t0 )) s"
tail -3 "$O/eager-tests.log"
timeout 120 python -m pytest -q -m gpu tests/test_kernels_gpu_decode.py -k "decode_attention" -rs \
  > "$O/attn-tests.log" 2>&1; echo "attention kernel tests rc=$?"; tail -2 "$O/attn-tests.log"
for t in shipped gate; do
  tab=kernels/tile_gemm_tuning.json; [ $t = gate ] && tab=notes/2026-12-05f-tile-gate-up-m16.json
  SYNCLESS_TILE_GEMM_TUNING=$tab timeout 120 python -m benchmarks.decode_roofline --shape qwen3-0.6b \
    --batch-sizes 8,16 --context-lens 512,4096 --warmup 3 --iters 10 --placement local \
    --output "$O/ab-$t.json" > "$O/ab-$t.log" 2>&1 || tail -5 "$O/ab-$t.log"
done
for t in shipped gate; do python -c "import json; d=json.load(open('$O/ab-$t.json'))
print('$t', 'TB/s', round(d['bandwidth']['bandwidth_bytes_per_s']/1e12,3))
for c in d['cells']: print('  $t', c['batch_size'], c['context_len'], round(c.get('step_ms_median', 0), 3), round(c.get('ratio', 0), 3))"; done
AB_VARIANTS="def apf1" AB_B=8,32,128 OUT=$O timeout 240 bash notes/2026-12-04h-device-run.sh attnab
# the fused tile split sum (Qwen3-0.6B o_proj and down at b2-256), its GPU greedy test first
timeout 120 python -m pytest -q -m gpu tests/test_gpu_tile_gemm.py -k "fused or layer_ops" -rs \
  > "$O/fused-tests.log" 2>&1; echo "fused tile tests rc=$?"; tail -2 "$O/fused-tests.log"
SHAPES=qwen3-0.6b AB_VARIANTS="def tfs1" AB_B=8,16,32,128 OUT=$O timeout 150 bash notes/2026-12-04h-device-run.sh attnab
