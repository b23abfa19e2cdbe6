"""Per-step ``SamplingBatch`` from the sampling rows' options (host-known) and device state."""

from __future__ import annotations

import numpy as np
import torch

from metadata.wire import SamplingOptions
from workers.device_state import DeviceState, to_device
from workers.sampler import PenaltyBatch, SamplingBatch


def build_sampling_batch(
    opts: list[SamplingOptions],
    st: DeviceState,
    s_rows: torch.Tensor,
    s_pos: torch.Tensor,
    padded_rows: torch.Tensor | None = None,
    lazy: bool = False,
    masks: list[bytes] | None = None,
) -> SamplingBatch:
    """``padded_rows``: ``s_rows`` padded to a multiple of 4 entries (``StepInputs.
    sample_device_rows``): new options are gathered from ``st.option_table``, else copied.
    ``lazy`` (with ``padded_rows``): a step that samples by temperature only gathers nothing;
    its batch points the temperature sampler at the table (``SamplingBatch.option_rows``).
    Only where nothing else reads the batch's options (no speculative decoding). ``s_pos``
    may be int32 (the lengths as they are) where ``lazy``: other batches take it as int64.
    ``masks``: each sampling row's ``ScheduledRow.token_bitmask`` (b"": unconstrained)."""
    dev = st.device
    table = st.option_table if padded_rows is not None else None
    cached = st.option_tensors.get(opts, dev, table, padded_rows, lazy=lazy)
    flags = cached.flags
    if cached.floats is None:  # (lazy: temperature only; the per-row options stay None)
        ungathered = dict.fromkeys(("temperature", "top_p", "top_k", "min_p", "seeds"))
        flags_of = dict(all_greedy=flags["all_greedy"], max_num_logprobs=flags["max_num_logprobs"])
        return SamplingBatch(
            **ungathered, positions=s_pos, any_top_k_top_p=False, any_min_p=False, **flags_of,
            option_words=st.sampler_words, option_rows=padded_rows,
        )  # fmt: skip
    if s_pos.dtype != torch.int64:  # (positions as int32 lengths serve only the lazy path)
        s_pos = s_pos.long()
    temperature, top_p, min_p, rep, pres, freq, sample_temperature = cached.floats
    top_k, seeds, min_tokens = cached.ints
    penalties = None
    if flags["any_penalties"]:
        penalties = PenaltyBatch(
            repetition=rep,
            presence=pres,
            frequency=freq,
            output_counts=st.output_counts[s_rows],
            prompt_mask=st.prompt_mask[s_rows],
        )
    mask = None
    if flags["any_min_tokens"]:
        ri, ids = [], []
        for i, o in enumerate(opts):
            if o.min_tokens > 0:
                ri += [i] * len(o.min_tokens_stop_ids)
                ids += o.min_tokens_stop_ids
        idx = to_device(torch.tensor([ri, ids], dtype=torch.int64), dev)
        mask = torch.zeros(len(opts), st.vocab, dtype=torch.bool, device=dev)
        # a device value: a Python scalar would be copied host-to-device first, blocking
        mask.index_put_((idx[0], idx[1].clamp(max=st.vocab - 1)), st.true_value)
        out_len = s_pos - st.prompt_len[s_rows].long()  # outputs before this token (device)
        mask &= (out_len < min_tokens)[:, None]
    bias = None
    if flags["any_logit_bias"]:  # (row, id) pairs and their biases, in one copy
        ri = [i for i, o in enumerate(opts) for _ in o.logit_bias_ids]
        ids = [t for o in opts for t in o.logit_bias_ids]
        vals = [v for o in opts for v in o.logit_bias_values]
        dv = to_device(torch.tensor([ri, ids, vals], dtype=torch.float64), dev)
        bias = (dv[0].long(), dv[1].long(), dv[2].float())
    allowed = allowed_tokens(masks, st.vocab, dev) if masks is not None else None
    if flags["any_id_rules"]:
        if cached.id_rules is None:  # (the same requests in the same order: built once)
            cached.id_rules = id_rule_masks(opts, st.vocab, dev)
        allowed = restrict_to_ids(allowed, masks, cached.id_rules, dev)
    return SamplingBatch(
        allowed=allowed,
        logit_bias=bias,
        temperature=temperature,
        sample_temperature=sample_temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        seeds=seeds,
        positions=s_pos,
        all_greedy=flags["all_greedy"],
        any_top_k_top_p=flags["any_top_k_top_p"],
        any_min_p=flags["any_min_p"],
        penalties=penalties,
        min_tokens_mask=mask,
        max_num_logprobs=flags["max_num_logprobs"],
    )


def allowed_tokens(masks: list[bytes], vocab: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The constrained rows (those with a bitmask) and the ids each may take, bool [C, vocab],
    from one copy of their int32 words (and the rows), unpacked on the device."""
    rows = [i for i, m in enumerate(masks) if m]
    if not rows:
        return None
    words = (vocab + 31) // 32
    packed = np.frombuffer(b"".join(masks[i] for i in rows), dtype="<i4").reshape(len(rows), words)
    host = np.concatenate([np.asarray(rows, dtype=np.int64), packed.astype(np.int64).ravel()])
    dv = to_device(torch.from_numpy(host), dev)
    w = dv[len(rows) :].view(len(rows), words).int()
    ids = torch.arange(vocab, device=dev, dtype=torch.int32)
    return dv[: len(rows)], ((w[:, ids >> 5] >> (ids & 31)) & 1).bool()


def id_rule_masks(opts: list[SamplingOptions], vocab: int, dev: torch.device) -> tuple:
    """The rows with ``allowed_token_ids`` or ``banned_token_ids``, their device rows, and the ids
    each may take, bool [n, vocab]; the lists and (row, id) pairs travel in one copy. A
    request's ids never change, so the step's ``OptionTensors`` keeps this while its rows do."""
    rows = [i for i, o in enumerate(opts) if o.allowed_token_ids or o.banned_token_ids]
    allow = [j for j, i in enumerate(rows) if opts[i].allowed_token_ids]
    parts = [
        rows,
        allow,  # the rows restricted to ids
        [j for j in allow for _ in opts[rows[j]].allowed_token_ids],  # (row, allowed id) pairs
        [t for j in allow for t in opts[rows[j]].allowed_token_ids],
        [j for j, i in enumerate(rows) for _ in opts[i].banned_token_ids],  # (row, banned id) pairs
        [t for i in rows for t in opts[i].banned_token_ids],
    ]
    dv = to_device(torch.tensor([t for part in parts for t in part], dtype=torch.int64), dev)
    rows_d, allow_d, pair_rows, pair_ids, ban_rows, ban_ids = dv.split([len(p) for p in parts])
    # device values: a Python scalar would be copied host-to-device first, blocking
    true, false = torch.ones((), dtype=torch.bool, device=dev), torch.zeros((), dtype=torch.bool, device=dev)
    keep = torch.ones(len(rows), vocab, dtype=torch.bool, device=dev)
    keep.index_put_((allow_d,), false)
    keep.index_put_((pair_rows, pair_ids), true)
    keep.index_put_((ban_rows, ban_ids), false)
    return rows, rows_d, keep


def restrict_to_ids(
    allowed: tuple[torch.Tensor, torch.Tensor] | None,
    masks: list[bytes] | None,
    id_rules: tuple,
    dev: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``allowed`` (the constrained rows' masks, or None) narrowed by ``id_rules``
    (``id_rule_masks``): the rows of either and the ids each may take, bool [C, vocab]; a row
    with both takes their AND."""
    id_rows, id_rows_d, id_keep = id_rules
    grammar_rows = [i for i, m in enumerate(masks or ()) if m] if allowed is not None else []
    if not grammar_rows:
        return id_rows_d, id_keep
    rows = sorted(set(grammar_rows) | set(id_rows))
    local = {r: j for j, r in enumerate(rows)}
    parts = [rows, [local[i] for i in id_rows], [local[i] for i in grammar_rows]]
    dv = to_device(torch.tensor([t for part in parts for t in part], dtype=torch.int64), dev)
    rows_d, id_local, grammar_local = dv.split([len(p) for p in parts])
    keep = torch.ones(len(rows), id_keep.shape[1], dtype=torch.bool, device=dev)
    keep.index_put_((id_local,), id_keep)
    keep.index_put_((grammar_local,), keep[grammar_local] & allowed[1])
    return rows_d, keep
