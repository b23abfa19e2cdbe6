"""A simulated worker for the scheduler tests (``tests/engine/test_scheduler.py``, ``test_output_ordering``,
``test_prefix_cache``): the engine, its scheduler, block manager and output processing run for real.

The real ``EngineCore`` runs with its executor replaced by an in-process fake
worker that mirrors the device state of ``workers/`` (rows per handle, token ids,
computed counts, block tables, a paged KV store) and checks every plan: block
ownership is exclusive, upper bounds cover the KV written, input tokens are
known, a sampling row samples exactly at the end of the known tokens, the KV
read back for every row is that row's own tokens (no block reused too early).
Its "model" is a hash of the context (and seed), so every request has one exact
expected output, computed here independently, request by request (``reference``).
``random_workload`` mixes chunked prefill, preemption, stop conditions and aborts;
``run`` drives the engine through one, ``check`` compares every output with its reference.
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
            prompt, outputs = nr.token_ids()
            tokens = prompt + outputs
            assert len(tokens) <= self.max_model_len
            self.rows[nr.handle] = Row(tokens, len(prompt), nr.sampling)
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
                    lp = [
                        TokenLogprobs(
                            -(tok % 5) / 4, 1, [tok][: row.opts.num_logprobs], [-(tok % 5) / 4][: row.opts.num_logprobs]
                        )
                    ]
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
    (d / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "vocab_size": VOCAB,
                "hidden_size": 16,
                "intermediate_size": 32,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "max_position_embeddings": 512,
                "eos_token_id": EOS,
                "bos_token_id": 0,
            }
        )
    )
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
        # covered by tests/engine/test_prefix_cache.py, whose fake worker models sharing
        options.setdefault("enable_prefix_caching", False)
        cfg = EngineConfig.from_options(model=str(fake_model_dir), **options)
        engine = engine_mod.EngineCore(cfg)
        engine.executor.worker.lookup = engine.scheduler.by_handle.get
        return engine

    return make


# --------------------------------------------------------------------- reference
def cont(tok, prompt, out):
    return tok.decode(prompt + out, skip_special_tokens=True)[len(tok.decode(prompt, skip_special_tokens=True)) :]


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
    dict(
        block_size=4,
        num_kv_blocks=16,
        max_num_batched_tokens=40,
        max_num_seqs=6,
        max_model_len=40,
        enable_chunked_prefill=False,
    ),
]
