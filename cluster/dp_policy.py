"""Which data-parallel replica takes a request: prefix-cache affinity, then load.

The router remembers, per replica, the chained block hashes (``cluster.prefix_cache``:
the same hash function, block size and cache-salt key as the replicas' block managers)
of the prompts it sent there, in a bounded LRU about the size of that replica's KV cache.
A request goes to the replica holding the longest prefix of its block hashes, unless that
replica's load exceeds the least loaded one's by more than ``max_imbalance``; without a
usable match it goes to the least loaded replica. Load is sequences running + waiting
(the replica's report, or the router's own count of requests it has outstanding there
when that is higher: reports lag) plus the replica's KV-cache usage fraction.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from cluster.prefix_cache import BlockHasher, salt_key


@dataclass
class RouteChoice:
    replica: int
    matched_blocks: int  # blocks of the prompt the chosen replica is believed to hold
    reason: str  # "prefix" | "load"


class _HashLRU:
    def __init__(self, capacity: int):
        self.capacity = max(1, capacity)
        self.items: OrderedDict[bytes, None] = OrderedDict()

    def matched(self, hashes: Sequence[bytes]) -> int:
        n = 0
        for h in hashes:
            if h not in self.items:
                break
            n += 1
        return n

    def add(self, hashes: Sequence[bytes]) -> None:
        for h in hashes:
            self.items[h] = None
            self.items.move_to_end(h)
        while len(self.items) > self.capacity:
            self.items.popitem(last=False)


class PrefixLoadRouter:
    def __init__(
        self,
        num_replicas: int,
        block_size: int,
        hash_algo: str = "blake3",
        capacity_blocks: int = 1 << 16,
        max_imbalance: float = 4.0,
        enabled: bool = True,
    ):
        """``enabled=False`` (prefix caching off): route by load only."""
        self.block_size = block_size
        self.hasher = BlockHasher(hash_algo) if enabled else None
        self.max_imbalance = max_imbalance
        self.maps = [_HashLRU(capacity_blocks) for _ in range(num_replicas)]
        self.outstanding = [0] * num_replicas
        self.reported = [0.0] * num_replicas  # running + waiting from the replica's last report
        self.kv_usage = [0.0] * num_replicas

    # ------------------------------------------------------------- inputs
    def block_hashes(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        if self.hasher is None:
            return []
        return self.hasher.chain(token_ids, self.block_size, salt_key(cache_salt))

    def report(self, replica: int, running: int, waiting: int, kv_usage: float) -> None:
        self.reported[replica] = float(running + waiting)
        self.kv_usage[replica] = float(kv_usage)

    def set_capacity(self, replica: int, blocks: int) -> None:
        self.maps[replica].capacity = max(1, blocks)

    def forget(self, replica: int) -> None:
        """The replica restarted: its KV cache (and the router's outstanding count) is empty."""
        self.maps[replica].items.clear()
        self.outstanding[replica] = 0
        self.reported[replica] = 0.0
        self.kv_usage[replica] = 0.0

    def load(self, replica: int) -> float:
        return max(self.reported[replica], float(self.outstanding[replica])) + self.kv_usage[replica]

    # ------------------------------------------------------------- choice
    def choose(self, hashes: Sequence[bytes], alive: Sequence[int]) -> RouteChoice:
        """The replica for a request with block ``hashes`` among the ``alive`` ones."""
        if not alive:
            raise ValueError("no replica is alive")
        loads = {r: self.load(r) for r in alive}
        least = min(alive, key=lambda r: (loads[r], r))
        if hashes:
            best, best_n = least, 0
            for r in alive:
                n = self.maps[r].matched(hashes)
                if n > best_n or (n == best_n and n > 0 and (loads[r], r) < (loads[best], best)):
                    best, best_n = r, n
            if best_n > 0 and loads[best] <= loads[least] + self.max_imbalance:
                return RouteChoice(best, best_n, "prefix")
        return RouteChoice(least, 0, "load")

    def assign(self, replica: int, hashes: Sequence[bytes]) -> None:
        """Record that a request with ``hashes`` went to ``replica``."""
        self.outstanding[replica] += 1
        self.maps[replica].add(hashes)

    def done(self, replica: int) -> None:
        """A request routed to ``replica`` finished."""
        self.outstanding[replica] = max(0, self.outstanding[replica] - 1)
