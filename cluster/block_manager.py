"""KV block allocation for the paged cache (driver side), with prefix caching."""

from __future__ import annotations

import time
from typing import Callable, Sequence

from cluster.prefix_cache import BlockHasher, BlockPool, salt_key
from cluster.request import Request


class BlockManager:
    """Hands out KV block ids. Allocation sizes from upper bounds (the optimistic
    outcome of in-flight steps); freeing returns all of a request's blocks, which
    is safe because workers execute plans in order: a block freed now is reused
    only by a later plan, after every in-flight write to it has happened.

    With prefix caching, ``commit`` registers a request's full blocks whose tokens
    and KV are confirmed; ``lookup`` finds the longest cached prefix of a request
    about to be placed, ``admit`` references it. Freed cached blocks stay
    reusable until evicted (LRU) by an allocation that finds no free block."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        hash_algo: str = "blake3",
        retention_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, retention_s, clock)
        self.hasher = BlockHasher(hash_algo) if enable_prefix_caching else None
        self.queries = 0  # tokens of placed requests looked up in the cache
        self.hits = 0  # of those, tokens found cached
        self.num_lookups = 0

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.num_blocks

    def blocks_needed(self, req: Request, num_tokens: int) -> int:
        need = (num_tokens + self.block_size - 1) // self.block_size
        return max(0, need - len(req.block_ids))

    def can_allocate(self, req: Request, num_tokens: int, allow_retained: bool = True) -> bool:
        return self.blocks_needed(req, num_tokens) <= self.pool.available(allow_retained)

    def allocate(self, req: Request, num_tokens: int, allow_retained: bool = True) -> list[int]:
        """Grow ``req`` to hold ``num_tokens`` tokens; returns the new block ids."""
        new = self.pool.take(self.blocks_needed(req, num_tokens), allow_retained)
        req.block_ids.extend(new)
        return new

    def free(self, req: Request) -> None:
        self.pool.release(req.block_ids)
        req.block_ids = []
        req.num_committed_blocks = 0

    # ------------------------------------------------------- prefix caching
    def lookup(self, req: Request) -> list[int]:
        """Cached blocks of ``req``'s longest cached prefix of confirmed tokens: whole blocks,
        at most all tokens but the last (its logits must be computed). Pure: no reference taken."""
        if not self.caching or req.block_ids:
            return []
        n = (req.num_known_tokens - 1) // self.block_size
        return self.pool.lookup(self._hashes(req, n)[:n])

    def can_admit(self, req: Request, num_tokens: int, hit: Sequence[int], allow_retained: bool) -> bool:
        need = (num_tokens + self.block_size - 1) // self.block_size - len(hit)
        return need <= self.pool.available(allow_retained, reuse=hit)

    def admit(self, req: Request, num_tokens: int, hit: Sequence[int], allow_retained: bool) -> None:
        """Place ``req`` with the cached blocks ``hit`` first, then new blocks up to ``num_tokens``."""
        self.pool.touch(hit)
        req.block_ids = list(hit)
        req.num_committed_blocks = len(hit)
        self.allocate(req, num_tokens, allow_retained)
        if self.caching:
            self.num_lookups += 1
            self.queries += req.num_known_tokens
            self.hits += len(hit) * self.block_size

    def commit(self, req: Request, num_tokens: int) -> None:
        """Cache ``req``'s full blocks within its first ``num_tokens`` tokens (all confirmed:
        tokens known and KV written by finished steps)."""
        if not self.caching:
            return
        full = min(num_tokens // self.block_size, len(req.block_ids))
        if full <= req.num_committed_blocks:
            return
        hashes = self._hashes(req, full)
        for j in range(req.num_committed_blocks, full):
            self.pool.commit(req.block_ids[j], hashes[j])
        req.num_committed_blocks = full

    def _hashes(self, req: Request, n: int) -> list[bytes]:
        """The chained hashes of ``req``'s first ``n`` full blocks (computed once, kept on it:
        confirmed tokens never change)."""
        hs = req.block_hashes
        if len(hs) < n:
            bs = self.block_size
            prompt, outs = req.prompt_token_ids, req.output_token_ids
            P = len(prompt)
            extra = salt_key(getattr(req.params, "cache_salt", None))
            for j in range(len(hs), n):
                a, b = j * bs, (j + 1) * bs
                toks = prompt[a:b] if b <= P else (prompt[a:] + outs[: b - P] if a < P else outs[a - P : b - P])
                hs.append(self.hasher(hs[-1] if hs else b"", toks, b"" if hs else extra))
        return hs

    def stats(self) -> dict:
        q = self.queries
        return {
            "enabled": self.caching,
            "hash": self.hasher.algo if self.hasher else None,
            "queries": q,
            "hits": self.hits,
            "hit_rate": self.hits / q if q else 0.0,
            "requests": self.num_lookups,
            "num_cached_blocks": len(self.pool.by_hash),
            "evictions": self.pool.evictions,
        }

    def check_all_free(self) -> None:
        """No block is referenced any more (cached-unreferenced blocks count as free)."""
        self.pool.check_consistent()
