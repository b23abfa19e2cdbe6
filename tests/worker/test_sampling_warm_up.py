"""``warm_sampling_rows``: the sampling stage at every row-count class, each option family,
leaving the device state as it found it. (That it removes the mid-serving kernel loads is
the GPU busy-wait test's to show: tests/worker/test_gpu_launch_never_waits.py.)"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from workers.device_state import DeviceState
from workers.sampler import SamplingBatch
from workers.sampling_inputs import build_sampling_batch
from workers.sampling_warm_up import option_families, row_classes, warm_sampling_rows

ROWS, MAX_LEN, MAX_BLOCKS, VOCAB = 40, 32, 8, 50


class _Ops(TorchDispatchMode):
    """Every aten operator run, with the index length of each ``index_select``."""

    def __init__(self):
        super().__init__()
        self.names, self.gathers, self.cats, self.puts = set(), [], [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.names.add(name)
        if name == "index_select":
            self.gathers.append(args[2].numel())
        if name == "cat":  # (a step's outputs packed for their copy)
            self.cats.append(len(args[0]))
        if name == "index_put_":  # (target dtype, index dtypes): token commits, output counts
            self.puts.append((args[0].dtype, tuple(i.dtype for i in args[1] if i is not None)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "limit, classes",
    [(1, [1]), (16, [1, 2, 4, 8, 16]), (17, [1, 2, 4, 8, 16, 17]), (40, [1, 2, 4, 8, 16, 32, 40])],
)
def test_row_classes_are_the_powers_of_two_then_the_limit(limit, classes):
    assert row_classes(limit) == classes


def test_sample_every_option_runs_the_costliest_path_and_leaves_no_cache():
    """The memory profile's worst sampling step: penalties, the min_tokens mask, the sorted
    top-k/top-p path and logprobs at once, on as many rows as the logits have."""
    from workers.sampling_warm_up import sample_every_option

    st = DeviceState(ROWS, MAX_LEN, MAX_BLOCKS, VOCAB, torch.device("cpu"))
    with _Ops() as ops:
        sample_every_option(st, torch.randn(ROWS, VOCAB))
    assert {"sort", "index_put_", "log_softmax", "topk", "masked_fill"} <= ops.names
    assert ops.gathers == [ROWS] and st.option_tensors.floats is None


def test_option_families_route_sampling_differently():
    st = DeviceState(ROWS, MAX_LEN, MAX_BLOCKS, VOCAB, torch.device("cpu"))
    rows = torch.zeros(4, dtype=torch.int64)
    batches = [
        build_sampling_batch(opts, st, rows, torch.ones(4, dtype=torch.int64), rows) for opts in option_families(4)
    ]
    routes = {
        (b.all_greedy, b.any_top_k_top_p, b.any_min_p, b.penalties is not None, b.min_tokens_mask is not None)
        for b in batches
    }
    assert len(routes) == 3
    assert all(isinstance(b, SamplingBatch) for b in batches)
    assert batches[0].all_greedy and not batches[1].all_greedy
    assert batches[2].any_top_k_top_p and batches[2].penalties is not None and batches[2].max_num_logprobs > 0


def test_warm_sampling_rows_runs_each_class_and_leaves_the_state():
    st = DeviceState(ROWS, MAX_LEN, MAX_BLOCKS, VOCAB, torch.device("cpu"))
    st.option_table.random_(0, 100)
    before = {k: v.clone() for k, v in vars(st).items() if isinstance(v, torch.Tensor)}
    with _Ops() as ops:
        runs = warm_sampling_rows(st, VOCAB, 64, 33)
    classes = row_classes(33)
    assert classes == [1, 2, 4, 8, 16, 32, 33]
    assert runs == len(classes) * 2 * 3  # (two logits widths: dense and padded)
    # the option gather ran at every padded size, a few indices and many
    assert sorted(set(ops.gathers)) == sorted({-(-r // 4) * 4 for r in classes})
    # the probability path (top-k/top-p sort), the penalties' gathers, the logprobs' top-k
    assert {"sort", "softmax", "index", "log_softmax", "topk", "argmax"} <= ops.names
    after = {k: v for k, v in vars(st).items() if isinstance(v, torch.Tensor)}
    for k, v in before.items():
        assert torch.equal(v, after[k]), f"warm_sampling_rows changed DeviceState.{k}"
    assert st.option_tensors.floats is None  # the cache holds no scratch options


def test_warm_sampling_rows_is_capped_by_the_state_rows():
    st = DeviceState(8, MAX_LEN, MAX_BLOCKS, VOCAB, torch.device("cpu"))
    with _Ops() as ops:
        runs = warm_sampling_rows(st, VOCAB, VOCAB, 256)
    assert runs == len(row_classes(8)) * 3
    assert max(ops.gathers) == 8


@pytest.mark.parametrize("spec_width", [0, 4])
def test_warm_sampling_rows_packs_outputs_as_steps_do(spec_width):
    """Logprobs rows (every family but plain) pack tokens, logprob and rank, top ids and
    logprobs (5 parts); a speculative step also packs every family's tokens with their
    accepted counts (2 parts, 6 with logprobs)."""
    st = DeviceState(ROWS, MAX_LEN, MAX_BLOCKS, VOCAB, torch.device("cpu"))
    with _Ops() as ops:
        runs = warm_sampling_rows(st, VOCAB, VOCAB, 8, spec_width)
    per_class = runs // 3
    expected = [5] * per_class + ([2] * 2 * per_class + [6] * per_class if spec_width else [])
    assert sorted(ops.cats) == sorted(expected)


def test_warm_sampling_rows_commits_what_the_sampler_does_not():
    """The batches the fused sampler does not commit (all greedy; options past temperature)
    commit their tokens as the runner does, with the served index dtypes (int64 rows, int32
    positions without drafts), and penalty rows count them: their index_put kernels load at
    start-up, not at the first greedy or penalty step."""
    st = DeviceState(ROWS, MAX_LEN, MAX_BLOCKS, VOCAB, torch.device("cpu"))
    with _Ops() as ops:
        warm_sampling_rows(st, VOCAB, VOCAB, 8)
    classes = len(row_classes(8))
    commits = [p for p in ops.puts if p == (torch.int64, (torch.int64, torch.int32))]
    counts = [p for p in ops.puts if p == (torch.int32, (torch.int64, torch.int64))]
    assert len(commits) >= 2 * classes  # the greedy and the rich family, each row class
    assert len(counts) == classes  # the penalty family
