"""Scheduler, block manager and engine output processing against a simulated worker.

The real ``EngineCore`` runs with its executor replaced by an in-process fake
worker that mirrors the device state of ``workers/`` (rows per handle, token ids,
computed counts, block tables, a paged KV store) and checks every plan: block
ownership is exclusive, upper bounds cover the KV written, input tokens are
known, a sampling row samples exactly at the end of the known tokens, the KV
read back for every row is that row's own tokens (no block reused too early).
Its "model" is a hash of the context (and seed), so every request has one exact
expected output, computed here independently, request by request. Workloads
mix chunked prefill, preemption, stop conditions and aborts; sync and async
scheduling must both match the reference.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field

import pytest

from cluster.detokenizer import find_stop
from metadata.config import EngineConfig
from metadata.wire import SampledRow, StepResult, TokenLogprobs

VOCAB = 64
EOS = 1


def model_token(tokens: list[int], opts, n_out_before: int) -> int:
    """The fake model + sampler: a deterministic function of the context (and seed)."""
    key = repr((tokens, None if opts.temperature == 0 else opts.seed)).encode()
    forbid = set(opts.min_tokens_stop_ids) if n_out_before < opts.min_tokens else set()
    i = 0
    while True:
        h = hashlib.blake2b(key + bytes([i]), digest_size=4).digest()
        tok = int.from_bytes(h, "little") % VOCAB
        if tok not in forbid:
            return tok
        i += 1


@dataclass
class Row:
    tokens: list[int]
    prompt_len: int
    opts: object
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0


class FakeWorker:
    def __init__(self, cfg: EngineConfig, max_model_len: int):
        self.bs = cfg.cache.block_size
        self.num_blocks = cfg.cache.num_kv_blocks
        self.max_rows = cfg.scheduler.max_num_seqs
        self.budget = cfg.scheduler.max_num_batched_tokens
        self.max_model_len = max_model_len
        self.rows: dict[int, Row] = {}
        self.owner: dict[int, int] = {}
        self.kv: dict[int, list] = {b: [None] * self.bs for b in range(self.num_blocks)}
        self.steps = 0
        self.max_batch = 0
        self.lookup = None  # handle -> the driver's Request, set by the test (checks only)

    def _claim(self, handle: int, blocks: list[int]) -> None:
        for b in blocks:
            assert 0 <= b < self.num_blocks, f"block id {b} out of range"
            assert b not in self.owner, f"block {b} given to {handle} while {self.owner[b]} holds it"
            self.owner[b] = handle

    def _release(self, handle: int) -> None:
        row = self.rows.pop(handle, None)
        if row is not None:
            for b in row.blocks:
                del self.owner[b]

    def execute(self, plan) -> StepResult:
        self.steps += 1
        for h in plan.finished_handles + plan.preempted_handles:
            self._release(h)
        for nr in plan.new_requests:
            assert nr.handle not in self.rows, f"handle {nr.handle} placed twice"
            assert len(self.rows) < self.max_rows, "more rows than max_num_seqs"
            tokens = list(nr.prompt_token_ids) + list(nr.output_token_ids)
            assert len(tokens) <= self.max_model_len
            self.rows[nr.handle] = Row(tokens, len(nr.prompt_token_ids), nr.sampling)
            self._claim(nr.handle, nr.block_ids)
            self.rows[nr.handle].blocks = list(nr.block_ids)
        total = sum(r.num_scheduled_tokens for r in plan.rows)
        assert total <= self.budget, f"{total} tokens > max_num_batched_tokens {self.budget}"
        assert len({r.handle for r in plan.rows}) == len(plan.rows), "a handle scheduled twice in one step"
        self.max_batch = max(self.max_batch, len(plan.rows))
        outputs = []
        for sr in plan.rows:
            row = self.rows[sr.handle]
            self._claim(sr.handle, sr.new_block_ids)
            row.blocks += sr.new_block_ids
            assert sr.num_scheduled_tokens >= 1
            seq = row.num_computed + sr.num_scheduled_tokens
            assert sr.seq_len_upper_bound == seq, "without speculative decoding the bound is exact"
            assert seq <= len(row.tokens), "scheduled tokens the worker does not know yet"
            assert len(row.blocks) * self.bs >= seq, "blocks do not cover the sequence"
            assert seq <= self.max_model_len
            for p in range(row.num_computed, seq):
                self.kv[row.blocks[p // self.bs]][p % self.bs] = (row.tokens[p], p)
            ctx = [self.kv[row.blocks[p // self.bs]][p % self.bs] for p in range(seq)]
            assert ctx == [(t, p) for p, t in enumerate(row.tokens[:seq])], "KV of this row was overwritten"
            row.num_computed = seq
            req = self.lookup(sr.handle) if self.lookup else None
            if self.lookup:
                assert req is not None and not req.finished, "a row for a request the driver no longer runs"
            if sr.sample:
                assert seq == len(row.tokens), "a sampling row must end at the last known token"
                if req is not None:
                    assert len(row.tokens) - row.prompt_len < req.max_tokens, "sampled beyond max_tokens"
                tok = model_token(row.tokens, row.opts, len(row.tokens) - row.prompt_len)
                row.tokens.append(tok)
                lp = None
                if row.opts.num_logprobs >= 0:
                    lp = [TokenLogprobs(-(tok % 5) / 4, 1, [tok][: row.opts.num_logprobs], [-(tok % 5) / 4][: row.opts.num_logprobs])]
                outputs.append(SampledRow(handle=sr.handle, token_ids=[tok], logprobs=lp))
            else:
                assert seq < len(row.tokens), "a non-sampling row must be a prefill chunk"
        return StepResult(step_id=plan.step_id, outputs=outputs)


class FakeExecutor:
    instances: list["FakeExecutor"] = []

    def __init__(self, cfg, model_dir, max_model_len, device):
        self.worker = FakeWorker(cfg, max_model_len)
        self.num_blocks = cfg.cache.num_kv_blocks
        self.submitted = 0
        FakeExecutor.instances.append(self)

    def submit(self, plan):
        self.submitted += 1
        assert plan.step_id == self.submitted, "submitted plans must have consecutive step ids"
        return [self.worker.execute(plan)]  # workers run plans in submission order

    def collect(self, refs):
        return refs[0]

    def shutdown(self):
        pass


@pytest.fixture(scope="module")
def fake_model_dir(tmp_path_factory):
    from tests.checkpoints import write_tokenizer

    d = tmp_path_factory.mktemp("fake-model")
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 16,
        "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "max_position_embeddings": 512, "eos_token_id": EOS, "bos_token_id": 0,
    }))
    write_tokenizer(d, VOCAB)
    return d


@pytest.fixture
def make_engine(fake_model_dir, monkeypatch):
    import ray

    import cluster.engine as engine_mod

    monkeypatch.setattr(engine_mod, "RayExecutor", FakeExecutor)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)

    def make(**options):
        options.setdefault("device", "cpu")
        options.setdefault("load_format", "dummy")
        # the fake worker asserts exclusive block ownership; shared cached blocks are
        # covered by tests/test_prefix_cache.py, whose fake worker models sharing
        options.setdefault("enable_prefix_caching", False)
        cfg = EngineConfig.from_options(model=str(fake_model_dir), **options)
        engine = engine_mod.EngineCore(cfg)
        engine.executor.worker.lookup = engine.scheduler.by_handle.get
        return engine

    return make


# --------------------------------------------------------------------- reference
def cont(tok, prompt, out):
    return tok.decode(prompt + out, skip_special_tokens=True)[len(tok.decode(prompt, skip_special_tokens=True)):]


def reference(tok, req, max_model_len: int, capacity: int):
    """(token ids, text, finish reason, stop reason) of one sequence, computed alone."""
    p = req.params
    prompt = req.prompt_token_ids
    limit = min(max_model_len, capacity)
    max_tokens = min(p.max_tokens or limit, limit - len(prompt))
    out: list[int] = []
    text = ""
    while True:
        tok_id = model_token(prompt + out, req.options, len(out))
        out.append(tok_id)
        n = len(out)
        reason = stop_reason = None
        if n >= p.min_tokens:
            if not p.ignore_eos and tok_id == EOS:
                reason = "stop"
            elif tok_id in p.stop_token_ids:
                reason, stop_reason = "stop", tok_id
        if reason is None and (n >= max_tokens or len(prompt) + n >= max_model_len):
            reason = "length"
        text_ids = out[:-1] if reason == "stop" and not p.include_stop_str_in_output else out
        new_text = cont(tok, prompt, text_ids)
        new_len = len(new_text) - len(text)
        text = new_text
        if p.stop and n >= p.min_tokens:
            hit = find_stop(text, new_len, p.stop)
            if hit is not None:
                pos, s = hit
                text = text[: pos + len(s) if p.include_stop_str_in_output else pos]
                reason, stop_reason = "stop", s
        if reason:
            return out, text, reason, stop_reason


# --------------------------------------------------------------------- workloads
def random_workload(rng: random.Random, n_req: int, max_prompt: int):
    from cluster import SamplingParams

    reqs = []
    for i in range(n_req):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, max_prompt + 1))]
        kw = dict(max_tokens=rng.choice([1, 2, 3, 5, 8, 13, 21, None]), temperature=rng.choice([0.0, 1.0]))
        if rng.random() < 0.5:
            kw["seed"] = rng.randrange(1 << 20)
        if rng.random() < 0.3:
            kw["ignore_eos"] = True
        if rng.random() < 0.3:
            kw["stop_token_ids"] = [rng.randrange(3, VOCAB) for _ in range(2)]
        if rng.random() < 0.3:
            kw["stop"] = [f"w{rng.randrange(3, VOCAB)}", f"{rng.randrange(3, 9)} w"]
            kw["include_stop_str_in_output"] = rng.random() < 0.5
        if rng.random() < 0.3 and kw["max_tokens"]:
            kw["min_tokens"] = rng.randrange(0, kw["max_tokens"] + 1)
        if rng.random() < 0.2:
            kw["n"] = 2
            kw["temperature"] = 1.0
        if rng.random() < 0.2:
            kw["logprobs"] = rng.choice([0, 1])
        reqs.append((f"r{i}", {"prompt_token_ids": prompt}, SamplingParams(**kw)))
    return reqs


def run(engine, reqs, rng: random.Random | None = None, abort_p: float = 0.0, max_steps: int = 20000):
    """Add requests over time, step to completion, abort some; returns outputs and streamed text."""
    pending = list(reqs)
    streamed: dict[tuple[str, int], str] = {}
    stream_toks: dict[tuple[str, int], list[int]] = {}
    aborted = set()
    steps = 0
    while pending or engine.has_unfinished():
        steps += 1
        assert steps < max_steps, "the engine stopped making progress"
        if pending and (rng is None or rng.random() < 0.5):
            for _ in range(1 if rng else len(pending)):
                rid, p, sp = pending.pop(0)
                engine.add_request(rid, p, sp)
                if not pending:
                    break
        for d in engine.step():
            key = (d.request_id, d.index)
            streamed[key] = streamed.get(key, "") + d.text
            stream_toks.setdefault(key, []).extend(d.token_ids)
        if rng is not None and abort_p and rng.random() < abort_p:
            live = [rid for rid, rs in engine.groups.items() if not all(r.finished for r in rs)]
            if live:
                rid = rng.choice(live)
                assert engine.abort(rid)
                aborted.add(rid)
    outs = {}
    for rid, _, _ in reqs:
        outs[rid] = engine.output(rid)
    return outs, streamed, stream_toks, aborted


def check(engine, reqs, outs, streamed, stream_toks, aborted):
    tok = engine.tokenizer
    blocks = engine.scheduler.blocks
    capacity = blocks.num_blocks * blocks.block_size
    for rid, _, _ in reqs:
        out = outs[rid]
        assert out.finished
        for r, c in zip(engine.groups[rid], out.outputs):
            exp_ids, exp_text, exp_reason, exp_stop = reference(tok, r, engine.max_model_len, capacity)
            key = (rid, c.index)
            assert stream_toks.get(key, []) == c.token_ids
            if c.finish_reason == "abort":
                assert rid in aborted
                assert c.token_ids == exp_ids[: len(c.token_ids)] and len(c.token_ids) < len(exp_ids) + 1
                continue
            assert (c.token_ids, c.finish_reason, c.stop_reason) == (exp_ids, exp_reason, exp_stop), rid
            assert c.text == exp_text, rid
            assert streamed.get(key, "") == c.text, rid
            if r.params.logprobs is not None:
                assert len(c.logprobs) == len(c.token_ids)
                assert c.cumulative_logprob == pytest.approx(sum(-(t % 5) / 4 for t in c.token_ids))
    blocks.check_all_free()
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert not engine.in_flight
    assert not engine.scheduler.by_handle, "finished requests are still referenced by handle"


CONFIGS = [
    dict(block_size=4, num_kv_blocks=12, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=40),
    dict(block_size=2, num_kv_blocks=40, max_num_batched_tokens=7, max_num_seqs=8, max_model_len=64),
    dict(block_size=8, num_kv_blocks=6, max_num_batched_tokens=64, max_num_seqs=3, max_model_len=48),
    dict(block_size=4, num_kv_blocks=64, max_num_batched_tokens=32, max_num_seqs=16, max_model_len=32),
    dict(block_size=4, num_kv_blocks=16, max_num_batched_tokens=40, max_num_seqs=6, max_model_len=40,
         enable_chunked_prefill=False),
]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("ci", range(len(CONFIGS)))
def test_random_workloads_match_reference(make_engine, ci, async_scheduling):
    cfg = dict(CONFIGS[ci])
    engine = make_engine(async_scheduling=async_scheduling, **cfg)
    max_prompt = min(30, cfg["max_model_len"] - 1, cfg["num_kv_blocks"] * cfg["block_size"] - 1)
    if not cfg.get("enable_chunked_prefill", True):
        max_prompt = min(max_prompt, cfg["max_num_batched_tokens"])
    total_preempt = 0
    for trial in range(6):
        rng = random.Random(1000 * ci + trial)
        reqs = [(f"t{trial}-{rid}", p, sp) for rid, p, sp in random_workload(rng, 14, max_prompt)]
        outs, streamed, toks, aborted = run(engine, reqs, rng, abort_p=0.04 if trial % 2 else 0.0)
        check(engine, reqs, outs, streamed, toks, aborted)
        for rid, _, _ in reqs:
            engine.release(rid)
        total_preempt = engine.scheduler.num_preemptions
    if ci in (0, 2):
        assert total_preempt > 0, "this configuration should preempt"
    assert not engine.groups and not engine.outputs.detok


def test_sync_and_async_agree_token_for_token(make_engine):
    outs, sync_steps = {}, 0
    for mode in (False, True):
        engine = make_engine(async_scheduling=mode, **CONFIGS[0])
        reqs = random_workload(random.Random(7), 20, 30)
        o, *_ = run(engine, reqs)
        outs[mode] = {rid: [(c.token_ids, c.text, c.finish_reason) for c in v.outputs] for rid, v in o.items()}
        steps = FakeExecutor.instances[-1].submitted
        if mode:
            assert steps >= sync_steps  # the async engine schedules ahead (some plans are then empty-handed)
        sync_steps = steps
    assert outs[False] == outs[True]


def test_async_keeps_two_plans_in_flight(make_engine):
    from cluster import SamplingParams

    engine = make_engine(async_scheduling=True, **CONFIGS[3])
    engine.add_request("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    engine.step()
    # the next plan(s) went out before the first result was processed
    assert len(engine.in_flight) >= 1
    r = engine.groups["a"][0]
    assert r.num_placeholders == len(engine.in_flight)
    while engine.has_unfinished():
        engine.step()
    out = engine.output("a").outputs[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"
    engine.scheduler.blocks.check_all_free()


def test_finished_request_in_flight_token_is_dropped(make_engine):
    """EOS / stop token found in result N while plan N+1 already samples for it."""
    from cluster import SamplingParams

    for mode in (False, True):
        engine = make_engine(async_scheduling=mode, **CONFIGS[3])
        prompt = [7, 8, 9]
        ref = [model_token(prompt, engine_opts_greedy(), 0)]
        for i in range(1, 10):
            ref.append(model_token(prompt + ref, engine_opts_greedy(), i))
        stop_tok = ref[3]
        first = ref.index(stop_tok)
        engine.add_request("s", prompt, SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_tok],
                                                       ignore_eos=True))
        got = []
        while engine.has_unfinished():
            for d in engine.step():
                got += d.token_ids
        out = engine.output("s").outputs[0]
        assert out.token_ids == got == ref[: first + 1]
        assert out.finish_reason == "stop" and out.stop_reason == stop_tok
        engine.scheduler.blocks.check_all_free()


def engine_opts_greedy():
    from metadata.wire import SamplingOptions

    return SamplingOptions(0.0, 1.0, 0, 0.0, 0, 1.0, 0.0, 0.0, 0, [], -1)


def test_request_longer_than_the_cache_finishes(make_engine):
    """A sequence that would outgrow the whole KV cache ends with 'length', never hangs."""
    from cluster import SamplingParams
    from cluster.input_processor import InvalidRequestError

    for mode in (False, True):
        engine = make_engine(async_scheduling=mode, block_size=4, num_kv_blocks=5, max_model_len=64)
        with pytest.raises(InvalidRequestError, match="KV cache holds only 20 tokens"):
            engine.add_request("big", list(range(3, 25)), SamplingParams(max_tokens=2))
        reqs = [("g", [5] * 12, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)),
                ("h", [6] * 3, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))]
        outs, streamed, toks, aborted = run(engine, reqs)
        check(engine, reqs, outs, streamed, toks, aborted)
        assert len(outs["g"].outputs[0].token_ids) == 20 - 12
        assert len(outs["h"].outputs[0].token_ids) == 20 - 3


def test_no_chunked_prefill_recompute_fits_the_budget(make_engine):
    """Without chunked prefill a preempted request recomputes prompt + outputs in one step."""
    from cluster import SamplingParams

    for mode in (False, True):
        engine = make_engine(async_scheduling=mode, block_size=2, num_kv_blocks=14, max_num_batched_tokens=10,
                             enable_chunked_prefill=False)  # max_model_len: the model's 512
        reqs = [(f"q{i}", [3 + i] * (4 + i), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
                for i in range(4)]
        outs, streamed, toks, aborted = run(engine, reqs)
        check(engine, reqs, outs, streamed, toks, aborted)
        assert engine.scheduler.num_preemptions > 0


def test_abort_everything_mid_flight(make_engine):
    from cluster import SamplingParams

    for mode in (False, True):
        engine = make_engine(async_scheduling=mode, **CONFIGS[0])
        for i in range(6):
            engine.add_request(f"a{i}", [3 + i] * (5 + 3 * i), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
        for _ in range(4):
            engine.step()
        placed = {r.handle for i in range(6) for r in engine.groups[f"a{i}"] if r.handle >= 0}
        assert placed
        for i in range(6):
            assert engine.abort(f"a{i}")
        assert not engine.abort("nope")
        for _ in range(5):
            engine.step()
        assert not engine.has_unfinished()
        engine.scheduler.blocks.check_all_free()
        for i in range(6):
            out = engine.output(f"a{i}")
            assert out.finished and out.outputs[0].finish_reason == "abort"
        # the workers learn about every release with the next plan
        engine.add_request("next", [4, 5], SamplingParams(temperature=0, max_tokens=2))
        while engine.has_unfinished():
            engine.step()
        assert not placed & set(FakeExecutor.instances[-1].worker.rows)


# ------------------------------------------------------------- block manager unit
def test_block_manager_accounting():
    from cluster.block_manager import BlockManager
    from cluster.request import Request

    bm = BlockManager(10, 4)
    r = Request("x", "x", 0, None, [1], None, None, 1, ())
    assert bm.blocks_needed(r, 0) == 0 and bm.blocks_needed(r, 1) == 1 and bm.blocks_needed(r, 4) == 1
    assert bm.blocks_needed(r, 5) == 2
    new = bm.allocate(r, 9)
    assert len(new) == 3 and r.block_ids == new and bm.num_free == 7
    assert bm.allocate(r, 12) == [] and bm.allocate(r, 13) != []
    assert not bm.can_allocate(r, 4 * 11)
    with pytest.raises(RuntimeError):
        bm.allocate(r, 4 * 11)
    with pytest.raises(AssertionError, match="leak"):
        bm.check_all_free()
    bm.free(r)
    assert r.block_ids == [] and bm.num_free == 10
    bm.check_all_free()
    assert bm.usage == 0.0
