"""Start-up compilation of the input kernel's forms, with and without new requests placed
by its own launch (``kernels.input_prep``'s ``place``).

A step with new requests builds its inputs and places the requests in one launch
(``workers.step_inputs.build_window``), in the form of the step: eager (no graph), a
mixed-step graph's (its padding, block table and sampled-token indices copied by the same
launch) or a decode graph's (padding and block table); a step whose input kernel also sets
its rows' lengths (one token a row: a new request whose prompt the prefix cache holds but
for its last token) places them with ``kernels.place``'s own launch first. Each is a Triton
variant, and so is each form without a placement (a step with no new request: a chunked
prefill's next chunk beside decode rows); the scratch requests' steps compile only the
forms their own steps take. ``warm_input_forms`` launches every form with and without a
placement, on a scratch state of two rows, before serving starts.
"""

from __future__ import annotations

import torch

from kernels.input_prep import GraphPad, prepare_inputs_triton
from metadata.wire import NewRequest, SamplingOptions
from workers.device_state import DeviceState, to_device

_GREEDY = SamplingOptions(0.0, 1.0, 0, 0.0, 0, 1.0, 0.0, 0.0, 0, [], -1)


def warm_input_forms(max_model_len: int, max_blocks: int, vocab: int, block_size: int, device) -> int:
    """Launch the input kernel in each step form, placing and not, and the placement kernel
    (see the module docstring), on a scratch two-row state whose specialised shapes are the engine's
    (its ``token_ids`` width: ``max_model_len``); returns the launches made."""
    st = DeviceState(2, max_model_len, max_blocks, vocab, device)
    staged = st.stage([NewRequest.of(-1, [0, 1], [2], _GREEDY, [0])])  # (a resumed request: outputs too)
    words = to_device(torch.from_numpy(staged.words), device)
    i64 = dict(dtype=torch.int64, device=device)
    rows = torch.tensor(staged.rows, **i64)
    qsl, q_lens, capacity = torch.tensor([0, 1], **i64), torch.ones(1, **i64), torch.full((1,), block_size, **i64)
    table = torch.zeros(1, max_blocks, dtype=torch.int32, device=device)
    launches = 0
    # (a decode graph's step that sets its lengths: its steps replay their input graph,
    # workers.input_graphs, so only one that does not fit the stage launches this form; a mixed
    # step sampling nothing takes the decode graph's form, the same variant)
    forms = ("eager", "decode graph", "decode graph, lengths", "mixed graph")
    for form in forms:
        out = pad = None
        if form != "eager":
            slots = torch.empty(2, **i64)  # (a bucket of two tokens and two requests)
            seq_lens = torch.empty(2, dtype=torch.int32, device=device)
            out = (torch.empty(1, **i64), torch.empty(1, **i64), seq_lens[:1], slots[:1])
            logits = dict(logits_src=torch.zeros(1, **i64), logits_dst=torch.zeros(2, **i64))
            pad = GraphPad(
                torch.zeros(3, dtype=torch.int32, device=device),
                2,
                2,
                torch.zeros(2, max_blocks, dtype=torch.int32, device=device),
                **(dict(seq_rows=2, seq_len=1) if form.startswith("decode") else logits),
            )
        commit = form == "decode graph, lengths"
        for placing in (True, False) if not commit else (False,):
            place = st.placement(staged, words, torch.zeros(1, **i64)) if placing else None
            prepare_inputs_triton(
                None, rows, qsl, 1, q_lens, capacity, st.token_ids, table, block_size,
                out=out, num_computed=st.num_computed, pad=pad, place=place, commit_lengths=commit,
            )  # fmt: skip
            launches += 1
    st.place(staged, words)  # the placement's own launch: steps whose input kernel sets their lengths
    return launches + 1
