"""Starts the worker actors and ships them step plans."""

from __future__ import annotations

import logging
import os
import socket

import msgspec
import ray

from metadata.config import EngineConfig
from metadata.wire import StepPlan, StepResult, decode_result, encode

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """A worker died or failed a step; in-flight requests cannot complete."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _project_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class RayExecutor:
    """One actor per rank of the tensor-parallel group; every rank gets the same plan bytes."""

    def __init__(self, cfg: EngineConfig, model_dir: str, max_model_len: int, device_kind: str):
        from workers.actor import WorkerActor

        if not ray.is_initialized():
            ray.init(address=cfg.parallel.ray_address, log_to_driver=True)
        self.cfg = cfg
        world = cfg.parallel.tensor_parallel_size
        init = f"tcp://127.0.0.1:{_free_port()}" if world > 1 else None
        use_gpu = device_kind == "cuda"
        env = {"PYTHONPATH": _project_root() + os.pathsep + os.environ.get("PYTHONPATH", "")}
        cls = ray.remote(WorkerActor)
        self.workers = [
            cls.options(
                num_cpus=0 if use_gpu else 1,
                num_gpus=1 if use_gpu else 0,
                runtime_env={"env_vars": env},
                max_concurrency=1,
            ).remote(msgspec.msgpack.encode(cfg), model_dir, rank, world, max_model_len, init, device_kind)
            for rank in range(world)
        ]
        timeout = cfg.parallel.worker_start_timeout_s
        try:
            blocks = self._get([w.load.remote() for w in self.workers], timeout, "load the model")
            self.num_blocks = min(blocks)
            self._get([w.init_cache.remote(self.num_blocks) for w in self.workers], timeout, "allocate the KV cache")
        except BaseException:
            self.shutdown()
            raise

    def _get(self, refs, timeout: float, what: str):
        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise EngineDeadError(
                f"workers did not {what} within {timeout:.0f} s (worker_start_timeout_s); "
                "check that the cluster has the resources the workers need"
            ) from None
        except ray.exceptions.RayActorError as exc:
            raise EngineDeadError(f"a worker died while trying to {what}: {exc}") from None
        except ray.exceptions.RayTaskError as exc:
            raise EngineDeadError(f"a worker failed to {what}: {exc.cause if hasattr(exc, 'cause') else exc}") from None

    def submit(self, plan: StepPlan) -> list:
        data = encode(plan)
        return [w.execute.remote(data) for w in self.workers]

    def collect(self, refs: list) -> StepResult:
        """Wait for one step on every rank; rank 0's result is authoritative."""
        results = []
        for rank, ref in enumerate(refs):
            try:
                results.append(decode_result(ray.get(ref)))
            except ray.exceptions.RayActorError as exc:
                raise EngineDeadError(f"worker rank {rank} died: {exc}") from None
        for r in results:
            if r.error:
                raise EngineDeadError(f"worker rank {r.rank} failed step {r.step_id}: {r.error}")
        return results[0]

    def shutdown(self) -> None:
        for w in getattr(self, "workers", []):
            try:
                ray.kill(w)
            except Exception:  # already gone
                pass
        self.workers = []
