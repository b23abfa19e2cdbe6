#!/usr/bin/env bash
# Stop 22 device runs (issue 8, tensor parallelism; nvidia-h200-x2). Usage: bash THIS [tptests|tpdecode|tpprofile|tpthroughput]...
#   tptests       tests/test_gpu_tensor_parallel.py (NCCL TP=n vs TP=1 vs transformers)
#   tpdecode      decode_roofline, Llama-3.1-8B shape, at TP=1 and TP=2 (NCCL_DEBUG=INFO: the transport)
#   tpthroughput  offline throughput, Llama-3.1-8B shape, at TP=1 and TP=2, the same per-GPU batch
# Env: TP_SIZES (default "1 2"), DECODE_B1/DECODE_B2 (batches per TP size), DECODE_CTX (512,4096),
#   SHAPE (llama-3.1-8b), and for tpthroughput PROMPTS (256 per TP rank), IN_LEN (512), OUT_LEN (256),
#   SEQS (256 per rank), TOKENS (8192 per rank), MAX_LEN (1024). A CPU dry run of the script:
#   SHAPE=tiny DECODE_B1=1 DECODE_B2=2 DECODE_CTX=16 PROMPTS=2 IN_LEN=8 OUT_LEN=4 SEQS=2 TOKENS=64 MAX_LEN=64 \
#     OUT=/tmp/dry bash THIS tpdecode tpthroughput
set -uo pipefail
export PYTHONUNBUFFERED=1 SYNCLESS_COMMIT=${SYNCLESS_COMMIT:-unknown}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1 || true
for what in "$@"; do
  t0=$(date +%s)
  case $what in
    tptests) timeout ${TESTS_TIMEOUT:-400} python -m pytest -q -m gpu tests/test_gpu_tensor_parallel.py -rs \
               2>&1 | tee -a "$OUT/tp-tests.log" | tail -6;;
    tpdecode)
      for tp in ${TP_SIZES:-1 2}; do
        var=DECODE_B$tp; bs=${!var:-1,8,32,128,256}
        NCCL_DEBUG=INFO timeout ${DECODE_TIMEOUT:-240} python -m benchmarks.decode_roofline --shape ${SHAPE:-llama-3.1-8b} \
          --batch-sizes "$bs" --context-lens "${DECODE_CTX:-512,4096}" --warmup 3 --iters 15 \
          --tensor-parallel-size $tp --output "$OUT/decode-tp$tp.json" >> "$OUT/decode.log" 2>&1 \
          || tail -20 "$OUT/decode.log"
      done
      if [ -n "${SYMM_AB:-}" ]; then  # the same TP=2 cells with the symmetric-memory all-reduce
        SYNCLESS_TP_ALLREDUCE=symm timeout ${DECODE_TIMEOUT:-240} python -m benchmarks.decode_roofline \
          --shape ${SHAPE:-llama-3.1-8b} --batch-sizes "${DECODE_B2:-1,8,32,128,256}" --context-lens "${DECODE_CTX:-512,4096}" \
          --warmup 3 --iters 15 --tensor-parallel-size 2 --output "$OUT/symm-decode-tp2.json" \
          >> "$OUT/decode.log" 2>&1 || tail -20 "$OUT/decode.log"
      fi
      grep -E "NCCL INFO (Channel|Connected|NCCL version|comm .* nRanks)" "$OUT/decode.log" | sort | uniq -c \
        | sort -rn | head -12
      ;;
    tpprofile)  # one profiled cell per TP size: kernel time by name (NCCL's share)
      for tp in ${TP_SIZES:-1 2}; do
        timeout 150 python -m benchmarks.decode_roofline --shape ${SHAPE:-llama-3.1-8b} --batch-sizes ${PROF_B:-1} \
          --context-lens 512 --warmup 3 --iters 10 --profile ${PROF_B:-1},512 --profile-steps 3 \
          --tensor-parallel-size $tp --output "$OUT/profile-tp$tp.json" >> "$OUT/profile.log" 2>&1 \
          || tail -20 "$OUT/profile.log"
      done
      grep -E "profile:|^ +[0-9.]+ us" "$OUT/profile.log" | head -40
      ;;
    tpthroughput)
      for tp in ${TP_SIZES:-1 2}; do
        timeout ${TPUT_TIMEOUT:-240} python -m benchmarks.throughput --shape ${SHAPE:-llama-3.1-8b} --input-len ${IN_LEN:-512} \
          --output-len ${OUT_LEN:-256} --num-prompts $((${PROMPTS:-256} * tp)) --max-num-seqs $((${SEQS:-256} * tp)) \
          --max-num-batched-tokens $((${TOKENS:-8192} * tp)) --max-model-len ${MAX_LEN:-1024} --async-scheduling \
          --tensor-parallel-size $tp --output "$OUT/throughput-tp$tp.json" >> "$OUT/throughput.log" 2>&1 \
          || tail -20 "$OUT/throughput.log"
      done
      ;;
    *) echo "unknown target $what"; exit 2;;
  esac
  echo "$what: $(( $(date +%s) - t0 )) s"
done
shopt -s nullglob
results=("$OUT"/decode-tp*.json "$OUT"/throughput-tp*.json)
[ ${#results[@]} -gt 0 ] && python -m benchmarks.tp_scaling "${results[@]}"
if [ -f "$OUT/symm-decode-tp2.json" ] && [ -f "$OUT/decode-tp1.json" ]; then
  echo "with SYNCLESS_TP_ALLREDUCE=symm:"; python -m benchmarks.tp_scaling "$OUT/decode-tp1.json" "$OUT/symm-decode-tp2.json"
fi
