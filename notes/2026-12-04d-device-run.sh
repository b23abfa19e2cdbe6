#!/usr/bin/env bash
# Stop 19 device runs (H200). Usage: bash THIS [tests|roofline|engine]...
# roofline: Llama-3.1-8B (BATCHES_8B, default 1) and Qwen3-0.6B (BATCHES_06B) at ctx CTX (512),
# profiled, once per mode:
#   off       PDL off (the default)
#   pdl       SYNCLESS_PDL=1
#   pdl-preN SYNCLESS_PDL=1 with a tuning table whose skinny entries say "preload": N
#             (0: no K chunk loaded before the PDL wait; the default is 1)
set -uo pipefail
export PYTHONUNBUFFERED=1 SYNCLESS_COMMIT=${SYNCLESS_COMMIT:-unknown}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for what in "$@"; do
  case $what in
    tests) timeout ${TESTS_TIMEOUT:-300} python -m pytest -q -m gpu ${GPU_FILES:-tests/test_kernels_gpu_decode.py tests/test_kernels_gpu.py tests/test_pdl_gpu.py} \
             -k "${GPU_K:-rope or attention or pdl}" 2>&1 | tee "$OUT/gpu-tests.log" | tail -3;;
    engine) timeout ${ENGINE_TIMEOUT:-300} python -m pytest -q -m gpu ${ENGINE_TESTS:-tests/test_gpu_engine.py} \
             2>&1 | tee "$OUT/engine-tests.log" | tail -3;;
    roofline)
      python - <<'PY'
import json
for n in (0, 1, 2):
    d = json.load(open("kernels/skinny_tuning.json"))
    d["entries"] = {k: (dict(v, preload=n) if v else v) for k, v in d["entries"].items()}
    json.dump(d, open(f"/tmp/tuning-pre{n}.json", "w"))
PY
      for mode in ${MODES:-off pdl}; do
        pdl=0; tune=""; [ "${mode:0:3}" = pdl ] && pdl=1
        [ "${mode:0:7}" = pdl-pre ] && tune=/tmp/tuning-pre${mode:7:1}.json
        for shape in ${SHAPES:-llama-3.1-8b qwen3-0.6b}; do
          bs=${BATCHES_8B:-1}; [ "$shape" = qwen3-0.6b ] && bs=${BATCHES_06B:-1,8}
          prof=""; for b in ${bs//,/ }; do prof="$prof --profile $b,${CTX:-512}"; done
          SYNCLESS_SKINNY_TUNING=$tune SYNCLESS_PDL=$pdl SYNCLESS_PDL_MAX_TOKENS=${PDL_MAX_TOKENS:-} \
            python -m benchmarks.decode_roofline \
            --shape "$shape" --batch-sizes "$bs" --context-lens ${CTX:-512} --warmup 3 --iters 10 \
            --placement local $prof --profile-steps 2 --output "$OUT/rl-$shape-$mode.json" \
            >> "$OUT/roofline.log" 2>&1 || tail -5 "$OUT/roofline.log"
        done
      done
      python -m benchmarks.roofline_table "$OUT"/rl-*.json
      ;;
  esac
done
