"""Steps that sample by temperature only read their rows' options where the placement wrote
them (``DeviceState.option_table``) and commit their tokens from the sampler: nothing is
gathered and no separate commit runs, and the tokens, the token table and the outputs are
those of the gathered path. Any other option (top-k, penalties, ...) still gathers."""

from __future__ import annotations

import pytest
import torch

from metadata.config import EngineConfig
from metadata.wire import NewRequest, SamplingOptions, ScheduledRow, StepPlan

BS = 8


def _opts(temperature: float, seed: int, **kw) -> SamplingOptions:
    o = dict(top_p=1.0, top_k=0, min_p=0.0, rep=1.0, pres=0.0, freq=0.0, logprobs=-1) | kw
    return SamplingOptions(
        temperature, o["top_p"], o["top_k"], o["min_p"], seed, o["rep"], o["pres"], o["freq"], 0, [], o["logprobs"]
    )


def _run(model_dir: str, options: list[SamplingOptions], lazy: bool, monkeypatch) -> tuple:
    """Three prompts placed together, then four decode steps; the sampled tokens of every
    step, the token table, and whether the first step gathered the options."""
    from workers import model_runner
    from workers.distributed import TPGroup
    from workers.sampling_inputs import build_sampling_batch

    def build(*args, lazy=False, **kw):
        return build_sampling_batch(*args, lazy=lazy and allowed, **kw)

    allowed = lazy
    monkeypatch.setattr(model_runner, "build_sampling_batch", build)
    cfg = EngineConfig.from_options(num_kv_blocks=32, block_size=BS, max_num_seqs=4, dtype="float32")
    r = model_runner.ModelRunner(cfg, model_dir, torch.device("cpu"), TPGroup(), 128)
    r.init_kv_cache(32)
    prompts = [[3 + (5 * i + j) % 60 for j in range(9 + i)] for i in range(3)]
    news = [NewRequest.of(i, p, [], o, [3 * i, 3 * i + 1, 3 * i + 2]) for i, (p, o) in enumerate(zip(prompts, options))]
    rows = [ScheduledRow(i, len(p), len(p), [], True) for i, p in enumerate(prompts)]
    out = [r.execute(StepPlan(1, new_requests=news, rows=rows))]
    gathered = r.state.option_tensors.floats is not None
    for step in range(4):
        rows = [ScheduledRow(i, 1, len(p) + 1 + step, [], True) for i, p in enumerate(prompts)]
        out.append(r.execute(StepPlan(2 + step, rows=rows)))
    tokens = [[(s.handle, s.token_ids, s.logprobs) for s in res.outputs] for res in out]
    return tokens, r.state.token_ids.clone(), gathered


@pytest.mark.parametrize(
    "options",
    [
        [_opts(0.0, 1), _opts(0.8, 2), _opts(1.3, 3)],  # greedy and temperature rows
        [_opts(0.7, 4, logprobs=2), _opts(1.0, 5), _opts(0.0, 6, logprobs=0)],  # logprobs need no option
        [_opts(0.0, 7), _opts(0.0, 8), _opts(0.0, 9)],  # all greedy: argmax, committed apart
    ],
    ids=["temperature", "logprobs", "greedy"],
)
def test_temperature_steps_read_the_table_and_match_the_gathered_path(ckpt_dir, options, monkeypatch):
    model = str(ckpt_dir("llama"))
    lazy_tokens, lazy_table, lazy_gathered = _run(model, options, True, monkeypatch)
    ref_tokens, ref_table, ref_gathered = _run(model, options, False, monkeypatch)
    assert not lazy_gathered and ref_gathered
    assert lazy_tokens == ref_tokens
    assert torch.equal(lazy_table, ref_table)  # the sampler's commits: the same token table
    assert len({tuple(t) for step in lazy_tokens for _, t, _ in step}) > 1  # (tokens, not one id)


@pytest.mark.parametrize(
    "other", [dict(top_k=5), dict(top_p=0.9), dict(min_p=0.1), dict(rep=1.2), dict(pres=0.5)], ids=str
)
def test_any_other_option_gathers(ckpt_dir, other, monkeypatch):
    options = [_opts(0.8, 1), _opts(0.9, 2, **other), _opts(0.0, 3)]
    model = str(ckpt_dir("llama"))
    lazy_tokens, lazy_table, gathered = _run(model, options, True, monkeypatch)
    ref_tokens, ref_table, _ = _run(model, options, False, monkeypatch)
    assert gathered
    assert lazy_tokens == ref_tokens and torch.equal(lazy_table, ref_table)
