"""The tensor-parallel group a worker belongs to (a no-op group when tp == 1).

Collectives go through ``torch.distributed`` on the backend the platform adapter
chose (NCCL, RCCL or gloo). While a micro-batch runs under the ubatch overlap
scheduler (``workers/ubatch.py``), a collective is launched asynchronously and the
thread hands the turn to the other micro-batch before waiting for it, so one
micro-batch's communication overlaps the other's compute.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

_overlap = threading.local()  # .turn: the running micro-batch's turn-taker, or absent


def set_overlap_turn(turn: Any) -> None:
    """Install (or clear with None) this thread's turn-taker: an object with
    ``yield_turn()`` that lets the other micro-batch run until it yields back."""
    _overlap.turn = turn


def _finish(work) -> None:
    _overlap.turn.yield_turn()  # the other micro-batch computes while this collective is in flight
    work.wait()


@dataclass
class TPGroup:
    """Rank and size of this worker's tensor-parallel group plus its collectives.

    With ``size == 1`` every collective is the identity, so single-GPU code pays
    nothing. Otherwise ``torch.distributed`` must already be initialised;
    ``group`` is the stage's TP process group (None: the default group).
    """

    rank: int = 0
    size: int = 1
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        import torch.distributed as dist

        if getattr(_overlap, "turn", None) is None:
            dist.all_reduce(x, group=self.group)
        else:
            _finish(dist.all_reduce(x, group=self.group, async_op=True))
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        if getattr(_overlap, "turn", None) is None:
            dist.all_gather(parts, x.contiguous(), group=self.group)
        else:
            _finish(dist.all_gather(parts, x.contiguous(), group=self.group, async_op=True))
        return torch.cat(parts, dim=-1)


SINGLE = TPGroup()


def init_distributed(
    backend: str, init_method: str, rank: int, world_size: int, tp_size: int, timeout_s: float = 300.0
) -> TPGroup:
    """Join the process group of all workers and return this rank's TP group.

    Ranks are ``stage * tp_size + tp_rank`` (placement/placement_groups.py). With one
    stage the TP group is the default group; with several, each stage gets its own
    subgroup (every rank creates every subgroup, in the same order, as torch requires).
    """
    import torch.distributed as dist

    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )
    if tp_size == world_size:
        return TPGroup(rank, world_size)
    mine = None
    for stage in range(world_size // tp_size):
        ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
        g = dist.new_group(ranks)
        if rank in ranks:
            mine = g
    return TPGroup(rank % tp_size, tp_size, mine)


def destroy_distributed() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
