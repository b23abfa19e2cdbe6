#!/usr/bin/env bash
# Which Triton kernels compile during a run (after the engine is ready) on a cold cache.
# Usage: bash THIS  (OUT set by the device tool). Prints kernel name + constexprs by compile time.
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc_cold_$$
rm -rf "$TRITON_CACHE_DIR"
python -m benchmarks.throughput --shape qwen3-0.6b --input-len 512 --output-len 256 --num-prompts 256 \
  --max-model-len 1024 --async-scheduling ${EXTRA_ARGS:-} --output "$OUT/cold.json" > "$OUT/cold.log" 2>&1
grep -E "^engine ready|^Throughput|^Driver|achieved" "$OUT/cold.log"
echo "variants needed after start-up (workers.compile_watch):"
grep -o "mid-serving): .*" "$OUT/cold.log" | cut -c15-330 | sort | uniq -c
python - "$TRITON_CACHE_DIR" "$OUT/cold.json" <<'PY'
import json, os, sys, glob
root, res = sys.argv[1], sys.argv[2]
end = os.path.getmtime(res)
el = json.load(open(res))["elapsed_time"]
rows = []
for f in glob.glob(os.path.join(root, "*", "*.json")):
    if os.path.basename(f).startswith("__grp__"):
        continue
    try:
        meta = json.load(open(f))
    except Exception:
        continue
    rows.append((os.path.getmtime(f) - end, meta.get("name", os.path.basename(f)), meta.get("constants") or meta.get("constexprs") or "", meta.get("launch_pdl", "")))
rows.sort()
print(f"{len(rows)} kernels compiled; the timed run spans the last {el:.2f} s before t=0")
for t, name, consts, pdl in rows[-12:]:
    mark = "RUN " if t > -el - 0.5 else "    "
    print(f"{mark}{t:8.2f} s {name} {str(consts)[:150]}")
PY
