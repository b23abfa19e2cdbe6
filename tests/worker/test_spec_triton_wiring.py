"""The speculative kernels wired into a real worker: a ``ModelRunner`` whose speculative
dispatch (``kernels.spec_ops``) runs the Triton kernels under the interpreter emits the same
tokens, lengths and drafts as one running the torch references, for n-gram and draft-model
proposals, greedy and sampled rows, with and without penalties (the bonus token from the
verify launch, or from the sampler). The CPU engine otherwise only ever takes the references.
And the launch-count guard: on that path an n-gram step's speculative work is Triton launches only."""

import pytest
import torch

from metadata.config import EngineConfig
from metadata.wire import NewRequest, SamplingOptions, ScheduledRow, StepPlan
from tests.interpreted import delegate_all

BS, K = 8, 3
PROMPT = [5, 9, 17, 33, 2, 41, 7, 11, 13, 60, 3, 5, 9, 17, 33, 2]


def _opts(i: int, penalty: bool) -> SamplingOptions:
    temperature = 0.0 if i % 2 == 0 else 0.9
    return SamplingOptions(temperature, 1.0, 0, 0.0, 100 + i, 1.3 if penalty else 1.0, 0.0, 0.0, 0, [], -1)


def _run(model_dir: str, method: str, triton: bool, penalty: bool, monkeypatch) -> list:
    import kernels.spec_ops as spec_ops
    from workers.distributed import TPGroup
    from workers.model_runner import ModelRunner

    monkeypatch.setattr(spec_ops, "_use_triton", (lambda t: True) if triton else (lambda t: t.is_cuda))
    extra = {"speculative_model": model_dir} if method == "draft_model" else {}
    cfg = EngineConfig.from_options(
        num_kv_blocks=64, block_size=BS, max_num_seqs=4, speculative_method=method, num_speculative_tokens=K, **extra
    )
    r = ModelRunner(cfg, model_dir, torch.device("cpu"), TPGroup(), 256)
    r.init_kv_cache(64)
    P = len(PROMPT)
    new = [
        NewRequest.of(h, PROMPT[h:] + PROMPT[:h], [], _opts(h, penalty), [h * 8 + i for i in range(8)])
        for h in range(4)
    ]
    out = [r.execute(StepPlan(1, new_requests=new, rows=[ScheduledRow(h, P, P, [], True) for h in range(4)]))]
    for s in range(4):
        ub = P + 1 + (s + 1) * (1 + K)
        rows = [ScheduledRow(h, 1 + K, ub, [], True, num_draft_tokens=K) for h in range(4)]
        out.append(r.execute(StepPlan(2 + s, rows=rows)))
    st = r.state
    return [[(o.handle, o.token_ids) for o in res.outputs] for res in out] + [
        st.token_ids[:4, : P + 20].clone(),
        st.num_computed[:4].clone(),
    ]


@pytest.mark.parametrize("penalty", [False, True], ids=["bonus-in-verify", "penalties"])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_triton_spec_path_equals_the_references(ckpt_dir, method, penalty, monkeypatch):
    torch.set_num_threads(1)
    model = str(ckpt_dir("llama"))
    want = _run(model, method, False, penalty, monkeypatch)
    got = _run(model, method, True, penalty, monkeypatch)
    for a, b in zip(got[:-2], want[:-2]):
        assert a == b
    assert torch.equal(got[-2], want[-2]) and torch.equal(got[-1], want[-1])
    assert all(len(step) == 4 for step in want[:-2])  # every row emitted every step
    if method == "draft_model":  # the model drafts for itself: its greedy rows accept drafts
        assert any(len(toks) > 1 for step in want[1:-2] for _, toks in step)


# what the Triton interpreter itself does with torch around a launch (no device work on a GPU)
_INTERPRETER_OPS = ("aten.empty", "aten.new_empty", "aten.set_", "aten.copy_", "aten.view", "aten.as_strided")


def test_ngram_verify_and_propose_issue_no_torch_compute(ckpt_dir, monkeypatch):
    """The launch-count guard: with the Triton dispatch, an n-gram step's verification, bonus
    token, commit and proposal are Triton launches only, no torch arithmetic (on a GPU each
    torch op is a launch of its own, and a step must stay far below the launch queue)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import workers.spec_decode as spec_decode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not str(func).startswith(_INTERPRETER_OPS):
                self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    ops = Ops()
    for name in ("verify", "propose"):
        inner = getattr(spec_decode.SpecDecoder, name)

        def wrapped(self, *a, _inner=inner, **kw):
            with ops:
                return _inner(self, *a, **kw)

        monkeypatch.setattr(spec_decode.SpecDecoder, name, wrapped)
    _run(str(ckpt_dir("llama")), "ngram", True, False, monkeypatch)
    assert ops.seen == [], sorted(set(ops.seen))


delegate_all(globals(), __file__)  # parent process: each test reports its child run
