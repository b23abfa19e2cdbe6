"""Prefix caching without Ray: block hashes, the block pool, and the scheduler against a fake worker.

The engine runs with an in-process fake worker (``tests/sim_worker.py``'s, extended
to honour cache hits and shared blocks) that executes a plan only when the driver
collects its result, so between steps its KV store holds exactly what finished
steps wrote. After every step each cached block's KV must equal a confirmed prefix
of some request's token list, hashed independently here; every output must equal
its request's reference computed alone.
"""

from __future__ import annotations

import hashlib
import random
import struct
import subprocess
import sys

import msgspec
import pytest

from cluster.block_manager import BlockManager
from cluster.prefix_cache import HASH_ALGOS, BlockHasher, BlockPool, salt_key
from cluster.request import Request
from tests.sim_worker import (
    CONFIGS,
    VOCAB,
    FakeExecutor,
    FakeWorker,
    check,
    fake_model_dir,  # noqa: F401
    random_workload,
    run,
)

# ------------------------------------------------------------------ hashing
HASH_SNIPPET = (
    "from cluster.prefix_cache import BlockHasher, salt_key\n"
    "for a in ('blake3', 'sha256', 'sha512'):\n"
    "    print(a, ','.join(h.hex() for h in BlockHasher(a).chain(list(range(3, 40)), 8, salt_key('t'))))\n"
)


def _expected_hashes(algo: str, tokens: list[int], bs: int, salt: bytes) -> list[str]:
    """The chain, built from the documented byte layout with the hash libraries directly."""
    import blake3

    digest = (lambda d: blake3.blake3(d).digest()) if algo == "blake3" else (lambda d: hashlib.new(algo, d).digest())
    out, parent = [], b""
    for j in range(len(tokens) // bs):
        extra = salt if j == 0 else b""
        blk = tokens[j * bs : (j + 1) * bs]
        data = bytes([len(parent)]) + parent + struct.pack("<I", len(extra)) + extra + struct.pack(f"<{bs}q", *blk)
        parent = digest(data)
        out.append(parent.hex())
    return out


def test_hashes_are_stable_across_processes_and_algorithms():
    here = {a: [h.hex() for h in BlockHasher(a).chain(list(range(3, 40)), 8, salt_key("t"))] for a in HASH_ALGOS}
    for a in HASH_ALGOS:
        assert here[a] == _expected_hashes(a, list(range(3, 40)), 8, b"salt\x00t")
        assert len(here[a]) == 4 and len(set(here[a])) == 4
        assert len(bytes.fromhex(here[a][0])) == (64 if a == "sha512" else 32)
    assert len({h for hs in here.values() for h in hs}) == 12, "algorithms must give different hashes"
    for seed in ("0", "12345"):  # Python's own hash() is randomised per process: it must not matter
        env = {"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"}
        out = subprocess.run(
            [sys.executable, "-c", HASH_SNIPPET],
            capture_output=True,
            text=True,
            env=env,
            cwd=str(__import__("pathlib").Path(__file__).resolve().parents[2]),
            check=True,
        )
        there = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())
        assert {a: v.split(",") for a, v in there.items()} == here


def test_hash_chain_depends_on_parent_tokens_and_salt():
    h = BlockHasher("sha256")
    base = h.chain([5] * 8 + [6] * 8, 8)
    assert h.chain([5] * 8 + [6] * 8, 8) == base
    assert h.chain([5] * 8 + [6] * 8, 8, salt_key("a"))[1] != base[1], "the salt must propagate down the chain"
    assert h.chain([5] * 8 + [6] * 8, 8, salt_key("a")) != h.chain([5] * 8 + [6] * 8, 8, salt_key("b"))
    assert h.chain([7] * 8 + [6] * 8, 8)[1] != base[1], "a block's hash covers its parent"
    assert h.chain([5] * 7 + [6] + [6] * 8, 8)[0] != base[0]
    assert h(b"", [1 << 40]) != h(b"", [0]), "token ids are not truncated"
    with pytest.raises(ValueError, match="blake3, sha256, sha512"):
        BlockHasher("md5")


# -------------------------------------------------------------- block pool
def test_pool_refcounts_lru_and_duplicates():
    pool = BlockPool(6)
    a = pool.take(3, False)
    for b, h in zip(a, (b"h0", b"h1", b"h2")):
        pool.commit(b, h)
    pool.commit(a[0], b"other")  # an already cached block keeps its hash
    assert pool.hash_of[a[0]] == b"h0"
    c = pool.take(1, False)
    pool.commit(c[0], b"h1")  # same content as a[1]: a[1] stays the cached copy
    assert pool.lookup([b"h0", b"h1", b"zz", b"h2"]) == [a[0], a[1]]
    pool.touch(a[:2])  # a second request shares the first two blocks
    pool.release(a)  # the first request ends: a[2] is the only unreferenced cached block
    assert pool.ref[a[0]] == 1 and pool.num_free == 6 - 2 - 1
    pool.release(c)
    assert c[0] in pool.free, "an uncached block goes back to the free list"
    got = pool.take(4, False)  # the three free blocks first, then the LRU cached one (a[2]) is evicted
    assert a[2] in got and pool.evictions == 1 and b"h2" not in pool.by_hash
    with pytest.raises(AssertionError, match="leak"):
        pool.check_consistent()
    pool.release(got)
    pool.release(a[:2])
    pool.check_consistent()
    # LRU: a sequence's blocks are released tail first, so its last block is evicted first
    assert list(pool.expired) == [a[1], a[0]]
    with pytest.raises(AssertionError, match="released more often"):
        pool.release([a[0]])


def test_pool_retention_interval():
    now = [100.0]
    pool = BlockPool(4, retention_s=5.0, clock=lambda: now[0])
    blocks = pool.take(4, False)
    for i, b in enumerate(blocks):
        pool.commit(b, bytes([i]))
    pool.release(blocks[:2])
    assert pool.available(allow_retained=False) == 0 and pool.available(allow_retained=True) == 2
    with pytest.raises(RuntimeError):
        pool.take(1, allow_retained=False)
    now[0] += 3.0
    pool.release(blocks[2:])
    now[0] += 2.5  # the first two have been released for 5.5 s, the last two for 2.5 s
    assert pool.available(allow_retained=False) == 2
    assert pool.available(allow_retained=False, reuse=[blocks[0]]) == 1
    assert pool.available(allow_retained=False, reuse=[blocks[3]]) == 2, "a retained hit is not counted anyway"
    got = pool.take(3, allow_retained=True)  # the expired ones first, then the oldest retained
    assert set(got) == {blocks[0], blocks[1], blocks[3]} and pool.evictions == 3
    assert pool.lookup([bytes([2])]) == [blocks[2]]


def _req(prompt, outputs=(), salt=None):
    from metadata.sampling_params import SamplingParams

    r = Request("r", "r", 0, None, list(prompt), SamplingParams(cache_salt=salt), None, 8, ())
    r.output_token_ids = list(outputs)
    return r


def test_block_manager_lookup_commit_and_salt():
    bm = BlockManager(16, 4, enable_prefix_caching=True, hash_algo="sha256")
    a = _req(range(3, 13), outputs=[20, 21])  # 12 known tokens: 3 full blocks
    assert bm.lookup(a) == []
    bm.admit(a, 13, [], True)
    bm.commit(a, 7)  # one full block confirmed
    assert a.num_committed_blocks == 1 and len(bm.pool.by_hash) == 1
    bm.commit(a, 12)
    assert len(bm.pool.by_hash) == 3
    assert a.block_hashes == BlockHasher("sha256").chain(list(range(3, 13)) + [20, 21], 4)
    # an equal prompt reuses all but its last token's block; a longer one the whole cached prefix
    same = _req(range(3, 13), outputs=[20, 21])
    assert bm.lookup(same) == a.block_ids[:2]
    longer = _req(list(range(3, 13)) + [20, 21, 99])
    assert bm.lookup(longer) == a.block_ids[:3]
    assert bm.lookup(_req(range(3, 13), salt="tenant")) == [], "another tenant never sees the blocks"
    bm.admit(longer, 15, bm.lookup(longer), False)
    assert longer.block_ids[:3] == a.block_ids[:3] and bm.pool.ref[a.block_ids[0]] == 2
    st = bm.stats()
    assert (st["queries"], st["hits"], st["num_cached_blocks"]) == (12 + 13, 12, 3)
    bm.free(a)
    bm.free(longer)
    bm.check_all_free()
    assert bm.num_free == 16 and bm.usage == 0.0
    off = BlockManager(4, 4)
    r = _req(range(3, 13))
    off.admit(r, 10, [], True)
    off.commit(r, 8)
    assert off.lookup(_req(range(3, 13))) == [] and not off.pool.by_hash


# ------------------------------------------------- engine with a fake worker
class CachingWorker(FakeWorker):
    """The scheduler tests' fake worker, plus: a placed request's KV starts at its cache hit
    (which must hold its own tokens), hit blocks may be shared, and every KV write goes to a
    block that only the writing row holds."""

    def __init__(self, cfg, max_model_len):
        super().__init__(cfg, max_model_len)
        self.holders: dict[int, set[int]] = {}
        self.computed = 0  # query tokens run

    def _claim(self, handle, blocks):
        for b in blocks:
            assert 0 <= b < self.num_blocks and not self.holders.get(b), f"block {b} is not free"
            self.holders[b] = {handle}

    def _release(self, handle):
        row = self.rows.pop(handle, None)
        for b in row.blocks if row else ():
            self.holders[b].discard(handle)

    def execute(self, plan):
        from tests.sim_worker import Row

        for h in plan.finished_handles + plan.preempted_handles:
            self._release(h)
        for nr in plan.new_requests:
            prompt, outputs = nr.token_ids()
            tokens = prompt + outputs
            hit = nr.num_cached_tokens
            assert hit % self.bs == 0 and hit < len(tokens) and hit <= len(nr.block_ids) * self.bs
            for p in range(hit):
                assert self.kv[nr.block_ids[p // self.bs]][p % self.bs] == (tokens[p], p), "wrong cache hit"
            for b in nr.block_ids[: hit // self.bs]:
                self.holders.setdefault(b, set()).add(nr.handle)
            self._claim(nr.handle, nr.block_ids[hit // self.bs :])
            self.rows[nr.handle] = Row(tokens, len(prompt), nr.sampling, list(nr.block_ids), hit)
        for sr in plan.rows:
            row = self.rows[sr.handle]
            blocks = row.blocks + sr.new_block_ids
            self.computed += sr.num_scheduled_tokens
            for p in range(row.num_computed, row.num_computed + sr.num_scheduled_tokens):
                b = blocks[p // self.bs]
                assert b in sr.new_block_ids or self.holders[b] == {sr.handle}, f"KV written into shared block {b}"
        return super().execute(
            msgspec.structs.replace(plan, new_requests=[], finished_handles=[], preempted_handles=[])
        )


class DeferredExecutor(FakeExecutor):
    """Runs a plan when its result is collected: the worker's KV is what finished steps wrote."""

    def __init__(self, cfg, model_dir, max_model_len, device):
        super().__init__(cfg, model_dir, max_model_len, device)
        self.worker = CachingWorker(cfg, max_model_len)

    def submit(self, plan):
        self.submitted += 1
        assert plan.step_id == self.submitted
        return [plan]

    def collect(self, refs):
        return self.worker.execute(refs[0])


def check_cache(engine) -> int:
    """Every cached block holds, in the worker's KV, a confirmed block of some request's tokens."""
    blocks = engine.scheduler.blocks
    bs = blocks.block_size
    if not blocks.caching:
        assert not blocks.pool.hash_of
        return 0
    expected = {}
    for reqs in engine.seen:
        for r in reqs:
            toks = r.prompt_token_ids + r.output_token_ids  # confirmed tokens only
            for j, h in enumerate(blocks.hasher.chain(toks, bs, salt_key(r.params.cache_salt))):
                expected[h] = [(t, j * bs + i) for i, t in enumerate(toks[j * bs : (j + 1) * bs])]
    kv = engine.executor.worker.kv
    for b, h in blocks.pool.hash_of.items():
        assert h in expected, f"block {b} is cached under a hash of no confirmed token prefix"
        assert kv[b] == expected[h], f"cached block {b}'s KV is not its confirmed tokens"
    return len(blocks.pool.hash_of)


@pytest.fixture
def make_engine(fake_model_dir, monkeypatch):  # noqa: F811
    import ray

    import cluster.engine as engine_mod

    monkeypatch.setattr(engine_mod, "RayExecutor", DeferredExecutor)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)

    def make(**options):
        options.setdefault("device", "cpu")
        options.setdefault("load_format", "dummy")
        engine = engine_mod.EngineCore(engine_mod.EngineConfig.from_options(model=str(fake_model_dir), **options))
        step, add = engine.step, engine.add_request
        engine.max_cached_seen = 0
        engine.seen = []  # every request group ever added (released ones too: their blocks stay cached)

        def add_request(rid, prompt, params=None):
            add(rid, prompt, params)
            engine.seen.append(engine.groups[rid])

        def checked_step():
            out = step()
            engine.max_cached_seen = max(engine.max_cached_seen, check_cache(engine))
            return out

        engine.step, engine.add_request = checked_step, add_request
        return engine

    return make


def shared_prefix_workload(rng: random.Random, n: int, bs: int, max_prompt: int, salts=(None,)):
    """System prompts shared by many requests, repeated prompts, lengths on and off block boundaries."""
    from cluster import SamplingParams

    systems = [[rng.randrange(3, VOCAB) for _ in range(L)] for L in (bs, 2 * bs + 1, 3 * bs - 1)]
    reqs, seen = [], []
    for i in range(n):
        kind = rng.random()
        if kind < 0.2 and seen:
            prompt = list(rng.choice(seen))  # a repeated prompt
        else:
            sys_p = rng.choice(systems)
            end = rng.choice([0, 1, bs - len(sys_p) % bs, bs - len(sys_p) % bs + 1, rng.randrange(1, 2 * bs)])
            prompt = sys_p + [rng.randrange(3, VOCAB) for _ in range(end)]
        prompt = prompt[:max_prompt]
        seen.append(prompt)
        kw = dict(
            max_tokens=rng.choice([1, 2, 5, 9, None]),
            temperature=rng.choice([0.0, 0.0, 1.0]),
            seed=rng.randrange(1 << 20),
            cache_salt=rng.choice(salts),
        )
        if rng.random() < 0.3:
            kw["stop_token_ids"] = [rng.randrange(3, VOCAB)]
        if rng.random() < 0.2:
            kw["stop"] = [f"w{rng.randrange(3, VOCAB)}"]
        if rng.random() < 0.15:
            kw["n"] = 2
        reqs.append((f"s{i}", {"prompt_token_ids": prompt}, SamplingParams(**kw)))
    return reqs


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("ci", [0, 1, 2, 4])
def test_workloads_with_prefix_caching_match_reference(make_engine, ci, async_scheduling):
    """Stops, aborts mid-flight, preemption, chunked prefill: outputs exact, cache always confirmed."""
    cfg = dict(CONFIGS[ci])
    engine = make_engine(async_scheduling=async_scheduling, **cfg)
    max_prompt = min(30, cfg["max_model_len"] - 1, cfg["num_kv_blocks"] * cfg["block_size"] - 1)
    if not cfg.get("enable_chunked_prefill", True):
        max_prompt = min(max_prompt, cfg["max_num_batched_tokens"])
    for trial in range(4):
        rng = random.Random(100 * ci + trial)
        make = shared_prefix_workload if trial % 2 == 0 else random_workload
        base = (
            make(rng, 16, cfg["block_size"], max_prompt)
            if make is shared_prefix_workload
            else make(rng, 12, max_prompt)
        )
        reqs = [(f"t{trial}-{rid}", p, sp) for rid, p, sp in base]
        outs, streamed, toks, aborted = run(engine, reqs, rng, abort_p=0.05 if trial >= 2 else 0.0)
        check(engine, reqs, outs, streamed, toks, aborted)
        for rid, _, _ in reqs:
            engine.release(rid)
    st = engine.scheduler.prefix_cache_stats()
    assert st["hits"] > 0 and 0 < st["hit_rate"] < 1 and engine.max_cached_seen > 0
    if ci in (0, 2):
        assert engine.scheduler.num_preemptions > 0


def test_caching_saves_compute_and_equals_no_caching(make_engine):
    from cluster import SamplingParams

    outs, computed = {}, {}
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    system = list(range(3, 3 + 21))  # 5 full blocks of 4 + 1
    prompts = [system + [40 + i] * (i % 6) for i in range(8)] + [system[:20], system[:20], system[:21]]
    for on in (True, False):
        engine = make_engine(enable_prefix_caching=on, block_size=4, num_kv_blocks=64, max_num_seqs=2)
        reqs = [(f"p{i}", p, sp) for i, p in enumerate(prompts)]
        o, *_ = run(engine, reqs)
        outs[on] = [o[f"p{i}"].outputs[0].token_ids for i in range(len(prompts))]
        computed[on] = engine.executor.worker.computed
        engine.scheduler.blocks.check_all_free()
        st = engine.scheduler.prefix_cache_stats()
        assert st["enabled"] == on and (st["hits"] > 0) == on
    assert outs[True] == outs[False]
    assert computed[True] < computed[False] - 5 * 4 * 6


def test_tenants_with_different_salts_never_share_blocks(make_engine):
    from cluster import SamplingParams

    engine = make_engine(block_size=4, num_kv_blocks=64, max_num_seqs=1)
    prompt = list(range(5, 5 + 17))
    shared = {}
    for i, salt in enumerate(["a", "b", "a", None, "b", None]):
        engine.add_request(f"q{i}", prompt, SamplingParams(temperature=0, max_tokens=3, cache_salt=salt))
        while engine.has_unfinished():
            engine.step()
        r = engine.groups[f"q{i}"][0]
        shared[i] = (salt, engine.scheduler.prefix_cache_stats()["hits"])
    hits = [shared[i][1] - (shared[i - 1][1] if i else 0) for i in range(6)]
    assert hits == [0, 0, 16, 0, 16, 16], "a request hits only blocks cached under its own salt"
    assert r.finish_reason == "length"
    assert engine.scheduler.prefix_cache_stats()["num_cached_blocks"] == 3 * 4


def test_retention_interval(make_engine):
    """Released cached blocks outlive a waiting request's need, not a running request's."""
    from cluster import SamplingParams

    engine = make_engine(block_size=4, num_kv_blocks=8, max_num_seqs=4, prefix_cache_retention_interval=30.0)
    now = [0.0]
    pool = engine.scheduler.blocks.pool
    pool.clock = lambda: now[0]
    greedy = SamplingParams(temperature=0, max_tokens=1)
    engine.add_request("a", list(range(3, 19)), greedy)  # 16 tokens: 4 blocks, cached, released
    while engine.has_unfinished():
        engine.step()
    assert len(pool.retained) == 4
    engine.add_request("b", list(range(30, 42)), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    engine.step()  # b takes 3 of the 4 free blocks; growing to 22 tokens it must evict retained ones
    engine.add_request("c", list(range(50, 62)), greedy)  # needs 3 blocks: only retained ones are left
    for _ in range(3):
        engine.step()
    c = engine.groups["c"][0]
    assert c.handle == -1 and not c.finished, "a waiting request must not evict retained blocks"
    while not engine.groups["b"][0].finished:
        engine.step()
    assert engine.scheduler.num_preemptions == 0 and pool.evictions >= 1, "b grew into a retained block"
    assert pool.available(allow_retained=False) < 3, "b's cached blocks are retained too"
    while engine.has_unfinished():  # nothing runs: retention must not leave the engine idle
        engine.step()
    assert c.finished and c.finish_reason == "length"
    engine.scheduler.blocks.check_all_free()


# ------------------------------------------------------- metrics and API
def test_metrics_and_api_fields():
    from cluster.metrics import ServerMetrics
    from cluster.openai_protocol import (
        APIError,
        ChatCompletionRequest,
        CompletionRequest,
        chat_params,
        completion_params,
        decode_request,
    )
    from metadata.sampling_params import SamplingParams, SamplingParamsError

    m = ServerMetrics("m")
    m.update_engine({"prefix_cache": BlockManager(4, 4, True).stats() | {"queries": 200, "hits": 50, "hit_rate": 0.25}})
    text = m.render().decode()
    for line in (
        'syncless:prefix_cache_queries_total{model_name="m"} 200.0',
        'syncless:prefix_cache_hits_total{model_name="m"} 50.0',
        'syncless:prefix_cache_hit_rate{model_name="m"} 0.25',
    ):
        assert line in text
    body = b'{"prompt": "w5 w6", "cache_salt": "tenant-1"}'
    assert completion_params(decode_request(body, CompletionRequest)).cache_salt == "tenant-1"
    chat = b'{"messages": [{"role": "user", "content": "w5"}], "cache_salt": "t2"}'
    assert chat_params(decode_request(chat, ChatCompletionRequest)).cache_salt == "t2"
    assert completion_params(decode_request(b'{"prompt": "w5"}', CompletionRequest)).cache_salt is None
    with pytest.raises(APIError, match="cache_salt"):
        completion_params(decode_request(b'{"prompt": "w5", "cache_salt": ""}', CompletionRequest))
    for bad in ("", "x" * 1025, 7):
        with pytest.raises(SamplingParamsError, match="cache_salt"):
            SamplingParams(cache_salt=bad)
