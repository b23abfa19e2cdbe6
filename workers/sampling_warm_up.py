"""Start-up launches of the sampling stage at every row-count class (CUDA's lazy kernel loading).

CUDA loads a kernel the first time it is launched (lazy loading, the default since CUDA
12.2), and loading one can synchronize the context: that first launch waits for everything
already queued on the device. A launch path that runs a kernel no start-up step ran
therefore waits for the GPU once, however asynchronous it is otherwise. Some torch
operators pick their kernel by size: ``index_select`` (``OptionTensors.get``'s option
gather) has one kernel for a few indices and another for many, so the first serving step
that sampled more rows than the scratch requests' two waited behind a 150 ms GPU busy-wait
for 60-160 ms, in every scheduling mode (``benchmarks.launch_wait``, one H100; the
launching thread's CPU time matched the wall time: CUDA spins while it synchronizes). The
same held for ``torch.cat`` packing a speculative step's outputs for their copy
(``workers.pending_step.pack_outputs``): about 290 ms in the first request's first
verify step.

``scratch_request_plans`` are the steps ``ModelRunner.warm_up`` executes first (the step
shapes serving starts with). ``warm_sampling_rows`` runs the sampling stage once per power-of-two row count up to the
step's sampling-row limit (and at the limit), for each family of options that selects a
different set of operators, on scratch logits, and packs its outputs as a step's copy does
(with ``spec_width``, also as a speculative step's); it writes nothing serving steps read.
The options are not the families' values on the device (the gather reads row 0 of the
option table, whatever the last placement left there): the families choose the host's
branches, which pick the operators; no operator picks its kernel by the options' values.
Its largest batch, every option at ``max_num_seqs`` rows, is the sampling step the KV
cache's memory profile leaves room for (``sample_every_option``).
"""

from __future__ import annotations

import torch

from metadata.wire import NewRequest, SamplingOptions, ScheduledRow, StepPlan
from workers.device_state import OptionTensors
from workers.pending_step import pack_outputs
from workers.sampler import commit_tokens, sample
from workers.sampling_inputs import build_sampling_batch

GREEDY = SamplingOptions(0.0, 1.0, 0, 0.0, 0, 1.0, 0.0, 0.0, 0, [], -1)
TEMPERATURE = SamplingOptions(0.8, 1.0, 0, 0.0, 1, 1.0, 0.0, 0.0, 0, [], -1)
# every option at once: top-k and top-p, min-p, the three penalties, min_tokens, logprobs
EVERYTHING = SamplingOptions(0.8, 0.9, 20, 0.05, 2, 1.1, 0.5, 0.5, 2, [0], 5)


def scratch_request_plans(
    block_size: int, max_model_len: int, num_blocks: int, max_rows: int, vocab: int, step_cap: int
) -> list[StepPlan]:
    """Two scratch requests through the step shapes serving starts with: A (greedy) and B
    (sampled, temperature 0.8) placed together, B's whole prompt sampled beside A's prompt
    chunk short of its end (a mixed step sampling some rows: the fused sampler, the option
    gather, the sampled-row selection), then A's last prompt token beside B's decode (two
    rows, greedy and sampled, in one step), then both finished. One greedy request where the
    cache (``num_blocks``), the rows or a step's token budget (``step_cap``) cannot hold two;
    none where the cache cannot hold one (the first request compiles instead)."""
    bs, n = block_size, min(2 * block_size + 1, max_model_len - 2)
    blocks = -(-(n + 1) // bs)
    if n < 2 or blocks > num_blocks:
        return []
    a, b = -1, -2  # the driver's handles are >= 0
    prompt = [i % vocab for i in range(n)]
    if 2 * blocks > num_blocks or max_rows < 2 or 2 * n - 1 > step_cap:
        return [
            StepPlan(
                step_id=-3,
                new_requests=[NewRequest.of(a, prompt, [], GREEDY, list(range(blocks)))],
                rows=[ScheduledRow(a, n, n, [], True)],
            ),
            StepPlan(step_id=-2, rows=[ScheduledRow(a, 1, n + 1, [], True)]),
            StepPlan(step_id=-1, finished_handles=[a]),
        ]
    return [
        StepPlan(
            step_id=-3,
            new_requests=[
                NewRequest.of(a, prompt, [], GREEDY, list(range(blocks))),
                NewRequest.of(b, prompt, [], TEMPERATURE, list(range(blocks, 2 * blocks))),
            ],
            rows=[ScheduledRow(b, n, n, [], True), ScheduledRow(a, n - 1, n - 1, [], False)],
        ),
        StepPlan(step_id=-2, rows=[ScheduledRow(b, 1, n + 1, [], True), ScheduledRow(a, 1, n, [], True)]),
        StepPlan(step_id=-1, finished_handles=[a, b]),
    ]


def row_classes(max_rows: int) -> list[int]:
    """1, 2, 4, ... below ``max_rows``, then ``max_rows``: a size threshold inside an operator
    lies between two of them."""
    return sorted({min(1 << i, max_rows) for i in range(max(1, max_rows).bit_length() + 1)})


def option_families(rows: int) -> list[list[SamplingOptions]]:
    """The option lists whose flags route sampling differently: all greedy (argmax only),
    greedy and temperature rows (the fused temperature sampler), every option (penalties,
    the min_tokens mask, the probability path with top-k/top-p/min-p, logprobs)."""
    return [
        [GREEDY] * rows,
        [GREEDY if i % 2 else TEMPERATURE for i in range(rows)],
        [EVERYTHING] * rows,
    ]


@torch.inference_mode()
def sample_every_option(st, logits: torch.Tensor) -> None:
    """Sample ``logits`` [R, V] with every option at once (``EVERYTHING``: penalties, the
    min_tokens mask, top-k/top-p/min-p, logprobs), the options gathered from ``st``'s table
    at row 0 (R at most ``st.max_rows``): the sampling step with the most device memory in
    flight, which the KV cache's memory profile must leave room for
    (``workers.memory_profile``)."""
    rows = logits.shape[0]
    padded = torch.zeros(-(-rows // 4) * 4, dtype=torch.int64, device=logits.device)
    positions = torch.ones(rows, dtype=torch.int64, device=logits.device)
    st.option_tensors = OptionTensors()
    sample(logits, build_sampling_batch([EVERYTHING] * rows, st, padded[:rows], positions, padded))
    st.option_tensors = OptionTensors()


@torch.inference_mode()
def warm_sampling_rows(st, vocab: int, logits_width: int, max_rows: int, spec_width: int = 0, lazy: bool = True) -> int:
    """Sample scratch logits [R, ``vocab``] (dense, and as a view of rows ``logits_width``
    wide where the LM head pads its vocabulary) for each ``row_classes(max_rows)`` size and
    each ``option_families`` list, the options gathered from ``st.option_table`` as serving
    steps gather them, then packs each batch's outputs for the host copy (``spec_width``: a
    speculative step's tokens a row, K + 1, with its accepted counts; 0 without drafts;
    ``lazy``: as ``ModelRunner`` builds its batches, plain temperature options read in place
    and committed by the sampler, which it does without speculative decoding; the batches it
    does not commit are committed as the runner commits them, their index_put kernels loaded);
    returns how many batches ran. The gather reads row 0's options and
    sampling writes nothing to ``st``; the option cache is reset afterwards."""
    dev = st.device
    widths = sorted({vocab, logits_width})
    runs = 0
    scratch = torch.zeros_like(st.token_ids[:1])  # the commits land here
    counts = torch.zeros_like(st.output_counts[:1])
    for rows in row_classes(min(max_rows, st.max_rows)):
        padded = torch.zeros(-(-rows // 4) * 4, dtype=torch.int64, device=dev)  # the sampled rows' device rows
        positions = torch.ones(rows, dtype=torch.int32 if lazy else torch.int64, device=dev)  # (as served)
        for width in widths:
            logits = torch.zeros(rows, width, dtype=torch.float32, device=dev)[:, :vocab]
            argmax = torch.zeros(rows, dtype=torch.int64, device=dev)
            for opts in option_families(rows):
                st.option_tensors = OptionTensors()  # (cached by the options' identity)
                batch = build_sampling_batch(opts, st, padded[:rows], positions, padded, lazy=lazy)
                sample(logits, batch, argmax, commit=scratch)
                so = sample(logits, batch, commit=scratch)
                if not so.committed:  # (greedy, or options past temperature) as ModelRunner._commit_tokens
                    commit_tokens(
                        scratch, counts, padded[:rows], batch.positions, so.token_ids, batch.penalties is not None
                    )
                pack_outputs(so.token_ids[:, None], None, so)
                if spec_width:
                    tokens = torch.zeros(rows, spec_width, dtype=torch.int64, device=dev)
                    pack_outputs(tokens, torch.zeros(rows, dtype=torch.int64, device=dev), so)
                runs += 1
    st.option_tensors = OptionTensors()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return runs
