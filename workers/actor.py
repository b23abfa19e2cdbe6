"""The Ray actor hosting one worker (one device, one rank).

The first thing the constructor does is choose this actor's platform adapter and
let it set device visibility from Ray's assignment, before torch touches the
device. The sync-check mode arrives with the encoded ``EngineConfig``, in the
constructor; nothing is read from the environment.

Every rank of every pipeline stage receives the same plan bytes, over its own step channel
(``workers.step_channel``), not as Ray calls. The result of the last stage's first rank
(rank 0 without pipeline parallelism) is the step's result; the other ranks return only
the step id and an error, if any.
"""

from __future__ import annotations

import gc
import logging
import os
import socket

import msgspec

from metadata.config import EngineConfig
from placement.platforms import select_platform
from workers.compile_watch import CompileWatch

logger = logging.getLogger(__name__)


def _show_worker_logs(level: int) -> None:
    """This package's lines from ``level`` up (at INFO: the start-up progress, KV sizing and
    graph captures) on the process's stderr, which Ray forwards to the driver's console with
    the actor's name. ``level``: the driver's, so that ``--log-level`` holds for both."""
    log = logging.getLogger("workers")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(level)


def _assigned_gpus() -> list[str]:
    import ray

    if not ray.is_initialized():
        return []
    return list(ray.get_runtime_context().get_accelerator_ids().get("GPU", []))


class WorkerActor:
    def __init__(
        self,
        config: bytes,
        model_dir: str,
        rank: int,
        world_size: int,
        max_model_len: int,
        device_kind: str = "cpu",
        tp_size: int | None = None,
        log_level: int = logging.WARNING,
    ):
        _show_worker_logs(log_level)
        self.platform = select_platform(device_kind)
        self.gpu_ids = _assigned_gpus() if self.platform.ray_resource == "GPU" else []
        self.visibility = self.platform.configure(self.gpu_ids)  # before torch touches the device
        for note in self.visibility.notes:
            logger.warning("rank %d: %s", rank, note)
        self.cfg = msgspec.msgpack.decode(config, type=EngineConfig)
        self.model_dir = model_dir
        self.rank = rank
        self.world_size = world_size
        self.tp_size = tp_size or world_size
        # the rank whose result the driver reads: the last pipeline stage's first
        self.result_rank = (self.cfg.parallel.pipeline_parallel_size - 1) * self.tp_size
        self.max_model_len = max_model_len
        self.device_kind = device_kind
        from workers.sync_check import SyncCheck

        # a device with a launch queue also audits what a step enqueues (workers.launch_audit)
        audited = self.platform.torch_device_type if self.platform.torch_device_type != "cpu" else None
        self.sync_check = SyncCheck(self.cfg.sync_check, device_type=audited)
        self.runner = None
        self.loop = None
        self.channel = None  # workers.step_channel.StepChannelServer, once the driver asks
        self.compile_watch = CompileWatch(rank)

    # ---------------------------------------------------------------- info
    def ping(self) -> dict:
        return {"rank": self.rank, "pid": os.getpid()}

    def describe(self) -> dict:
        import ray

        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "node_ip": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "gpu_ids": self.gpu_ids,
            "visibility": dict(self.visibility.set),
            "notes": list(self.visibility.notes),
            "kernels": msgspec.to_builtins(self.cfg.kernels),
            **self.platform.describe(),
        }

    def stats(self) -> dict:
        model = self.runner.model if self.runner is not None else None
        pp = self.runner.pp if self.runner is not None else None
        return {
            **(pp.stats() if pp is not None else {}),
            "num_layers": len(model.layers) if model is not None else 0,
            "ubatched_steps": getattr(model, "num_split_steps", 0),
            "kernel_variants_after_start": len(self.compile_watch.variants),
            "tile_gemm_warm_launches": getattr(self.runner, "tile_gemm_warm_launches", 0),
            "eager_warm_cases": getattr(self.runner, "eager_warm_cases", 0),
            "kernel_variants_first": [v[:1200] for v in self.compile_watch.variants[:4]],
            "tp_all_reduce": self.platform.collective_library,
            "launch_ms": list(self.runner.launch_ms) if self.runner is not None else [],
            # the launches of prefill / mixed / uneven speculative steps (no decode graph fits)
            "mixed_launch_ms": list(self.runner.mixed_launch_ms) if self.runner is not None else [],
            # (mixed step?, ms of each of workers.model_runner.LAUNCH_PHASES) a sampling launch
            "launch_phases_ms": [list(p) for p in self.runner.launch_phases] if self.runner is not None else [],
            # (mixed step?, wall ms, the launching thread's CPU ms) a sampling launch
            "launch_cpu_ms": [list(c) for c in self.runner.launch_cpu] if self.runner is not None else [],
            # with launch_wait_probe_ms: (mixed step?, pinned host blocks, device segments) created a launch
            "launch_allocs": [list(a) for a in self.runner.launch_allocs] if self.runner is not None else [],
            "mixed_graph_replays": getattr(getattr(self.runner, "mixed_graphs", None), "replays", 0),
            "input_graph_replays": getattr(getattr(self.runner, "input_graphs", None), "replays", 0),
            "decode_graph_buckets": sorted(getattr(getattr(self.runner, "graphs", None), "buckets_replayed", ())),
            "allocator_growths": self.sync_check.allocator_growths,  # steps that grew the CUDA pool
            "padded_verify_steps": getattr(self.runner, "padded_steps", 0),  # uneven drafts, one graph
            "propose_graph_replays": self._propose_graph_replays(),
        }

    def _propose_graph_replays(self) -> int:
        """Draft-model proposals that replayed one graph (``workers.draft_graphs``)."""
        proposer = getattr(getattr(self.runner, "spec", None), "proposer", None)
        graphs = getattr(proposer, "propose_graphs", None)
        return graphs.replays if graphs is not None else 0

    def clear_launch_times(self) -> None:
        """Forget the recorded launch times (a benchmark's warm-up is not its steady state)."""
        if self.runner is not None:
            self.runner.reset_launch_stats()

    def rendezvous(self) -> str:
        """``tcp://ip:port`` on this (rank 0) node for ``torch.distributed`` to meet at."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    # --------------------------------------------------------------- setup
    def load(self, dist_init_method: str | None = None) -> int:
        """Join the TP group (and the pipeline), load this stage's layers, size the KV cache;
        returns the blocks that fit here."""
        import torch

        from workers.distributed import TPGroup, init_distributed
        from workers.model_runner import ModelRunner

        device = self.platform.torch_device()
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(self.cfg.kernels.cpu_threads)
        tp = TPGroup(self.rank, self.world_size)
        if self.world_size > 1:
            tp = init_distributed(
                self.platform.collective_backend, dist_init_method, self.rank, self.world_size, self.tp_size
            )
        self.runner = ModelRunner(self.cfg, self.model_dir, device, tp, self.max_model_len, pp=self._pipeline())
        self._probe_blocks = self.runner.init_kv_cache() if self.cfg.cache.num_kv_blocks is None else None
        return self._probe_blocks or self.cfg.cache.num_kv_blocks

    def _pipeline(self):
        """This rank's stage transfers, or None without pipeline parallelism."""
        pp = self.cfg.parallel.pipeline_parallel_size
        if pp == 1:
            return None
        from workers.models.arch import load_arch
        from workers.pipeline import PipelineComm, pipeline_stage

        stage = pipeline_stage(
            self.rank, self.tp_size, pp, load_arch(self.model_dir).num_layers, self.cfg.parallel.pipeline_layer_split
        )
        return PipelineComm(stage, self.rank, self.tp_size)

    def init_cache(self, num_blocks: int) -> None:
        """Allocate the agreed (minimum over ranks) number of blocks, capture graphs, start the loop."""
        from workers.step_loop import StepLoop

        if self._probe_blocks != num_blocks:
            self.runner.kv_caches = []
            self.runner.init_kv_cache(num_blocks)
        self.runner.capture_cuda_graphs()
        self.runner.warm_up()
        threshold = self.cfg.parallel.ubatch_token_threshold
        if threshold is not None:
            self.runner.enable_ubatching(threshold)
        if self.runner.graphs is None or self.runner.mixed_graphs is None:
            # enforce_eager, a pipeline stage or ubatching: eager forwards by design, whose
            # launch count grows with the layers; the audit still reports pageable copies
            self.sync_check.launch_budget = None
        self.loop = StepLoop(self.runner, self.sync_check, self.rank)
        if self.platform.torch_device_type == "cuda":
            self.compile_watch.install()  # from here on, a new kernel variant is a warning
        # Everything alive now (model, caches, imported modules) lives as long as the worker:
        # keep it out of the cyclic collector, whose full passes over it stall steps for 100+ ms.
        gc.collect()
        gc.freeze()

    # ---------------------------------------------------------------- step
    def open_step_channel(self) -> tuple[str, int, bytes]:
        """Listen for the driver's step connection (``workers.step_channel``); returns the
        address to connect to and the token to open it with (handed over through Ray)."""
        import ray

        from workers.step_channel import StepChannelServer

        if self.loop is None:
            raise RuntimeError("open_step_channel before init_cache: the step loop is not running")
        if self.channel is not None:
            self.channel.close()
        self.channel = StepChannelServer(self.loop, ray.util.get_node_ip_address(), self.rank, self.result_rank)
        return (*self.channel.address, self.channel.token)

    def shutdown(self) -> None:
        if self.channel is not None:
            self.channel.close()
        if self.loop is not None:
            self.loop.stop()
        from workers.distributed import destroy_distributed

        destroy_distributed()
