#!/usr/bin/env bash
# Stop 23 device runs (issue 3, one H200). Usage: bash THIS [tests|throughput|grid|probe]...
#   tests       GPU engine tests (greedy == transformers, sync check, no kernel variant after start-up)
#   gpuall      every tests/*gpu*.py file (not `-m gpu tests`: tests/test_serve_cli.py imports openai, which
#               the device lacks); well over 290 s on an H100 (2026-12-05g), so give it a call of its own
#   gpupar      the same files in GPU_WORKERS (4) pytest-xdist processes, one file a process (--dist loadfile):
#               Triton's compiles run in parallel (pytest-xdist is in the device image, 2026-12-05h)
#   throughput  the issue-3 workload (Qwen3-0.6B, 256 x 512 -> 256) with transformers' generate_batch
#               as the baseline in the same run (BASELINE=none skips it)
#   grid        decode_roofline, both shapes, b 1..256, ctx 512 and 4096 (phase floor beside the roofline)
#   attnab      decode_roofline b AB_B (1,8), ctx 512,4096, both shapes: decode attention releasing the
#               next kernel early (default) / late (SYNCLESS_ATTN_RELEASE=late) x pipelining stages
#               default / 1 (SYNCLESS_DECODE_ATTN_STAGES=1); rope0: rope + KV write in their own launch;
#               nohandoff: SYNCLESS_NORM_HANDOFF=0 (norms fused into the consumer GEMV's prologue);
#               ogemv: the 8B o_proj as the persistent GEMV (is the 8B attention's cost its neighbour's?)
#               pf8192/pf4096/pf2048: the 8B o_proj bulk-prefetches that many bytes of each weight row
#               into L2 before its PDL wait, i.e. while the attention runs (2026-12-05b)
#               pre0/pre1/pre2: one-tile attention splits prefetch their tile into L2 (0) or load
#               their keys (1) or keys and values (2) into registers before the PDL wait
#               (SYNCLESS_ATTN_PRELOAD; 2 is the default since 2026-12-05d, so "def" is pre2)
#               merge1/merge2: the fused split merge in one pass (SYNCLESS_ATTN_MERGE=1, the default since
#               2026-12-05e) or lse first (2)
#               pdlN: PDL (auto mode) in passes of up to N tokens, not only batch-1 (SYNCLESS_PDL_MAX_TOKENS=N)
#               apf1: PDL off (b > 1), the attention's first K/V tile into L2 before q (SYNCLESS_ATTN_PREFETCH=1)
#               tfs1: the tile GEMM's split sum (+ add + norm) inside its launch (SYNCLESS_TILE_FUSED_SUM=1)
#               gate / gatefs: the 0.6B gate_up m16 tile entry (notes/2026-12-05f-tile-gate-up-m16.json), / + tfs1
#   stamps      kernels.bench_attention_stamps: per-program timestamps of the one-token attention,
#               for each SYNCLESS_ATTN_PRELOAD in STAMP_PRELOAD (2) x SYNCLESS_ATTN_MERGE in STAMP_MERGE (1)
#   probe       notes/2026-12-04h-norm-probe.py: b PROBE_B (1,8) ctx 512, both shapes, unpatched / no norm
#               prologue / no attention (timing only)
#   compile     notes/2026-12-05-decode-layer-registers.py with the machine's own Triton (3.6 there, 3.9 in
#               CI): the one-launch layer's registers and spill bytes a config (CPU only, ~1 min)
#   kvlayout    notes/2026-12-05b-kv-layout-probe.py: decode attention on token-major vs head-major KV pages
#   prof        decode_roofline --profile of one cell (PROF_SHAPE, PROF_CELL): the top kernels a step, by
#               run time and by what each adds to the step's span (benchmarks/kernel_timeline.py)
#   layerbench  kernels.bench --only decode-layer: the one-launch layer vs the op-by-op layer, per config
#   layerab     decode_roofline b LAYER_B (1,8), ctx 512,4096, both shapes: SYNCLESS_DECODE_LAYER=0 / 1
#               (LAYER_CONFIG: a SYNCLESS_DECODE_LAYER_CONFIG for the "1" run)
#   tile        kernels.bench_tile_gemm (TILE_MS, default 32,64,128,256; TILE_SHAPES) writing $OUT/tile_gemm_tuning.json,
#               then the TILE_SHAPE (qwen3-0.6b) decode cells TILE_B (b32-b256) with that table against
#               SYNCLESS_TILE_GEMM=0 (2026-12-05c; the 16-row class: TILE_MS=16 TILE_B=8,16, 2026-12-05e)
# Env: SYNCLESS_COMMIT (the device checkout's HEAD is stale), BATCHES (1,8,32,128,256), CTX (512,4096),
#   SHAPES, TESTS (test files), EXTRA (extra env for the grid, e.g. "SYNCLESS_EPILOGUE_NORM=0").
set -uo pipefail
export PYTHONUNBUFFERED=1 SYNCLESS_COMMIT=${SYNCLESS_COMMIT:-unknown}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for what in "$@"; do
  t0=$(date +%s)
  case $what in
    tests) timeout ${TESTS_TIMEOUT:-300} python -m pytest -q -m gpu ${TESTS:-tests/test_gpu_engine.py} -rs \
             2>&1 | tee -a "$OUT/gpu-tests.log" | tail -8;;
    gpuall) timeout ${TESTS_TIMEOUT:-560} python -m pytest -q -m gpu tests/*gpu*.py -rs -p no:cacheprovider \
              > "$OUT/gpu-all.log" 2>&1; echo "gpuall rc=$?"; tail -8 "$OUT/gpu-all.log" | cut -c1-300;;
    gpupar) timeout ${TESTS_TIMEOUT:-560} python -m pytest -q -m gpu tests/*gpu*.py -rs -p no:cacheprovider \
              -n ${GPU_WORKERS:-4} --dist loadfile --durations=15 > "$OUT/gpu-par.log" 2>&1; echo "gpupar rc=$?"
            grep -E "passed|failed|error" "$OUT/gpu-par.log" | tail -4 | cut -c1-300;;
    tile)
      timeout ${TILE_TIMEOUT:-300} python -m kernels.bench_tile_gemm --ms "${TILE_MS:-32,64,128,256}" ${TILE_SHAPES:+--shapes $TILE_SHAPES} \
        --out "$OUT/tile-gemm.json" --tuning-out "$OUT/tile_gemm_tuning.json" > "$OUT/tile-gemm.log" 2>&1 \
        || tail -5 "$OUT/tile-gemm.log"
      grep "tile-gemm" "$OUT/tile-gemm.log" | cut -c1-150
      for t in 1 0; do
        SYNCLESS_TILE_GEMM=$t SYNCLESS_TILE_GEMM_TUNING="$OUT/tile_gemm_tuning.json" timeout 120 \
          python -m benchmarks.decode_roofline --shape "${TILE_SHAPE:-qwen3-0.6b}" --batch-sizes "${TILE_B:-32,128,256}" \
          --context-lens 512,4096 --warmup 3 --iters 10 --placement local --output "$OUT/roof-tile$t.json" \
          > "$OUT/roof-tile$t.log" 2>&1 || tail -5 "$OUT/roof-tile$t.log"
        python -c "import json; d=json.load(open('$OUT/roof-tile$t.json'))
for c in d['cells']: print('tile=$t', c['batch_size'], c['context_len'], round(c.get('step_ms_median', 0), 3), round(c.get('ratio', 0), 3))"
      done;;
    compile) timeout ${COMPILE_TIMEOUT:-200} python notes/2026-12-05-decode-layer-registers.py 2>&1 \
               | grep -v -i warn | tee -a "$OUT/registers.log";;
    throughput)
      base="--baseline hf"; [ "${BASELINE:-hf}" = none ] && base=""
      timeout ${TPUT_TIMEOUT:-330} python -m benchmarks.throughput --shape qwen3-0.6b --input-len 512 --output-len 256 \
        --num-prompts 256 --max-model-len 1024 --async-scheduling $base --output "$OUT/throughput.json" \
        > "$OUT/throughput.log" 2>&1 || tail -20 "$OUT/throughput.log"
      grep -E "^Throughput|achieved|baseline|speedup|roofline|mid-serving|syncless / transformers|warm_up" "$OUT/throughput.log" | cut -c1-200 | head -12;;
    grid)
      for shape in ${SHAPES:-llama-3.1-8b qwen3-0.6b}; do
        env ${EXTRA:-} timeout ${GRID_TIMEOUT:-250} python -m benchmarks.decode_roofline --shape "$shape" \
          --batch-sizes "${BATCHES:-1,8,32,128,256}" --context-lens "${CTX:-512,4096}" --warmup 3 --iters 10 \
          --placement local --output "$OUT/grid-$shape${TAG:-}.json" >> "$OUT/grid.log" 2>&1 || tail -8 "$OUT/grid.log"
      done
      python - "$OUT" "${TAG:-}" <<'PY'
import json, sys, glob
out, tag = sys.argv[1], sys.argv[2]
for f in sorted(glob.glob(f"{out}/grid-*{tag}.json")):
    d = json.load(open(f))
    print(f.split("/")[-1], "copy TB/s", round(d["bandwidth"]["bandwidth_bytes_per_s"] / 1e12, 3))
    for c in d["cells"]:
        if "skipped" in c:
            print(f"  b{c['batch_size']:>4} ctx{c['context_len']:>5}  skipped"); continue
        print(f"  b{c['batch_size']:>4} ctx{c['context_len']:>5}  {c['step_ms_median']:7.3f} ms  ratio {c['ratio']:.3f}"
              f"  floor_ratio {c.get('floor_ratio', float('nan')):.3f}")
PY
      ;;
    attnab)
      for shape in ${SHAPES:-llama-3.1-8b qwen3-0.6b}; do
        for v in ${AB_VARIANTS:-def late st1 late-st1 rope0}; do
          envs="SYNCLESS_ATTN_RELEASE=early"
          case $v in late) envs="SYNCLESS_ATTN_RELEASE=late";; st1) envs="SYNCLESS_DECODE_ATTN_STAGES=1";;
            late-st1) envs="SYNCLESS_ATTN_RELEASE=late SYNCLESS_DECODE_ATTN_STAGES=1";;
            rope0) envs="SYNCLESS_ROPE_IN_ATTENTION=0";; nohandoff) envs="SYNCLESS_NORM_HANDOFF=0";;
            pre0|pre1|pre2) envs="SYNCLESS_ATTN_PRELOAD=${v#pre}";;
            merge1|merge2) envs="SYNCLESS_ATTN_MERGE=${v#merge}";;
            pdl*) envs="SYNCLESS_PDL_MAX_TOKENS=${v#pdl}";;
            apf1) envs="SYNCLESS_ATTN_PREFETCH=1";;
            tfs1) envs="SYNCLESS_TILE_FUSED_SUM=1";;
            gate) envs="SYNCLESS_TILE_GEMM_TUNING=notes/2026-12-05f-tile-gate-up-m16.json";;
            gatefs) envs="SYNCLESS_TILE_GEMM_TUNING=notes/2026-12-05f-tile-gate-up-m16.json SYNCLESS_TILE_FUSED_SUM=1";;
            ogemv) envs="SYNCLESS_SKINNY_TUNING=notes/2026-12-04h-tuning-8b-oproj-gemv.json";;
            pf*) envs="SYNCLESS_SKINNY_TUNING=$OUT/tuning-8b-oproj-$v.json"
                 python - "${v#pf}" "$OUT/tuning-8b-oproj-$v.json" <<'PY'
import json, sys  # the shipped table, the 8B o_proj entry prefetching N bytes of each row
t = json.load(open("kernels/skinny_tuning.json"))
t["entries"]["plain|m1|4096x4096"] = dict(t["entries"]["plain|m1|4096x4096"], prefetch_l2=int(sys.argv[1]))
json.dump(t, open(sys.argv[2], "w"), indent=1)
PY
                 ;; esac
          env $envs timeout 120 python -m benchmarks.decode_roofline --shape "$shape" --batch-sizes "${AB_B:-1,8}" \
            --context-lens "${AB_CTX:-512,4096}" --warmup 3 --iters 10 --placement local \
            --output "$OUT/ab-$shape-$v.json" >> "$OUT/ab.log" 2>&1 || tail -8 "$OUT/ab.log"
          python -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], sys.argv[3], ' '.join(f\"b{c['batch_size']}/{c['context_len']} {c['step_ms_median']:.3f}ms/{c['ratio']:.3f}\" for c in d['cells']))" \
            "$OUT/ab-$shape-$v.json" "$shape" "$v"
        done
      done;;
    layerbench)
      timeout ${LB_TIMEOUT:-400} python -m kernels.bench --only decode-layer --out "$OUT/decode-layer-bench.json" \
        > "$OUT/decode-layer-bench.log" 2>&1 || tail -20 "$OUT/decode-layer-bench.log"
      grep "^decode-layer" "$OUT/decode-layer-bench.log" | cut -c1-220;;
    layerab)
      for shape in ${SHAPES:-qwen3-0.6b llama-3.1-8b}; do
        for v in 0 1; do
          env SYNCLESS_DECODE_LAYER=$v SYNCLESS_DECODE_LAYER_CONFIG=${LAYER_CONFIG:-} timeout 150 \
            python -m benchmarks.decode_roofline --shape "$shape" --batch-sizes "${LAYER_B:-1,8}" \
            --context-lens 512,4096 --warmup 3 --iters 10 --placement local \
            --output "$OUT/layer-$shape-$v.json" >> "$OUT/layerab.log" 2>&1 || tail -8 "$OUT/layerab.log"
          python -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], 'layer', sys.argv[3], ' '.join(f\"b{c['batch_size']}/{c['context_len']} {c['step_ms_median']:.3f}ms/{c['ratio']:.3f}\" for c in d['cells']))" \
            "$OUT/layer-$shape-$v.json" "$shape" "$v"
        done
      done;;
    stamps) for n in ${STAMP_PRELOAD:-2}; do for m in ${STAMP_MERGE:-1}; do
              SYNCLESS_ATTN_PRELOAD=$n SYNCLESS_ATTN_MERGE=$m timeout ${STAMPS_TIMEOUT:-150} \
                python -m kernels.bench_attention_stamps --out "$OUT/attn-stamps-pre$n-merge$m.json" 2>&1 \
                | tee -a "$OUT/stamps-full.log" | grep "^stamps" | sed "s/^stamps/stamps pre$n merge$m/" | tee -a "$OUT/stamps.log"
            done; done;;
    kvlayout) timeout ${KV_TIMEOUT:-200} python notes/2026-12-05b-kv-layout-probe.py --out "$OUT/kv-layout.json" 2>&1 \
                | grep -v -i warn | tee -a "$OUT/kv-layout.log";;
    prof)  # PROF_SHAPE (qwen3-0.6b), PROF_CELL (128,512): one profiled cell, the top kernels a step
      c=${PROF_CELL:-128,512}; shape=${PROF_SHAPE:-qwen3-0.6b}; json="$OUT/prof-$shape-${c/,/-}${TAG:-}.json"
      env ${EXTRA:-} timeout 150 python -m benchmarks.decode_roofline --shape "$shape" \
        --batch-sizes "${c%,*}" --context-lens "${c#*,}" --warmup 3 --iters 10 --placement local \
        --profile "$c" --output "$json" >> "$OUT/prof.log" 2>&1 || tail -8 "$OUT/prof.log"
      python - "$json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))["cells"][0]
p = c["profile"]
print(f"b{c['batch_size']} ctx{c['context_len']} step {c['step_ms_median']:.3f} ms ratio {c['ratio']:.3f} "
      f"kernels {p['kernel_us_per_step']:.1f} us in {p['kernels_per_step']:.0f} launches")
for k in p["top"][:14]:
    print(f"  {k['us_per_step']:8.1f} us  x{k['calls_per_step']:5.1f}  {k['name'][:90]}")
if "exposed_top" in p:
    print(f"  span {p['span_us_per_step']:.1f} us a step, idle {p['idle_us_per_step']:.1f} us; added to the span:")
    for k in p["exposed_top"][:14]:
        print(f"  {k['exposed_us_per_step']:8.1f} us (runs {k['duration_us_per_step']:8.1f})  x{k['calls_per_step']:5.1f}  {k['name'][:70]}")
PY
      ;;
    probe)
      for shape in ${SHAPES:-llama-3.1-8b qwen3-0.6b}; do
        for pr in none nonorm noattn; do
          PROBE=${pr/none/} timeout 120 python notes/2026-12-04h-norm-probe.py --shape "$shape" \
            --batch-sizes "${PROBE_B:-1,8}" --context-lens 512 --warmup 3 --iters 10 --placement local \
            --output "$OUT/probe-$shape-$pr.json" >> "$OUT/probe.log" 2>&1 || tail -8 "$OUT/probe.log"
          python -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], sys.argv[3], ' '.join(f\"b{c['batch_size']} {c['step_ms_median']:.3f}ms/{c['ratio']:.3f}\" for c in d['cells']))" \
            "$OUT/probe-$shape-$pr.json" "$shape" "$pr"
        done
      done;;
    *) echo "unknown target $what"; exit 2;;
  esac
  echo "$what: $(( $(date +%s) - t0 )) s"
done
