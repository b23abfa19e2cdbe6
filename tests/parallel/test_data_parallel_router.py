"""The data-parallel router's choice (``cluster.dp_policy``) on real chained block hashes."""

import pytest

from cluster.dp_policy import PrefixLoadRouter
from cluster.prefix_cache import BlockHasher, salt_key

BS = 4
PREFIX = list(range(10, 10 + 4 * BS))  # four full blocks


def test_hashes_are_the_block_managers_chain():
    """The router hashes a prompt exactly as a replica's block manager does."""
    router = PrefixLoadRouter(2, BS, "sha256")
    toks = PREFIX + [99, 98]
    got = router.block_hashes(toks, "tenant-a")
    assert len(got) == 4
    assert got == BlockHasher("sha256").chain(toks, BS, salt_key("tenant-a"))
    assert got != router.block_hashes(toks, "tenant-b") and got != router.block_hashes(toks)


def test_longest_cached_prefix_wins_when_load_allows():
    router = PrefixLoadRouter(3, BS, max_imbalance=4)
    a = router.block_hashes(PREFIX + [1])
    # replica 2 holds two blocks of the prefix, replica 1 all four
    router.assign(2, a[:2])
    router.assign(1, a)
    router.done(1)
    router.done(2)
    choice = router.choose(router.block_hashes(PREFIX + [7, 7, 7]), [0, 1, 2])
    assert (choice.replica, choice.matched_blocks, choice.reason) == (1, 4, "prefix")
    # a prompt sharing only the first two blocks: both 1 and 2 hold them; the less loaded wins
    router.report(1, running=3, waiting=0, kv_usage=0.5)
    part = router.block_hashes(PREFIX[: 2 * BS] + [5] * (2 * BS))
    assert router.choose(part, [0, 1, 2]).replica == 2
    # no shared prefix: least loaded (ties to the lowest index)
    other = router.block_hashes([200] * (3 * BS))
    assert router.choose(other, [0, 1, 2]).replica == 0
    assert router.choose(other, [0, 1, 2]).reason == "load"


def test_overloaded_prefix_holder_loses_to_least_loaded():
    router = PrefixLoadRouter(2, BS, max_imbalance=2)
    h = router.block_hashes(PREFIX)
    router.assign(0, h)
    assert router.choose(h, [0, 1]).replica == 0  # 1 outstanding vs 0: within the slack
    for _ in range(3):
        router.assign(0, [])
    assert router.load(0) == 4
    assert router.choose(h, [0, 1]).replica == 1  # 4 > 0 + 2
    # the replica's own report counts when it is higher than the router's count
    router2 = PrefixLoadRouter(2, BS, max_imbalance=2)
    router2.assign(0, h)
    router2.done(0)
    router2.report(0, running=5, waiting=2, kv_usage=0.9)
    assert router2.load(0) == pytest.approx(7.9)
    assert router2.choose(h, [0, 1]).replica == 1


def test_dead_replicas_are_skipped_and_restarts_forget_the_cache():
    router = PrefixLoadRouter(2, BS)
    h = router.block_hashes(PREFIX)
    router.assign(1, h)
    router.done(1)
    assert router.choose(h, [0]).replica == 0  # replica 1 is down
    assert router.choose(h, [0, 1]).replica == 1
    router.forget(1)  # it restarted with an empty KV cache
    assert router.choose(h, [0, 1]).reason == "load"
    with pytest.raises(ValueError, match="no replica"):
        router.choose(h, [])


def test_bounded_hash_memory_and_load_only_mode():
    router = PrefixLoadRouter(2, BS, capacity_blocks=4)
    old = router.block_hashes(PREFIX)
    router.assign(1, old)
    router.done(1)
    router.assign(1, router.block_hashes([300 + i for i in range(4 * BS)]))  # evicts the old prefix
    router.done(1)
    assert len(router.maps[1].items) == 4
    assert router.choose(old, [0, 1]).reason == "load"
    off = PrefixLoadRouter(2, BS, enabled=False)  # prefix caching disabled: hashes are not kept
    assert off.block_hashes(PREFIX) == []
    off.assign(0, [])
    assert off.choose([], [0, 1]).replica == 1
