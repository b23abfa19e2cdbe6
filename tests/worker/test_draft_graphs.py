"""What a draft-proposal CUDA graph records (``workers.draft_graphs``), run eagerly on the CPU:
inside a real ``ModelRunner``'s draft-model steps, a proposal through ``ProposeGraphs`` (its
window built into the draft decode graphs' static inputs, three rows padded to the captured
four) writes the same drafts, draft distributions and draft KV as the proposer's piece-by-piece
path, greedy and sampled rows together, with the torch references and with the Triton
sampling and inputs kernels (interpreted: the padded rows' masking is theirs on a GPU).
(Capture and replay: ``test_gpu_spec.py``.)"""

import pytest
import torch

from metadata.config import EngineConfig
from metadata.wire import NewRequest, SamplingOptions, ScheduledRow, StepPlan
from tests.interpreted import delegate_all

BS, ROWS = 8, 3
PROMPT = [5, 9, 17, 33, 2, 41, 7, 11, 13, 60, 3, 5, 9, 17, 33, 2]


class _EagerReplay:
    """A graph table entry that runs what the graph would record."""

    def __init__(self, pg, b: int, bound: int):
        self.pg, self.b, self.bound = pg, b, bound

    def replay(self) -> None:
        self.pg.static_propose(self.b, self.bound)


def _snapshot(st, prop):
    return st.token_ids.clone(), st.draft_probs.clone(), [(k.clone(), v.clone()) for k, v in prop.kv_caches]


def _restore(st, prop, snap) -> None:
    st.token_ids.copy_(snap[0])
    st.draft_probs.copy_(snap[1])
    for (k, v), (k0, v0) in zip(prop.kv_caches, snap[2]):
        k.copy_(k0)
        v.copy_(v0)


@pytest.mark.parametrize("K", [3, 4])
@pytest.mark.parametrize("triton", [False, True], ids=["references", "triton"])
@pytest.mark.parametrize("temps", [(0.0, 0.9, 0.0), (0.0, 0.0, 0.0)], ids=["mixed", "greedy"])
def test_the_proposal_graph_records_the_piece_by_piece_proposal(ckpt_dir, temps, triton, K, monkeypatch):
    import kernels.spec_ops as spec_ops
    from workers.cuda_graphs import DecodeGraphs
    from workers.distributed import TPGroup
    from workers.draft_graphs import ProposeGraphs
    from workers.model_runner import ModelRunner

    torch.manual_seed(0)
    torch.set_num_threads(1)
    monkeypatch.setattr(spec_ops, "_use_triton", (lambda t: True) if triton else (lambda t: t.is_cuda))
    model = str(ckpt_dir("llama"))
    cfg = EngineConfig.from_options(
        num_kv_blocks=64,
        block_size=BS,
        max_num_seqs=4,
        dtype="float32",
        speculative_method="draft_model",
        speculative_model=model,
        num_speculative_tokens=K,
    )
    r = ModelRunner(cfg, model, torch.device("cpu"), TPGroup(), 256)
    r.init_kv_cache(64)
    st, prop = r.state, r.spec.proposer
    decode = DecodeGraphs(
        r.spec.draft_model, prop.kv_caches, 4, r.spec.max_position, BS, r.max_blocks_per_req,
        r.device, False, query_lens=(1, K + 2), logits=False,
    )  # fmt: skip
    pg = ProposeGraphs(prop, decode, st.token_ids, st.ensure_draft_probs(K))
    pg.graphs = {(b, L): _EagerReplay(pg, b, L) for b in decode.sizes for L in decode.buckets}
    compared = []
    piece_by_piece = prop.propose

    def both(st_, inp, s_rows, known, ds):
        if ds is None or not inp.max_drafts:
            return piece_by_piece(st_, inp, s_rows, known, ds)
        before = _snapshot(st, prop)
        piece_by_piece(st_, inp, s_rows, known, ds)
        want = _snapshot(st, prop)
        _restore(st, prop, before)
        prop.graphs, prop.propose_graphs = decode, pg
        try:
            piece_by_piece(st_, inp, s_rows, known, ds)
        finally:
            prop.graphs, prop.propose_graphs = None, None
        compared.append((want, _snapshot(st, prop)))

    prop.propose = both
    opts = [SamplingOptions(t, 1.0, 0, 0.0, 100 + i, 1.0, 0.0, 0.0, 0, [], -1) for i, t in enumerate(temps)]
    new = [NewRequest.of(h, PROMPT[h:] + PROMPT[:h], [], opts[h], [h * 8 + i for i in range(8)]) for h in range(ROWS)]
    P = len(PROMPT)
    r.execute(StepPlan(1, new_requests=new, rows=[ScheduledRow(h, P, P, [], True) for h in range(ROWS)]))
    for s in range(3):
        ub = P + 1 + (s + 1) * (1 + K)
        rows = [ScheduledRow(h, 1 + K, ub, [], True, num_draft_tokens=K) for h in range(ROWS)]
        r.execute(StepPlan(2 + s, rows=rows))
    assert len(compared) == 3 and pg.replays == 3  # every verify step's proposal took the graph
    for want, got in compared:
        assert torch.equal(got[0], want[0])  # the drafts, where the next step reads them
        torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=1e-5)  # sampled rows' distributions
        for (k, v), (kw, vw) in zip(got[2], want[2]):
            torch.testing.assert_close(k, kw, atol=1e-5, rtol=1e-4)  # the draft's KV
            torch.testing.assert_close(v, vw, atol=1e-5, rtol=1e-4)


delegate_all(globals(), __file__)  # parent process: each test reports its child run
