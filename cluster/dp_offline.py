"""Offline data parallelism: ``LLM(data_parallel_size=D).generate(...)`` spreads a batch over
D replica actors (``cluster.replica``) and returns the outputs in prompt order.

Requests are routed as online (``PrefixLoadRouter``: a shared prefix stays on one replica,
the rest balance by count), added in one call per replica, and collected with one long
poll per replica at a time.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

import ray

from cluster.dp_policy import PrefixLoadRouter
from cluster.executor import EngineDeadError
from cluster.outputs import RequestOutput
from cluster.replica_client import (
    actor_error,
    add_error,
    front_end_tokenizer,
    start_replica_actor,
    startup_timeout_s,
    wire_request,
)
from cluster.replica_wire import AddResult, PollBatch, decode, encode
from metadata.config import EngineConfig
from metadata.sampling_params import SamplingParams

POLL_TIMEOUT_S = 2.0


class OfflineDataParallel:
    def __init__(self, cfg: EngineConfig):
        if not ray.is_initialized():
            ray.init(address=cfg.parallel.ray_address, log_to_driver=True)
        self.cfg = cfg
        self.size = cfg.parallel.data_parallel_size
        self.router = PrefixLoadRouter(
            self.size, cfg.cache.block_size, cfg.cache.prefix_cache_hash, enabled=cfg.cache.enable_prefix_caching
        )
        self.actors = [start_replica_actor(cfg, i, 1 << 30) for i in range(self.size)]
        refs = [a.describe.remote() for a in self.actors]
        try:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=startup_timeout_s(cfg))
            if len(ready) < len(refs):
                raise EngineDeadError(
                    f"{len(refs) - len(ready)} data-parallel replica(s) did not start within "
                    f"{startup_timeout_s(cfg):.0f} s"
                )
            self.info = []
            for i, ref in enumerate(refs):
                try:
                    self.info.append(decode(ray.get(ref), dict))
                except ray.exceptions.RayError as exc:
                    raise EngineDeadError(f"data-parallel replica {i} failed to start: {actor_error(exc)}") from None
            self.tokenizer = front_end_tokenizer(cfg, self.info[0]["model_path"])
        except BaseException:
            self.shutdown()
            raise
        for i, info in enumerate(self.info):
            self.router.set_capacity(i, int(info.get("num_kv_blocks", 1 << 16)))
        self.max_model_len = self.info[0]["max_model_len"]
        self.device = self.info[0]["device"]
        self._ids = itertools.count()

    def generate(
        self, prompts: list, params: list[SamplingParams | None], use_tqdm: bool = True
    ) -> list[RequestOutput]:
        ids = [f"offline-dp-{next(self._ids)}" for _ in prompts]
        batches: list[list] = [[] for _ in range(self.size)]
        where: dict[str, int] = {}
        for rid, p, sp in zip(ids, prompts, params):
            wire, hashes = wire_request(self.tokenizer, self.router, rid, p, sp)
            r = self.router.choose(hashes, range(self.size)).replica
            self.router.assign(r, hashes)
            batches[r].append(wire)
            where[rid] = r
        adds = {i: self.actors[i].add.remote(encode(b)) for i, b in enumerate(batches) if b}
        failed: dict[str, AddResult] = {}
        try:
            for ref in adds.values():
                for res in decode(ray.get(ref), list[AddResult]):
                    if res.error is not None:
                        failed[res.request_id] = res
        except ray.exceptions.RayActorError as exc:
            self._abort(where)
            raise EngineDeadError(f"a data-parallel replica died: {actor_error(exc)}") from None
        if failed:  # one bad prompt fails the call, cleanly (as with one engine)
            self._abort({rid: r for rid, r in where.items() if rid not in failed})
            first = next(rid for rid in ids if rid in failed)
            raise add_error(failed[first])
        return self._collect(ids, where, use_tqdm and len(prompts) > 1)

    def _collect(self, ids: list[str], where: dict[str, int], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(ids)
        left = [0] * self.size
        for r in where.values():
            left[r] += 1
        polls = {self.actors[i].poll.remote(POLL_TIMEOUT_S): i for i in range(self.size) if left[i]}
        results: dict[str, RequestOutput] = {}
        errors: list[str] = []
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while pending:
                (ref,), _ = ray.wait(list(polls), num_returns=1)
                i = polls.pop(ref)
                try:
                    batch = decode(ray.get(ref), PollBatch)
                except ray.exceptions.RayActorError as exc:
                    self._abort({rid: r for rid, r in where.items() if rid in pending})
                    raise EngineDeadError(
                        f"data-parallel replica {i} died during generate(): {actor_error(exc)}"
                    ) from None
                for out in batch.finals:
                    if out.request_id in pending:
                        pending.discard(out.request_id)
                        left[i] -= 1
                        self.router.done(i)
                        results[out.request_id] = out
                        if out.error:
                            errors.append(f"replica {i}: {out.error}")
                        if bar:
                            bar.update(1)
                if left[i]:
                    polls[self.actors[i].poll.remote(POLL_TIMEOUT_S)] = i
        finally:
            if bar:
                bar.close()
        if errors:
            raise EngineDeadError(f"the engine failed during generate(): {errors[0]}")
        return [results[rid] for rid in ids]

    def _abort(self, where: dict[str, int]) -> None:
        by_replica: dict[int, list[str]] = {}
        for rid, r in where.items():
            by_replica.setdefault(r, []).append(rid)
        for r, rids in by_replica.items():
            with contextlib.suppress(ray.exceptions.RayError):  # already gone
                self.actors[r].abort.remote(rids)

    def stats(self) -> list[dict[str, Any]]:
        """Each replica's last load report (tests, benchmarks)."""
        return [decode(ray.get(a.poll.remote(0.0)), PollBatch).load for a in self.actors]

    def worker_pids(self) -> list[list[int]]:
        return [ray.get(a.worker_pids.remote()) for a in self.actors]

    def shutdown(self) -> None:
        refs = [a.stop.remote() for a in self.actors]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=30)
        for a in self.actors:
            with contextlib.suppress(ray.exceptions.RayError, ValueError):  # already gone
                ray.kill(a, no_restart=True)
        self.actors = []
