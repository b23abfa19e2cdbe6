"""KV block allocation for the paged cache (driver side)."""

from __future__ import annotations

from collections import deque

from cluster.request import Request


class BlockManager:
    """Hands out KV block ids. Allocation sizes from upper bounds (the optimistic
    outcome of in-flight steps); freeing returns all of a request's blocks, which
    is safe because workers execute plans in order: a block freed now is reused
    only by a later plan, after every in-flight write to it has happened."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, req: Request, num_tokens: int) -> int:
        need = (num_tokens + self.block_size - 1) // self.block_size
        return max(0, need - len(req.block_ids))

    def can_allocate(self, req: Request, num_tokens: int) -> bool:
        return self.blocks_needed(req, num_tokens) <= len(self._free)

    def allocate(self, req: Request, num_tokens: int) -> list[int]:
        """Grow ``req`` to hold ``num_tokens`` tokens; returns the new block ids."""
        n = self.blocks_needed(req, num_tokens)
        if n > len(self._free):
            raise RuntimeError("allocate() called without can_allocate()")
        new = [self._free.popleft() for _ in range(n)]
        req.block_ids.extend(new)
        return new

    def free(self, req: Request) -> None:
        self._free.extend(req.block_ids)
        req.block_ids = []

    def check_all_free(self) -> None:
        if len(self._free) != self.num_blocks or len(set(self._free)) != self.num_blocks:
            raise AssertionError(
                f"KV block leak: {self.num_blocks - len(set(self._free))} of {self.num_blocks} blocks held"
            )
