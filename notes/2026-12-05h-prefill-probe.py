"""Where a throughput prefill step's device time goes (2026-12-05h probe, not a test).

The issue-3 throughput run spends ~25 ms of device time on each of its 16 prefill steps
(16 prompts x 512 tokens = 8,192 tokens) against ~9 ms of matmul FLOPs at the measured rate.
This runs one such forward (eager, as the engine runs prefill) of the Qwen3-0.6B shape
under torch.profiler and prints the top kernels by device time.

    python notes/2026-12-05h-prefill-probe.py [PROMPTS] [LEN]
"""

import sys

import torch

from benchmarks.shapes import shape_dir
from metadata.attention_metadata import AttentionMetadata
from metadata.config import EngineConfig
from workers import kv_cache
from workers.distributed import TPGroup
from workers.model_runner import ModelRunner

n_req = int(sys.argv[1]) if len(sys.argv) > 1 else 16
plen = int(sys.argv[2]) if len(sys.argv) > 2 else 512
model_dir = str(shape_dir("qwen3-0.6b"))
dev = torch.device("cuda", 0)
cfg = EngineConfig.from_options(model=model_dir, load_format="dummy", device="cuda", max_num_seqs=256,
                                max_model_len=1024, dtype="bfloat16", enforce_eager=True,
                                kv_cache_memory_bytes=4 << 30)
runner = ModelRunner(cfg, model_dir, dev, TPGroup(), 1024)
bs = runner.block_size
per = -(-plen // bs)
kv = kv_cache.allocate(runner.arch.num_layers, n_req * per, bs, runner.num_kv_heads, runner.arch.head_dim,
                       runner.dtype, dev)
n = n_req * plen
qsl = torch.arange(0, n + 1, plen, dtype=torch.int32)
table = torch.arange(n_req * per, dtype=torch.int32).view(n_req, per)
pos = torch.arange(plen).repeat(n_req)
slots = (table[:, :, None] * bs + torch.arange(bs)).view(n_req, -1)[:, :plen].reshape(-1)
meta = AttentionMetadata(
    query_start_loc=qsl.to(dev), query_start_loc_cpu=qsl, seq_lens=torch.full((n_req,), plen, dtype=torch.int32,
                                                                                 device=dev),
    seq_lens_upper_bound=torch.full((n_req,), plen, dtype=torch.int32), block_table=table.to(dev),
    slot_mapping=slots.to(dev), positions=pos.to(dev), num_reqs=n_req, num_actual_tokens=n, max_query_len=plen,
    max_seq_len_upper_bound=plen, bounds_are_exact=True, eager=True)
ids = torch.randint(3, runner.arch.vocab_size, (n,), device=dev)
last = (qsl[1:] - 1).to(dev)


def step():
    h = runner.model(ids, pos.to(dev), meta, kv)
    return runner.model.compute_logits(h[last])


with torch.inference_mode():
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        step()
    end.record()
    end.synchronize()
    print(f"{n_req} x {plen} tokens: {start.elapsed_time(end) / 5:.2f} ms a forward (eager)")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
rows = {}
for e in prof.events():
    if e.device_type == torch.autograd.DeviceType.CUDA:
        r = rows.setdefault(e.name, [0.0, 0])
        r[0] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        r[1] += 1
total = sum(v[0] for v in rows.values()) / 3
print(f"kernels: {total / 1e3:.2f} ms a forward")
for name, (us, calls) in sorted(rows.items(), key=lambda kv_: -kv_[1][0])[:16]:
    print(f"  {us / 3 / 1e3:7.3f} ms  x{calls / 3:5.1f}  {name[:110]}")
