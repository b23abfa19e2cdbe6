"""The tensor-parallel group a worker belongs to (a no-op group when tp == 1)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TPGroup:
    """Rank and size of this worker's tensor-parallel group plus its collectives.

    With ``size == 1`` every collective is the identity, so single-GPU code pays
    nothing. Otherwise ``torch.distributed`` must already be initialised.
    """

    rank: int = 0
    size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        import torch.distributed as dist

        dist.all_reduce(x)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


SINGLE = TPGroup()
