import json, sys, time
import ray
import numpy as np
from benchmarks.shapes import resolve_model
from cluster import LLM, SamplingParams
ray.init(include_dashboard=False)
out, temp = sys.argv[1], float(sys.argv[2])
model, fmt = resolve_model(None, "qwen3-0.6b")
llm = LLM(model=model, load_format=fmt, async_scheduling=True, max_model_len=1024, measure_device_timeline=True)
eng = llm.engine
toks = []
orig = eng.executor.submit
def sub(plan):
    toks.append((sum(r.num_scheduled_tokens for r in plan.rows), len(plan.rows)))
    return orig(plan)
eng.executor.submit = sub
rng = np.random.default_rng(0)
prompts = [{"prompt_token_ids": rng.integers(0, 150000, 512).tolist()} for _ in range(256)]
sp = [SamplingParams(temperature=temp, ignore_eos=True, max_tokens=256, seed=i) for i in range(256)]
llm.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
toks.clear(); eng.timeline.clear()
t = time.perf_counter(); llm.generate(prompts, sp, use_tqdm=False); el = time.perf_counter() - t
rows = [{"tokens": a, "rows": b, "device_ms": 1e3 * d, "idle_ms": 1e3 * i}
        for (a, b), (_, d, i) in zip([x for x in toks if x[1]], eng.timeline)]
dec = [r for r in rows if r["tokens"] == r["rows"]]
pre = [r for r in rows if r["tokens"] != r["rows"]]
summ = {"temp": temp, "elapsed": el, "steps": len(rows), "decode_steps": len(dec),
        "decode_ms_sum": sum(r["device_ms"] for r in dec),
        "decode_ms_median": float(np.median([r["device_ms"] for r in dec])) if dec else None,
        "mixed_steps": len(pre), "mixed_ms_sum": sum(r["device_ms"] for r in pre),
        "mixed_ms_each": [round(r["device_ms"], 1) for r in pre],
        "idle_ms_sum": sum(max(0, r["idle_ms"]) for r in rows), "stats": eng.stats}
print(json.dumps(summ))
json.dump({"summary": summ, "steps": rows}, open(out, "w"), indent=0)
llm.shutdown()
