"""The measurement of ``benchmarks.decode_roofline``: one ``ModelRunner`` driven with step plans,
cell by cell (in-process, in a Ray task, or on every rank of a TP group: ``benchmarks.decode_tp``).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from benchmarks import common
from benchmarks.kernel_timeline import exposed_per_step, profiler_kernels
from benchmarks.roofline_model import (
    device_split,
    measure_bandwidth,
    phase_floor_s,
    weight_bytes_per_step,
)


def _sampling(temperature: float = 0.0, seed: int = 0):
    """Greedy by default; a temperature samples with a per-row seed (the counter-hash path)."""
    from metadata.wire import SamplingOptions

    return SamplingOptions(
        temperature=temperature,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        seed=seed,
        repetition_penalty=1.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        min_tokens=0,
        min_tokens_stop_ids=[],
        num_logprobs=-1,
    )


class Bench:
    """One ModelRunner, one KV cache, reused by every cell."""

    def __init__(self, conf: dict[str, Any], device=None, tp=None):
        import torch

        from metadata.config import EngineConfig
        from workers.distributed import TPGroup
        from workers.kv_cache import bytes_per_block
        from workers.model_runner import ModelRunner
        from workers.models.arch import load_arch

        self.conf = conf
        tp = tp or TPGroup()
        self.tp = tp
        self.device = device = device if device is not None else pick_device(conf)
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.set_device(self.device)
        arch = load_arch(conf["model_dir"])
        self.arch = arch
        # serial steps, then as many pipelined ones, then the profiled ones
        steps = 2 * (conf["warmup"] + conf["iters"]) + (conf["profile_steps"] if conf.get("profile_cells") else 0)
        bs = conf["block_size"]
        max_ctx = max(conf["context_lens"])
        max_len = max_ctx + steps + 2
        if max_len > arch.max_position_embeddings:
            raise SystemExit(
                f"context {max_ctx} + {steps} steps exceeds max_position_embeddings {arch.max_position_embeddings}"
            )
        opts = dict(conf["engine_options"])
        opts.update(
            model=conf["model_dir"],
            load_format=conf["load_format"],
            device=self.device.type,
            max_num_seqs=max(conf["batch_sizes"]),
            max_model_len=max_len,
            block_size=bs,
            dtype=conf["dtype"],
            enforce_eager=conf["cuda_graphs"] == "off",
            gpu_memory_utilization=conf["gpu_memory_utilization"],
            tensor_parallel_size=tp.size,
        )
        self.cfg = EngineConfig.from_options(**opts)
        t0 = time.perf_counter()
        self.runner = ModelRunner(self.cfg, conf["model_dir"], self.device, tp, max_len)
        self.load_s = time.perf_counter() - t0
        self.blocks_per_req = {c: -(-(c + steps + 1) // bs) for c in conf["context_lens"]}
        need = max(b * self.blocks_per_req[c] for b in conf["batch_sizes"] for c in conf["context_lens"])
        per_block = bytes_per_block(
            arch, self.runner.num_kv_heads, bs, getattr(self.runner, "kv_dtype", self.runner.dtype)
        )
        if cuda:
            try:  # (a baseline tree's runner profiles itself)
                from workers.memory_profile import profile_free_bytes

                budget = profile_free_bytes(self.runner)
            except ImportError:
                profile = getattr(self.runner, "_profile_free_bytes", None)
                budget = profile() if profile else int(torch.cuda.mem_get_info(self.device)[0] * 0.9)
            fit = max(1, budget // per_block)
        else:
            fit = need
        self.num_blocks = self.runner.init_kv_cache(_min_over_ranks(min(need, fit), tp, self.device))
        self.kv_bytes_per_token = per_block // bs
        self.graphs = "off"
        if conf["cuda_graphs"] == "on":
            capture = getattr(self.runner, "capture_cuda_graphs", None)
            if cuda and capture is not None:
                capture()
                self.graphs = "captured"
            else:
                self.graphs = "unavailable (runner has no capture_cuda_graphs)" if cuda else "n/a on CPU"
        self.step_id = 0
        self.next_handle = 0

    def _plan(self, **kw):
        from metadata.wire import StepPlan

        self.step_id += 1
        return StepPlan(step_id=self.step_id, **kw)

    def cell(self, batch: int, ctx: int) -> dict[str, Any]:
        import random

        import torch

        from metadata.wire import NewRequest

        conf, runner = self.conf, self.runner
        per = self.blocks_per_req[ctx]
        base = {"batch_size": batch, "context_len": ctx}
        if batch * per > self.num_blocks:
            need = batch * per * self.kv_bytes_per_token * conf["block_size"]
            return {
                **base,
                "skipped": f"KV cache needs {need / 2**30:.1f} GiB ({batch * per} blocks > {self.num_blocks} that fit)",
            }
        rng = random.Random(batch * 100003 + ctx)
        prompt = [rng.randrange(3, self.arch.vocab_size) for _ in range(ctx + 1)]
        handles = list(range(self.next_handle, self.next_handle + batch))
        self.next_handle += batch
        temp = self.conf.get("temperature", 0.0)
        news = [
            NewRequest.of(
                handle=h,
                prompt=prompt,
                outputs=[],
                sampling=_sampling(temp, h),
                block_ids=list(range(i * per, (i + 1) * per)),
            )
            for i, h in enumerate(handles)
        ]
        runner.execute(self._plan(new_requests=news))  # places the rows; no forward
        st = runner.state
        rows = torch.tensor([st.row_of[h] for h in handles], device=st.num_computed.device)
        st.num_computed[rows] = ctx  # the rows' device state claims ctx tokens of KV
        n = conf["warmup"] + conf["iters"]
        serial = self._serial_steps(handles, ctx, n)[conf["warmup"] :]
        piped = self._pipelined_steps(handles, ctx + n, n)[conf["warmup"] :]
        profile = None
        if (batch, ctx) in conf.get("profile_cells", ()):
            profile = self._profile(handles, ctx + 2 * n, conf["profile_steps"])
        runner.execute(self._plan(finished_handles=handles))
        mean_seq = ctx + n + (n - 1) / 2 + 1
        w_bytes = weight_bytes_per_step(runner.model, batch)
        kv_bytes = int(batch * mean_seq * self.kv_bytes_per_token)
        bw = conf["bandwidth_bytes_per_s"]
        step_s = statistics.median(piped)
        roof_s = (w_bytes + kv_bytes) / bw
        mm = conf.get("matmul_flops_per_s")  # absent: a caller that measured no matmul rate
        # bytes a weight (FP8 projections 1, the rest 2): the GEMM FLOPs are 2 x weights x rows,
        # at the measured 16-bit matmul rate (FP8 tensor cores are faster: with FP8 weights the
        # compute part of this floor overestimates)
        per_param = w_bytes / weight_bytes_per_step(runner.model, batch, count_params=True)
        floor_s = phase_floor_s(w_bytes, kv_bytes, per_param, batch, bw, mm) if mm else roof_s
        if profile:
            profile.update(device_split(profile["kernel_us_per_step"], step_s * 1e3, roof_s * 1e3))
        return {
            **base,
            "step_ms_median": step_s * 1e3,
            "step_ms_mean": statistics.fmean(piped) * 1e3,
            "step_ms_min": min(piped) * 1e3,
            "step_ms_max": max(piped) * 1e3,
            "serial_step_ms_median": statistics.median(serial) * 1e3,
            "weight_bytes": w_bytes,
            "kv_bytes": kv_bytes,
            "roofline_ms": roof_s * 1e3,
            "ratio": step_s / roof_s,
            "serial_ratio": statistics.median(serial) / roof_s,
            "phase_floor_ms": floor_s * 1e3,
            "floor_ratio": step_s / floor_s,
            "achieved_bandwidth_bytes_per_s": (w_bytes + kv_bytes) / step_s,
            "tokens_per_s": batch / step_s,
            **({"profile": profile} if profile else {}),
        }

    def _decode_plan(self, handles, seq_len: int):
        from metadata.wire import ScheduledRow

        return self._plan(
            rows=[
                ScheduledRow(
                    handle=h,
                    num_scheduled_tokens=1,
                    seq_len_upper_bound=seq_len,
                    new_block_ids=[],
                    sample=True,
                )
                for h in handles
            ]
        )

    def _check(self, res, handles) -> None:
        if res.error or len(res.outputs) != len(handles):
            raise RuntimeError(f"decode step failed at batch {len(handles)}: {res.error}")

    def _serial_steps(self, handles, start_len: int, n: int) -> list[float]:
        """Each step launched, then waited for: host preparation is not hidden."""
        times = []
        for k in range(n):
            plan = self._decode_plan(handles, start_len + k + 1)
            t = time.perf_counter()
            self._check(self.runner.execute(plan), handles)
            times.append(time.perf_counter() - t)
        return times

    def _pipelined_steps(self, handles, start_len: int, n: int) -> list[float]:
        """As the engine runs under async scheduling: step k+1 is launched before step k's
        tokens are read, so its host preparation overlaps step k on the device (the next
        plan needs no token from the host: inputs are read from device state). The time
        of a step is the interval between consecutive results."""
        runner, times, pending = self.runner, [], None
        last = time.perf_counter()
        for k in range(n + 1):
            nxt = runner.launch(self._decode_plan(handles, start_len + k + 1)) if k < n else None
            if pending is not None:
                self._check(runner.finish(pending), handles)
                now = time.perf_counter()
                times.append(now - last)
                last = now
            pending = nxt
        return times

    def _profile(self, handles, start_len: int, steps: int) -> dict[str, Any]:
        """Kernel time per decode step by kernel name (CUDA graph replays included)."""
        import torch
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            for k in range(steps):
                self.runner.execute(self._decode_plan(handles, start_len + k + 1))
            if self.device.type == "cuda":
                torch.cuda.synchronize()
        kernels = []
        for ev in prof.key_averages():
            if "CUDA" not in str(getattr(ev, "device_type", "")):
                continue  # CPU-side ops; their kernels are listed as CUDA events themselves
            dev_us = getattr(ev, "self_device_time_total", None)
            if dev_us is None:
                dev_us = getattr(ev, "self_cuda_time_total", 0)
            if dev_us > 0:
                kernels.append(
                    {
                        "name": ev.key[:120],
                        "us_per_step": dev_us / steps,
                        "calls_per_step": ev.count / steps,
                    }
                )
        kernels.sort(key=lambda r: -r["us_per_step"])
        total = sum(r["us_per_step"] for r in kernels)
        launches = sum(r["calls_per_step"] for r in kernels)
        return {
            "steps": steps,
            "kernel_us_per_step": total,
            "kernels_per_step": launches,
            "top": kernels[:40],
            **exposed_per_step(profiler_kernels(prof), steps),
        }


def pick_device(conf: dict[str, Any]):
    """``conf["device"]``: ``cpu``, ``cuda`` (an error without one) or ``auto``."""
    import torch

    if conf["device"] == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device visible")
    cuda = torch.cuda.is_available() and conf["device"] != "cpu"
    return torch.device("cuda", 0) if cuda else torch.device("cpu")


def _min_over_ranks(n: int, tp, device) -> int:
    """The KV blocks every rank of the TP group can hold (one collective at start-up, so
    all ranks skip the same cells and stay in lockstep)."""
    if tp.size == 1:
        return n
    import torch
    import torch.distributed as dist

    t = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.group)
    return int(t.item())


def measure(conf: dict[str, Any], tp=None, device=None) -> dict[str, Any]:
    """Everything that touches the device (runs in a Ray task or in-process; with ``tp``,
    on every rank of the group, see benchmarks/decode_tp.py)."""
    import torch
    from tqdm.auto import tqdm

    dev = device if device is not None else pick_device(conf)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    quiet = tp is not None and tp.rank != 0  # one rank reports progress
    mib = conf["bandwidth_mib"] or (2048 if dev.type == "cuda" else 256)
    bw = measure_bandwidth(dev, mib << 20, conf["bandwidth_iters"])
    if not quiet:
        print(
            f"copy bandwidth on {dev}: {bw['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s",
            flush=True,
        )
    mm = common.measure_matmul_rate(dev)
    conf = dict(
        conf,
        bandwidth_bytes_per_s=bw["bandwidth_bytes_per_s"],
        matmul_flops_per_s=mm["matmul_flops_per_s"],
    )
    if conf.get("skinny_max_m") is not None:
        from kernels import ops

        ops.SKINNY_MAX_M = conf["skinny_max_m"]
    conf["profile_cells"] = {tuple(c) for c in conf.get("profile_cells", ())}
    bench = Bench(conf, dev, tp)
    cells = []
    grid = [(b, c) for c in conf["context_lens"] for b in conf["batch_sizes"]]
    for b, c in tqdm(grid, desc="cells (batch, context)", dynamic_ncols=True, disable=quiet):
        cell = bench.cell(b, c)
        cells.append(cell)
        if quiet:
            continue
        if "skipped" in cell:
            tqdm.write(f"batch {b:4d} context {c:6d}: skipped, {cell['skipped']}")
        else:
            tqdm.write(
                f"batch {b:4d} context {c:6d}: step {cell['step_ms_median']:8.3f} ms (serial "
                f"{cell['serial_step_ms_median']:8.3f}), roofline {cell['roofline_ms']:8.3f} ms, "
                f"ratio {cell['ratio']:6.2f} (serial {cell['serial_ratio']:5.2f}, to the phase "
                f"floor {cell['floor_ratio']:5.2f})"
            )
            prof = cell.get("profile")
            if prof:
                tqdm.write(
                    f"  profile: {prof['kernel_us_per_step']:.1f} us of kernels per step, "
                    f"{prof['kernels_per_step']:.0f} launches per step"
                    + (
                        f", kernel ratio {prof['kernel_ratio']:.2f}, device idle "
                        f"{100 * prof['device_idle_fraction']:.0f} % of the step"
                        if "kernel_ratio" in prof
                        else ""
                    )
                )
                for r in prof["top"][:25]:
                    tqdm.write(f"    {r['us_per_step']:9.1f} us  x{r['calls_per_step']:6.1f}  {r['name'][:90]}")
                if prof.get("exposed_top"):
                    tqdm.write(
                        f"  span {prof['span_us_per_step']:.1f} us per step, idle "
                        f"{prof['idle_us_per_step']:.1f} us; what each kernel adds to it:"
                    )
                for r in prof.get("exposed_top", [])[:25]:
                    tqdm.write(
                        f"    {r['exposed_us_per_step']:9.1f} us (runs {r['duration_us_per_step']:8.1f})"
                        f"  x{r['calls_per_step']:6.1f}  {r['name'][:80]}"
                    )
    from kernels import ops
    from kernels.settings import current

    conf_out = {k: v for k, v in conf.items() if k != "profile_cells"}
    conf_out["skinny_max_m_effective"] = getattr(ops, "SKINNY_MAX_M", None)
    use_pdl = current().pdl if bench.device.type == "cuda" else "n/a"  # auto: batch-1 passes only
    return {
        "bandwidth": bw,
        "matmul": mm,
        "cells": cells,
        "device": str(bench.device),
        "dtype": str(bench.runner.dtype),
        "kernel_options": {
            "skinny_max_m": conf_out["skinny_max_m_effective"],
            "pdl": use_pdl,
        },
        "cuda_graphs": bench.graphs,
        "num_kv_blocks": bench.num_blocks,
        "tensor_parallel_size": bench.tp.size,
        "tp_rank": bench.tp.rank,
        "tp_all_reduce": "collective backend" if bench.tp.size > 1 else "none",
        "kv_bytes_per_token": bench.kv_bytes_per_token,
        "model_load_s": bench.load_s,
        "engine_config": bench.cfg.to_dict(),
        "worker_hardware": common.hardware_info(),
    }
