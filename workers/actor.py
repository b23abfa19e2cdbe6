"""The Ray actor hosting one worker (one device, one rank)."""

from __future__ import annotations

import logging
import os
import traceback

import msgspec

from metadata.config import EngineConfig
from metadata.wire import StepResult, decode_plan, encode

logger = logging.getLogger(__name__)


class WorkerActor:
    """Created with the encoded ``EngineConfig``: the sync-check mode arrives here, in
    the constructor, before any step can run; nothing is read from the environment."""

    def __init__(self, config: bytes, model_dir: str, rank: int, world_size: int, max_model_len: int,
                 dist_init_method: str | None = None, device_kind: str = "cpu"):
        self.cfg = msgspec.msgpack.decode(config, type=EngineConfig)
        self.model_dir = model_dir
        self.rank = rank
        self.world_size = world_size
        self.max_model_len = max_model_len
        self.dist_init_method = dist_init_method
        self.device_kind = device_kind
        from workers.sync_check import SyncCheck

        self.sync_check = SyncCheck(self.cfg.sync_check)
        self.runner = None

    def ping(self) -> dict:
        return {"rank": self.rank, "pid": os.getpid()}

    def load(self) -> int:
        """Load the model, size the KV cache; returns how many blocks fit on this rank."""
        import torch

        from workers.distributed import TPGroup
        from workers.model_runner import ModelRunner

        if self.device_kind == "cuda":
            device = torch.device("cuda", 0)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
            torch.set_num_threads(max(1, int(os.environ.get("SYNCLESS_CPU_THREADS", "1"))))
        tp = TPGroup(self.rank, self.world_size)
        if self.world_size > 1:
            import torch.distributed as dist

            backend = "nccl" if self.device_kind == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=self.dist_init_method, rank=self.rank,
                                    world_size=self.world_size)
        self.runner = ModelRunner(self.cfg, self.model_dir, device, tp, self.max_model_len)
        self._probe_blocks = self.runner.init_kv_cache() if self.cfg.cache.num_kv_blocks is None else None
        return self._probe_blocks or self.cfg.cache.num_kv_blocks

    def init_cache(self, num_blocks: int) -> None:
        """Allocate the agreed (minimum over ranks) number of blocks, then warm up."""
        if self._probe_blocks != num_blocks:
            self.runner.kv_caches = []
            self.runner.init_kv_cache(num_blocks)

    def execute(self, plan_bytes: bytes) -> bytes:
        plan = decode_plan(plan_bytes)
        try:
            with self.sync_check.armed():
                result = self.runner.execute(plan)
        except Exception as exc:  # reported to the driver, which fails the affected requests
            logger.exception("step %d failed on rank %d", plan.step_id, self.rank)
            result = StepResult(step_id=plan.step_id, rank=self.rank,
                                error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}")
        return encode(result)
