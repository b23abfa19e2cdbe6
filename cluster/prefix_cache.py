"""Prefix caching: chained block hashes and the pool of KV blocks (refcounts, LRU, retention).

A full block's hash covers its parent block's hash, its token ids and any extra
keys (a tenant's cache salt, in the first block only: the chain carries it on).
The bytes hashed are fixed-width little-endian, so a hash is the same in every
process and on every machine; Python's ``hash()`` is never used.

The pool hands out block ids. A block is *free* (no content worth keeping),
*referenced* (held by one or more requests) or *cached-unreferenced* (its hash is
registered, nobody holds it: reusable by a cache hit, evictable in LRU order).
Blocks released less than ``retention_s`` ago are *retained*: only evicted when
the caller says the alternative is preempting a running request.
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections import OrderedDict, deque
from typing import Callable, Iterable, Sequence

HASH_ALGOS = ("blake3", "sha256", "sha512")


def _digest_fn(algo: str) -> Callable[[bytes], bytes]:
    if algo == "blake3":
        from blake3 import blake3

        return lambda data: blake3(data).digest()
    if algo in ("sha256", "sha512"):
        return lambda data: hashlib.new(algo, data).digest()
    raise ValueError(f"prefix_cache_hash must be one of {', '.join(HASH_ALGOS)}, got {algo!r}")


def hash_input(parent: bytes, tokens: Sequence[int], extra: bytes = b"") -> bytes:
    """The exact bytes hashed for one block: length-prefixed parent hash and extra keys,
    then the token ids as little-endian int64."""
    return b"".join(
        (
            len(parent).to_bytes(1, "little"),
            parent,
            len(extra).to_bytes(4, "little"),
            extra,
            struct.pack(f"<{len(tokens)}q", *tokens),
        )
    )


class BlockHasher:
    """``hasher(parent, tokens, extra) -> digest``; ``parent`` is b"" for a sequence's first block."""

    def __init__(self, algo: str = "blake3"):
        self.algo = algo
        self._digest = _digest_fn(algo)

    def __call__(self, parent: bytes, tokens: Sequence[int], extra: bytes = b"") -> bytes:
        return self._digest(hash_input(parent, tokens, extra))

    def chain(self, tokens: Sequence[int], block_size: int, extra: bytes = b"") -> list[bytes]:
        """Hashes of every full block of ``tokens`` (tests and tools)."""
        out: list[bytes] = []
        for j in range(len(tokens) // block_size):
            out.append(
                self(out[-1] if out else b"", tokens[j * block_size : (j + 1) * block_size], b"" if out else extra)
            )
        return out


def salt_key(salt: str | None) -> bytes:
    """Extra key of a request's first block: isolates tenants that use different salts."""
    return b"" if salt is None else b"salt\x00" + salt.encode("utf-8")


class BlockPool:
    """Block ids with reference counts, a free list and an LRU of cached-unreferenced blocks."""

    def __init__(self, num_blocks: int, retention_s: float = 0.0, clock: Callable[[], float] = time.monotonic):
        self.num_blocks = num_blocks
        self.retention_s = retention_s
        self.clock = clock
        self.free: deque[int] = deque(range(num_blocks))
        self.ref = [0] * num_blocks
        self.hash_of: dict[int, bytes] = {}
        self.by_hash: dict[bytes, int] = {}
        self.expired: OrderedDict[int, None] = OrderedDict()  # evictable, least recently released first
        self.retained: OrderedDict[int, float] = OrderedDict()  # released within retention_s, oldest first
        self.evictions = 0

    # ------------------------------------------------------------- counts
    @property
    def num_free(self) -> int:
        """Blocks nobody references (free or cached-unreferenced)."""
        return len(self.free) + len(self.expired) + len(self.retained)

    def _age(self) -> None:
        if not self.retained:
            return
        cutoff = self.clock() - self.retention_s
        while self.retained:
            b, t = next(iter(self.retained.items()))
            if t > cutoff:
                break
            del self.retained[b]
            self.expired[b] = None

    def available(self, allow_retained: bool, reuse: Iterable[int] = ()) -> int:
        """Blocks ``take`` could hand out, not counting the unreferenced ones in ``reuse``
        (a cache hit about to be referenced)."""
        self._age()
        n = len(self.free) + len(self.expired) + (len(self.retained) if allow_retained else 0)
        for b in reuse:
            if self.ref[b] == 0 and (b in self.expired or (allow_retained and b in self.retained)):
                n -= 1
        return n

    # ---------------------------------------------------------- lifecycle
    def take(self, n: int, allow_retained: bool) -> list[int]:
        """``n`` blocks, referenced once each: free ones first, then evicted LRU cached ones."""
        if n > self.available(allow_retained):
            raise RuntimeError("allocate() called without can_allocate()")
        out = []
        for _ in range(n):
            if self.free:
                b = self.free.popleft()
            else:
                b = (self.expired or self.retained).popitem(last=False)[0]
                del self.by_hash[self.hash_of.pop(b)]
                self.evictions += 1
            self.ref[b] = 1
            out.append(b)
        return out

    def touch(self, blocks: Iterable[int]) -> None:
        """Reference cached blocks (a cache hit); unreferenced ones leave the LRU."""
        for b in blocks:
            if self.ref[b] == 0:
                if b in self.expired:
                    del self.expired[b]
                else:
                    self.retained.pop(b, None)
            self.ref[b] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference each. Cached blocks enter the LRU tail-first (a sequence's last
        blocks are evicted before its first, which more requests share)."""
        cached = []
        for b in blocks:
            self.ref[b] -= 1
            if self.ref[b] < 0:
                raise AssertionError(f"KV block {b} released more often than referenced")
            if self.ref[b] == 0:
                if b in self.hash_of:
                    cached.append(b)
                else:
                    self.free.append(b)
        now = self.clock()
        for b in reversed(cached):
            if self.retention_s > 0:
                self.retained[b] = now
            else:
                self.expired[b] = None

    # -------------------------------------------------------------- cache
    def commit(self, block: int, h: bytes) -> None:
        """Register a referenced block's content. A block already cached keeps its hash; if
        another block holds the same content, that one stays the cached copy."""
        if block in self.hash_of or h in self.by_hash:
            return
        self.hash_of[block] = h
        self.by_hash[h] = block

    def lookup(self, hashes: Iterable[bytes]) -> list[int]:
        """Blocks of the longest cached prefix of ``hashes``."""
        out = []
        for h in hashes:
            b = self.by_hash.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def check_consistent(self) -> None:
        """No referenced block unowned (all refcounts 0) and every block in exactly one place."""
        held = [b for b in range(self.num_blocks) if self.ref[b]]
        if held:
            raise AssertionError(f"KV block leak: {len(held)} of {self.num_blocks} blocks held (e.g. {held[:8]})")
        places = list(self.free) + list(self.expired) + list(self.retained)
        if len(places) != self.num_blocks or len(set(places)) != self.num_blocks:
            raise AssertionError(
                f"KV block leak: {self.num_blocks - len(set(places))} of "
                f"{self.num_blocks} blocks missing from the free lists"
            )
        if set(self.hash_of) != set(self.expired) | set(self.retained):
            raise AssertionError("cached blocks and the LRU disagree")
        if {b: h for h, b in self.by_hash.items()} != self.hash_of:
            raise AssertionError("the hash index and the block hashes disagree")
