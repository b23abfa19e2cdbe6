#!/usr/bin/env bash
# Reproduce docs/performance.md on one GPU machine: every table's command, in one call.
# Usage: bash benchmarks/reproduce.sh [OUT_DIR]   (JSON results land in OUT_DIR, default results/)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-results}
mkdir -p "$out"
run() { echo "+ $*" >&2; "$@"; }
for shape in llama-3.1-8b qwen3-0.6b; do
  run python -m benchmarks.decode_roofline --shape "$shape" --batch-sizes 1,8,32,128,256 \
      --context-lens 512,4096 --warmup 3 --iters 10 --placement local --output "$out/grid-$shape.json"
done
run python -m benchmarks.roofline_table "$out"/grid-*.json
run python -m benchmarks.throughput --shape qwen3-0.6b --input-len 512 --output-len 256 \
    --num-prompts 256 --max-model-len 1024 --async-scheduling --baseline hf --output "$out/throughput.json"
run python -m benchmarks.async_idle --shape qwen3-0.6b --batch-sizes 1,64 --output "$out/async_idle.json"
run python -m benchmarks.prefix_cache --shape llama-3.1-8b --num-prompts 200 --prefix-len 2000 \
    --suffix-len 32 --output-len 64 --max-model-len 4096 --output "$out/prefix_cache.json"
run python -m benchmarks.spec_decode --shape llama-3.1-8b --self-draft --batch-sizes 1,8,32 --k 3 \
    --output "$out/spec_decode.json"
run python -m benchmarks.serve --launch-server --shape qwen3-0.6b --async-scheduling \
    --request-rates 4,16,64,inf --num-prompts 500 --input-len 512 --output-len 128 --output "$out/serve-rates.json"
run python -m benchmarks.launch_wait --shape qwen3-0.6b --wait-ms 100 --output "$out/launch_wait.json"
# FP8 (issue 40): the 8B decode grid with FP8 weights (roofline: the FP8 weight bytes), the
# 1000 x 1000 offline workload in bf16 and FP8 (weights + KV cache), the accuracy tables
run python -m benchmarks.decode_roofline --shape llama-3.1-8b --batch-sizes 1,8,32,128,256 \
    --context-lens 512,4096 --warmup 3 --iters 10 --placement local --engine-option quantization=fp8 \
    --output "$out/grid-llama-3.1-8b-fp8.json"
for q in bf16 fp8; do
  extra=(); [ "$q" = fp8 ] && extra=(--quantization fp8 --kv-cache-dtype fp8)
  run python -m benchmarks.throughput --shape llama-3.1-8b --input-len 1000 --output-len 1000 \
      --num-prompts 1000 --max-model-len 2048 --async-scheduling "${extra[@]}" --output "$out/throughput-8b-$q.json"
done
run python -m benchmarks.fp8_accuracy --dtype bfloat16 --output "$out/fp8_accuracy.json"
run python -m benchmarks.fp8_accuracy --shape llama-3.1-8b --dtype bfloat16 --output "$out/fp8_accuracy-8b.json"
