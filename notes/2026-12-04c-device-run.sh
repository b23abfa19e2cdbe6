#!/usr/bin/env bash
# Stop 18 device runs (H200). Usage: bash THIS [tests|roofline|engine]...
# roofline: Qwen3-0.6B b1/8/32/128 ctx 512 and Llama-3.1-8B b1 ctx 512, profiled, with the
# rope prologue inside decode attention (SYNCLESS_ROPE_IN_ATTENTION=1, the default) and
# without (=0); MODES picks "rope1 rope0" (PDL off) and/or "rope1-pdl".
set -uo pipefail
export PYTHONUNBUFFERED=1 SYNCLESS_COMMIT=${SYNCLESS_COMMIT:-unknown}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for what in "$@"; do
  case $what in
    tests) timeout 300 python -m pytest -q -m gpu tests/test_kernels_gpu_decode.py tests/test_kernels_gpu.py \
             -k "${GPU_K:-rope or attention}" 2>&1 | tee "$OUT/gpu-tests.log" | tail -3;;
    engine) timeout ${ENGINE_TIMEOUT:-300} python -m pytest -q -m gpu ${ENGINE_TESTS:-tests/test_gpu_engine.py} \
             2>&1 | tee "$OUT/engine-tests.log" | tail -3;;
    roofline)
      for mode in ${MODES:-rope1 rope0}; do
        r=${mode:4:1}; pdl=0; [ "${mode#*-}" = pdl ] && pdl=1
        for shape in ${SHAPES:-qwen3-0.6b llama-3.1-8b}; do
          bs=1; [ "$shape" = qwen3-0.6b ] && bs=${BATCHES_06B:-1,8,32,128}
          prof=""; for b in ${bs//,/ }; do prof="$prof --profile $b,512"; done
          SYNCLESS_ROPE_IN_ATTENTION=$r SYNCLESS_PDL=$pdl python -m benchmarks.decode_roofline \
            --shape "$shape" --batch-sizes "$bs" --context-lens 512 --warmup 3 --iters 10 \
            --placement local $prof --profile-steps 2 --output "$OUT/rl-$shape-$mode.json" \
            > "$OUT/rl-$shape-$mode.log" 2>&1 || tail -5 "$OUT/rl-$shape-$mode.log"
        done
      done
      python -m benchmarks.roofline_table "$OUT"/rl-*.json
      ;;
  esac
done
