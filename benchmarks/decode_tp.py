"""Run ``decode_bench.measure`` on every rank of a tensor-parallel group.

One Ray actor per rank, placed and given its device exactly as the engine's workers
are (``placement.place_workers`` bundles, the platform adapter's visibility and
runtime environment, NVLink multicast off on CUDA). The ranks meet over
``torch.distributed`` (NCCL on GPUs, gloo on CPUs) and run the same cells in
lockstep: every step of every rank joins the same collectives, so a rank cannot run
ahead. Rank 0's timings are the result; each rank's median step time per cell is
kept beside them to show the ranks agree.
"""

from __future__ import annotations

import os
from typing import Any

from workers.actor import WorkerActor, _assigned_gpus


class RankBench:
    """One rank of a TP decode benchmark (a Ray actor holding one device)."""

    rendezvous = WorkerActor.rendezvous  # tcp://ip:port on rank 0's node

    def __init__(self, device_kind: str, rank: int, world_size: int):
        from placement.platforms import select_platform

        self.platform = select_platform(device_kind)
        gpus = _assigned_gpus() if self.platform.ray_resource == "GPU" else []
        self.platform.configure(gpus)  # before torch touches the device
        self.rank, self.world_size = rank, world_size

    def measure(self, conf: dict[str, Any], init_method: str) -> dict[str, Any]:
        import torch

        from benchmarks.decode_bench import measure
        from workers.distributed import destroy_distributed, init_distributed

        device = self.platform.torch_device()
        if device.type == "cpu":
            torch.set_num_threads(1)
        else:
            torch.cuda.set_device(device)
        tp = init_distributed(
            self.platform.collective_backend, init_method, self.rank, self.world_size, self.world_size
        )
        try:
            return measure(conf, tp=tp, device=device)
        finally:
            destroy_distributed()


def device_kind_for(conf: dict[str, Any], tp_size: int, cluster_gpus: float) -> str:
    """``cuda`` when the run may use GPUs and the cluster has one per rank, else ``cpu``;
    ``--device cuda`` without enough GPUs is an error, not a silent CPU run."""
    if conf["device"] == "cpu":
        return "cpu"
    if cluster_gpus >= tp_size:
        return "cuda"
    if conf["device"] == "cuda":
        raise SystemExit(
            f"--device cuda --tensor-parallel-size {tp_size}: the Ray cluster has "
            f"{cluster_gpus:g} GPU(s), one per rank is needed"
        )
    return "cpu"


def _first_failure_or_all(ray, refs: list) -> list[dict[str, Any]]:
    """Every rank's result, raising the first rank's error as soon as it arrives (the other
    ranks would otherwise sit in a collective until torch.distributed's timeout)."""
    rank_of = {ref: rank for rank, ref in enumerate(refs)}
    results: list = [None] * len(refs)
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        for ref in done:
            results[rank_of[ref]] = ray.get(ref)
    return results


def run(conf: dict[str, Any], tp_size: int) -> dict[str, Any]:
    import ray

    from placement import actor_env_vars, select_platform
    from placement.placement_groups import Layout, place_workers

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS") or None, log_to_driver=True)
    kind = device_kind_for(conf, tp_size, ray.cluster_resources().get("GPU", 0))
    timeout = float(conf.get("start_timeout_s", 300))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {"PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""), **actor_env_vars(kind)}
    gpu = kind != "cpu"
    placement = place_workers(Layout(tp_size, 1), kind, timeout, name="decode-tp")
    actors = []
    try:
        cls = ray.remote(RankBench)
        actors = [
            cls.options(
                num_cpus=0 if gpu else 1,
                num_gpus=1 if gpu else 0,
                runtime_env={"env_vars": env},
                scheduling_strategy=placement.scheduling_strategy(rank),
                max_restarts=0,
            ).remote(kind, rank, tp_size)
            for rank in range(tp_size)
        ]
        init = ray.get(actors[0].rendezvous.remote(), timeout=timeout)
        results = _first_failure_or_all(ray, [a.measure.remote(conf, init) for a in actors])
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)
        placement.remove()
    collective = select_platform(kind).collective_library  # the name WorkerActor.stats uses
    out = dict(results[0], tp_all_reduce=collective)
    out["placement"] = f"{tp_size} Ray actors ({'1 GPU' if gpu else '1 CPU'} each), {collective}"
    out["rank_bandwidth_bytes_per_s"] = [r["bandwidth"]["bandwidth_bytes_per_s"] for r in results]
    for i, cell in enumerate(out["cells"]):
        if "step_ms_median" in cell:
            cell["rank_step_ms_median"] = [r["cells"][i]["step_ms_median"] for r in results]
    return out
