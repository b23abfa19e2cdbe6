"""What a mixed-step CUDA graph records (``workers.mixed_graphs``), run eagerly on the CPU: a
step's inputs loaded into the static buffers, padded to the token bucket and its request
count, give the model's own forward on the real tokens, and the padding writes no KV.
(Capture and replay themselves: ``test_gpu_mixed_graphs.py``.)"""

import pytest
import torch

from metadata.config import EngineConfig
from metadata.wire import NewRequest, SamplingOptions, ScheduledRow, StepPlan

BS = 8
GREEDY = SamplingOptions(0.0, 1.0, 0, 0.0, 0, 1.0, 0.0, 0.0, 0, [], -1)


def _runner(model_dir: str):
    from workers.distributed import TPGroup
    from workers.model_runner import ModelRunner

    cfg = EngineConfig.from_options(num_kv_blocks=64, block_size=BS, max_num_seqs=6, dtype="float32")
    r = ModelRunner(cfg, model_dir, torch.device("cpu"), TPGroup(), 256)
    r.init_kv_cache(64)
    return r


def _mixed_step(r, mixed=None):
    """A prefill of request 0, then a step with its decode token, a new 11-token prompt and
    the first chunk of a 20-token one: the step's ``StepInputs`` (built into ``mixed``'s
    static buffers when given)."""
    from workers.step_inputs import build_step_inputs

    p0 = [3 + (7 * i) % 50 for i in range(13)]
    new0 = NewRequest.of(0, p0, [], GREEDY, [0, 1, 2])
    r.execute(StepPlan(1, new_requests=[new0], rows=[ScheduledRow(0, 13, 13, [], True)]))
    news = [
        NewRequest.of(1, [5 + i for i in range(11)], [], GREEDY, [8, 9]),
        NewRequest.of(2, [40 - i for i in range(20)], [], GREEDY, [16, 17, 18]),
    ]
    for req in news:
        r.state.add(req)
    rows = [ScheduledRow(0, 1, 14, [], True), ScheduledRow(1, 11, 11, [], True), ScheduledRow(2, 6, 6, [], False)]
    plan = StepPlan(2, rows=rows)
    return build_step_inputs(plan, r.state, BS, r.bounds_are_exact, max_len=r.max_model_len, mixed=mixed)


@pytest.mark.parametrize("in_place", [False, True], ids=["copied", "built-in-place"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_padded_static_forward_is_the_models_forward(ckpt_dir, arch, in_place):
    """``in_place``: the step's inputs are built straight into the static buffers (what the
    runner does when the step will replay a mixed graph), so ``load`` copies none of them."""
    from workers.mixed_graphs import MixedGraphs

    torch.manual_seed(0)
    r = _runner(str(ckpt_dir(arch)))
    mg = MixedGraphs(r.model, r.kv_caches, 64, 6, r.max_model_len, r.max_blocks_per_req, r.device, True)
    if in_place:
        mg.graphs = {t: None for t in mg.buckets}  # as if captured: fits() picks the graphs
    inp = _mixed_step(r, mg if in_place else None)
    assert inp.mixed_graph == in_place and (inp.input_ids.data_ptr() == mg.input_ids.data_ptr()) == in_place
    assert (inp.meta.slot_mapping.data_ptr() == mg.slots.data_ptr()) == in_place
    t_real, n = inp.input_ids.shape[0], inp.meta.num_reqs
    before = [(k.clone(), v.clone()) for k, v in r.kv_caches]
    with torch.inference_mode():
        t = mg.load(inp.input_ids, inp.positions, inp.meta)
        assert t > t_real and mg.rows(t) > n  # both paddings exercised
        got = mg.static_forward(t)[:t_real].clone()
        written = [(k.clone(), v.clone()) for k, v in r.kv_caches]
        for (k, v), (k0, v0) in zip(r.kv_caches, before):
            k.copy_(k0)
            v.copy_(v0)
        want = r.model(inp.input_ids, inp.positions, inp.meta, r.kv_caches)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    slots = inp.meta.slot_mapping[:t_real]
    for (k, v), (kw, vw), (k0, _) in zip(r.kv_caches, written, before):
        torch.testing.assert_close(kw, k, atol=2e-5, rtol=1e-4)  # the same KV at the real slots
        torch.testing.assert_close(vw, v, atol=2e-5, rtol=1e-4)
        untouched = torch.ones(k0.shape[0] * BS, dtype=torch.bool)
        untouched[slots] = False
        flat = kw.reshape(-1, *kw.shape[2:])
        assert torch.equal(flat[untouched], k0.reshape(-1, *k0.shape[2:])[untouched])  # padding wrote nothing


def test_a_step_over_the_request_bound_is_refused(ckpt_dir):
    from workers.mixed_graphs import MixedGraphs

    r = _runner(str(ckpt_dir("llama")))
    inp = _mixed_step(r)
    mg = MixedGraphs(r.model, r.kv_caches, 64, 2, r.max_model_len, r.max_blocks_per_req, r.device, True)
    with pytest.raises(ValueError, match="3 requests exceeds max_num_seqs=2"):
        mg.load(inp.input_ids, inp.positions, inp.meta)


def test_logits_graphs_record_the_sampled_rows_logits(ckpt_dir):
    """With ``logits_rows`` the recorded forward ends in the logits at the static sampled
    positions: the step's own logits rows, and stale padding indices past the bucket read a
    real row instead of out of bounds."""
    from workers.mixed_graphs import MixedGraphs, mixed_graph_output_bytes

    torch.manual_seed(0)
    r = _runner(str(ckpt_dir("qwen3")))
    mg = MixedGraphs(r.model, r.kv_caches, 64, 6, r.max_model_len, r.max_blocks_per_req, r.device, True, logits_rows=6)
    mg.graphs = {t: None for t in mg.buckets}
    mg.logits_idx.fill_(10**6)  # stale indices from a larger step
    inp = _mixed_step(r, mg)
    n = inp.logits_idx.shape[0]
    assert 0 < n < 6
    # the step's input preparation wrote its sampled-token indices into the graph's buffer
    assert inp.logits_idx.data_ptr() == mg.logits_idx.data_ptr() and (mg.logits_idx[n:] == 10**6).all()
    before = [(k.clone(), v.clone()) for k, v in r.kv_caches]
    with torch.inference_mode():
        t = mg.load(inp.input_ids, inp.positions, inp.meta)
        got = mg.static_forward(t)
        assert got.shape == (mg.logits_rows_of(t), r.arch.vocab_size) and got.dtype == torch.float32
        for (k, v), (k0, v0) in zip(r.kv_caches, before):
            k.copy_(k0)
            v.copy_(v0)
        hidden = r.model(inp.input_ids, inp.positions, inp.meta, r.kv_caches)
        want = r.model.compute_logits(hidden[inp.logits_idx])
    torch.testing.assert_close(got[:n], want, atol=2e-5, rtol=1e-4)
    assert torch.isfinite(got[n:]).all()  # the padding rows read real hidden states
    # the reserve: one bucket's logits and argmax (shared), not a hidden state a bucket
    row = 4 * r.arch.vocab_size
    assert mixed_graph_output_bytes(64, row, 6) == -(-6 * row // 512) * 512 + 512
    assert mixed_graph_output_bytes(64, row) == sum(mg.buckets) * row
