"""``warm_input_forms`` compiles, before serving, the input-kernel variant of every step
form, placing new requests in its own launch and not: the launches of real steps (eager,
and built into a mixed-step graph's buffers) are recorded on the CPU and their Triton keys
(constexprs, specialisations, launch options) must be among the warm-up's. A key outside
them is a variant compiled mid-serving, where a compile costs seconds. (On the GPU, a
mixed step without new requests, a prefill's next chunk, needed one when only the placing
forms were warmed.)"""

import pytest
import torch

from metadata.config import EngineConfig
from metadata.wire import NewRequest, SamplingOptions, ScheduledRow, StepPlan
from tests.kernels.launch_recorder import LaunchRecorder

BS = 8
GREEDY = SamplingOptions(0.0, 1.0, 0, 0.0, 0, 1.0, 0.0, 0.0, 0, [], -1)
CPU = torch.device("cpu")


@pytest.fixture
def recorder(monkeypatch):
    """The input kernel recorded instead of run, and the steps' ``prepare_inputs`` taking the
    Triton path as on CUDA (the outputs stay unwritten: only the launches matter here)."""
    from kernels import input_prep
    from workers import step_inputs

    kernel = input_prep._prepare_inputs_kernel
    rec = LaunchRecorder(getattr(kernel, "fn", kernel))
    monkeypatch.setattr(input_prep, "_prepare_inputs_kernel", rec)

    def triton_path(*args, every_request_has_tokens=True, **kw):
        return input_prep.prepare_inputs_triton(*args, **kw)

    monkeypatch.setattr(step_inputs, "prepare_inputs", triton_path)
    return rec


def _warm_keys(rec, st) -> set:
    from workers.input_warm_up import warm_input_forms

    assert warm_input_forms(st.max_model_len, st.block_table_cpu.shape[1], st.vocab, BS, CPU) == 8
    keys = rec.variants()
    rec.calls.clear()
    # eager, decode graph, mixed graph, each placing and not, the decode graph's setting its
    # rows' lengths (and the placement kernel's own launch)
    assert len(keys) == 7
    return keys


def test_a_decode_graph_step_setting_its_lengths_is_warmed(recorder):
    """One token a row replaying a decode graph, its input kernel setting the rows' lengths, by
    the launch (a step too large for the input graphs' stage): the scratch requests' steps no
    longer launch that form (they replay their input graphs)."""
    from workers.cuda_graphs import DecodeGraphs
    from workers.device_state import DeviceState
    from workers.step_inputs import build_step_inputs

    st = DeviceState(6, 256, 32, 97, CPU)
    st.add_many([NewRequest.of(0, list(range(1, 14)), [], GREEDY, [0, 1])])
    _old(st)
    warm = _warm_keys(recorder, st)
    graphs = DecodeGraphs(None, None, 6, 256, BS, 32, CPU, True)
    rows = [ScheduledRow(0, 1, 14, [], True), ScheduledRow(1, 1, 12, [], True), ScheduledRow(2, 1, 23, [], True)]
    inp = build_step_inputs(StepPlan(2, rows=rows), st, BS, True, graphs=graphs, commit_lengths=True)
    assert inp.graph_key is not None and inp.lengths_committed
    assert recorder.calls and recorder.variants() <= warm


def test_a_step_placing_before_its_input_kernel_is_warmed(recorder, monkeypatch):
    """One token a row with the input kernel setting the lengths (a new request whose prompt
    the prefix cache holds but for its last token): placed by ``kernels.place``'s own launch."""
    from kernels import place
    from workers.device_state import DeviceState
    from workers.step_inputs import build_step_inputs

    kernel = place._place_kernel
    rec = LaunchRecorder(getattr(kernel, "fn", kernel))
    monkeypatch.setattr(place, "_place_kernel", rec)
    monkeypatch.setattr(place, "place_requests", place.place_requests_triton)  # (as on CUDA)
    st = DeviceState(6, 256, 32, 97, CPU)
    st.add_many([NewRequest.of(0, list(range(1, 14)), [], GREEDY, [0, 1])])
    rec.calls.clear()
    _warm_keys(recorder, st)
    warm = rec.variants()
    rec.calls.clear()
    news = [NewRequest.of(1, list(range(3, 20)), [], GREEDY, [4, 5, 6], num_cached_tokens=16)]
    rows = [ScheduledRow(0, 1, 14, [], True), ScheduledRow(1, 1, 17, [], True)]
    inp = build_step_inputs(StepPlan(2, rows=rows), st, BS, True, placement=st.stage(news), commit_lengths=True)
    assert inp.lengths_committed and rec.calls and len(warm) == 1 and rec.variants() <= warm


def _news(h0: int):
    return [
        NewRequest.of(h0, [5 + i for i in range(11)], [], GREEDY, [20, 21]),
        NewRequest.of(h0 + 1, [40 - i for i in range(20)], [3, 4], GREEDY, [24, 25, 26], num_cached_tokens=8),
    ]


def _old(st) -> None:
    """The rows of ``_news(1)`` placed in an earlier step (a step that places none needs them)."""
    st.add_many(_news(1))


@pytest.mark.parametrize("placing", [True, False], ids=["placing", "not-placing"])
def test_an_eager_step_is_warmed(recorder, placing):
    from workers.device_state import DeviceState
    from workers.step_inputs import build_step_inputs

    st = DeviceState(6, 256, 32, 97, CPU)
    st.add_many([NewRequest.of(0, list(range(1, 14)), [], GREEDY, [0, 1])])
    if not placing:
        _old(st)
    warm = _warm_keys(recorder, st)
    rows = [ScheduledRow(0, 1, 14, [], True), ScheduledRow(1, 11, 11, [], True), ScheduledRow(2, 14, 22, [], True)]
    build_step_inputs(StepPlan(2, rows=rows), st, BS, True, placement=st.stage(_news(1)) if placing else None)
    assert recorder.calls and recorder.variants() <= warm


@pytest.mark.parametrize("placing", [True, False], ids=["placing", "not-placing"])
def test_a_mixed_graph_step_is_warmed(recorder, ckpt_dir, placing):
    from workers.distributed import TPGroup
    from workers.mixed_graphs import MixedGraphs
    from workers.model_runner import ModelRunner
    from workers.step_inputs import build_step_inputs

    cfg = EngineConfig.from_options(num_kv_blocks=64, block_size=BS, max_num_seqs=6, dtype="float32")
    r = ModelRunner(cfg, str(ckpt_dir("llama")), CPU, TPGroup(), 256)
    r.init_kv_cache(64)
    mg = MixedGraphs(r.model, r.kv_caches, 64, 6, r.max_model_len, r.max_blocks_per_req, r.device, True)
    mg.graphs = {t: None for t in mg.buckets}  # as if captured: fits() picks the graphs
    r.state.add_many([NewRequest.of(0, list(range(1, 14)), [], GREEDY, [0, 1])])
    if not placing:
        _old(r.state)
    warm = _warm_keys(recorder, r.state)
    rows = [ScheduledRow(0, 1, 14, [], True), ScheduledRow(1, 11, 11, [], True), ScheduledRow(2, 6, 14, [], False)]
    news = r.state.stage(_news(1)) if placing else None
    inp = build_step_inputs(
        StepPlan(2, rows=rows), r.state, BS, True, max_len=r.max_model_len, mixed=mg, placement=news
    )
    assert inp.mixed_graph and recorder.calls and recorder.variants() <= warm
