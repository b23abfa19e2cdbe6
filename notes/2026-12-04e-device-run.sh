#!/usr/bin/env bash
# Stop 20 device runs (H200). Usage: bash THIS [tests|engine|roofline|hostprof]...
# hostprof: the 0.6B decode cells (HOST_BATCHES, default 1,8; ctx 512, 100 steps) under
# cProfile: $OUT/host.prof (pstats) and the top functions in $OUT/host-top.txt.
# roofline: for each shape in SHAPES, batches BATCHES_<shape> at contexts CTX (512), profiled
# at PROFILE (batch,ctx pairs, default: every batch at the first ctx), once per mode in
# MODES. A mode is '-'-joined words:
#   pdl    SYNCLESS_PDL=1
#   rope0  SYNCLESS_ROPE_IN_ATTENTION=0
#   def    nothing (the defaults); runN: the same, a repeat
set -uo pipefail
export PYTHONUNBUFFERED=1 SYNCLESS_COMMIT=${SYNCLESS_COMMIT:-unknown}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for what in "$@"; do
  case $what in
    tests) timeout ${TESTS_TIMEOUT:-300} python -m pytest -q -m gpu ${GPU_FILES:-tests/test_kernels_gpu_decode.py} \
             -k "${GPU_K:-warm}" 2>&1 | tee -a "$OUT/gpu-tests.log" | tail -3;;
    engine) timeout ${ENGINE_TIMEOUT:-300} python -m pytest -q -m gpu ${ENGINE_TESTS:-tests/test_gpu_engine.py} \
             2>&1 | tee -a "$OUT/engine-tests.log" | tail -3;;
    hostprof)
      python -m cProfile -o "$OUT/host.prof" -m benchmarks.decode_roofline --shape qwen3-0.6b \
        --batch-sizes ${HOST_BATCHES:-1,8} --context-lens 512 --warmup 3 --iters 100 \
        --placement local --output "$OUT/rl-hostprof.json" >> "$OUT/roofline.log" 2>&1
      python -c "import pstats; pstats.Stats('$OUT/host.prof').sort_stats('tottime').print_stats(45)" \
        > "$OUT/host-top.txt" 2>&1; head -70 "$OUT/host-top.txt" | tail -50
      ;;
    roofline)
      for mode in ${MODES:-def}; do
        envs=()
        for word in ${mode//-/ }; do
          case $word in
            pdl) envs+=("SYNCLESS_PDL=1");;
            rope0) envs+=("SYNCLESS_ROPE_IN_ATTENTION=0");;
            def|run[0-9]*) ;;
            *) echo "unknown mode word $word"; exit 2;;
          esac
        done
        for shape in ${SHAPES:-llama-3.1-8b qwen3-0.6b}; do
          bs=${BATCHES_8B:-1}; [ "$shape" = qwen3-0.6b ] && bs=${BATCHES_06B:-1,8}
          ctxs=${CTX:-512}
          prof=""
          if [ -n "${PROFILE-x}" ]; then
            for p in ${PROFILE:-}; do prof="$prof --profile $p"; done
            [ -z "${PROFILE:-}" ] && for b in ${bs//,/ }; do prof="$prof --profile $b,${ctxs%%,*}"; done
          fi
          t0=$(date +%s)
          env "${envs[@]}" python -m benchmarks.decode_roofline \
            --shape "$shape" --batch-sizes "$bs" --context-lens "$ctxs" --warmup 3 --iters 10 \
            --placement local $prof --profile-steps 2 --output "$OUT/rl-$shape-$mode.json" \
            >> "$OUT/roofline.log" 2>&1 || tail -5 "$OUT/roofline.log"
          echo "$shape $mode: $(( $(date +%s) - t0 )) s"
        done
      done
      python -m benchmarks.roofline_table "$OUT"/rl-*.json
      ;;
  esac
done
