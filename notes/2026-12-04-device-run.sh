#!/usr/bin/env bash
# Stop 16 device runs (H200): GPU tests of the new decode kernels, then decode-roofline cells
# with PDL off / PDL on + bulk L2 prefetch / PDL on without it. Usage: bash THIS [tests|roofline|all]
# TUNING / TUNING_PDL: a skinny tuning table (kernels.bench --only gemv --tuning-out) for the
# off / pdl modes. A mode with -nomlp appended runs SYNCLESS_FUSED_MLP=0.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export SYNCLESS_COMMIT=${SYNCLESS_COMMIT:-unknown}  # pass it: the device copy's git HEAD is stale
what=${1:-all}; shift || true
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ "$what" = tests ] || [ "$what" = all ]; then
  python -m pytest -q -m gpu ${GPU_TESTS:-tests/test_kernels_gpu_decode.py tests/test_pdl_gpu.py} 2>&1 \
    | tee "$OUT/gpu-tests.log" | tail -5
fi
roof() {  # label "VAR=value ..." decode_roofline-args...
  local label=$1 envs=$2; shift 2
  env $envs python -m benchmarks.decode_roofline --warmup 3 --iters 10 --placement local \
    "$@" --output "$OUT/rl-$label.json" > "$OUT/rl-$label.log" 2>&1 || tail -20 "$OUT/rl-$label.log"
}
if [ "$what" = roofline ] || [ "$what" = all ]; then
  for shape in ${SHAPES:-llama-3.1-8b qwen3-0.6b}; do
    bs=${BATCHES:-1,8}; ctx=${CTXS:-512}
    for mode in ${MODES:-off pdl pdl-l2-2048 pdl-l2-8192}; do
      base=${mode%-nomlp}; mlp=1; [ "$base" != "$mode" ] && mlp=0  # MODE-nomlp: 3-launch MLP
      case $base in
        off) e="SYNCLESS_PDL=0 ${TUNING:+SYNCLESS_SKINNY_TUNING=$TUNING}";;
        pdl) e="SYNCLESS_PDL=1 SYNCLESS_L2_PREFETCH=0 ${TUNING_PDL:+SYNCLESS_SKINNY_TUNING=$TUNING_PDL}";;
        pdl-l2-*) e="SYNCLESS_PDL=1 SYNCLESS_L2_PREFETCH=${mode#pdl-l2-}";;
      esac
      e="$e SYNCLESS_FUSED_MLP=$mlp"
      roof "$shape-$mode" "$e" --shape "$shape" --batch-sizes "$bs" --context-lens "$ctx" \
        --profile "1,${ctx%%,*}" --profile-steps 2
    done
  done
  python - "$OUT" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/rl-*.json")):
    d = json.load(open(f))
    for c in d["cells"]:
        if "ratio" not in c: continue
        top = c.get("profile", {}).get("top", [])[:6]
        print(f"{f.split('/')[-1][3:-5]:28s} b{c['batch_size']:<4d} ctx{c['context_len']:<5d} "
              f"{c['step_ms_median']:.3f} ms  ratio {c['ratio']:.3f}")
        for t in top: print(f"      {t['name'][:40]:40s} {t['us_per_step']:8.1f} us x{t['calls_per_step']:.0f}")
PY
fi
