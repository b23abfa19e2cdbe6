"""Speculative decoding on one worker: verification after the target forward, then proposals.

The driver schedules a decode row with ``k`` drafts as ``1 + k`` query tokens
and a ``seq_len_upper_bound`` that assumes every draft is accepted. Here the
row's real outcome (``a`` accepted drafts plus one recovered or bonus token)
is applied to the device state only: ``num_computed`` becomes ``p + 1 + a``
and the emitted tokens are written into ``token_ids``, so the next step's
inputs and lengths are exact although the host never learns them in time.
"""

from __future__ import annotations

from pathlib import Path

import torch

from metadata.config import EngineConfig
from kernels.spec_ops import accept_commit, draft_sample, draft_step_inputs, verify_slots
from workers.device_state import DeviceState
from workers.rejection_sampler import SpecRows, verify_and_commit
from workers.sampler import SamplerOutput, SamplingBatch, sample
from workers.spec_proposers import DraftModelProposer, NgramProposer
from workers.step_inputs import StepInputs


class DraftVocabMismatch(ValueError):
    pass


class SpecDecoder:
    def __init__(
        self, cfg: EngineConfig, target_arch, tp, dtype: torch.dtype, device: torch.device, max_model_len: int
    ):
        sp = cfg.speculative
        self.method = sp.speculative_method
        self.k = sp.num_speculative_tokens
        self.cfg = cfg
        self.draft_model = None
        self.draft_arch = None
        self.proposer = None
        if self.method == "ngram":
            self.proposer = NgramProposer(self.k, sp.prompt_lookup_min, sp.prompt_lookup_max)
        elif self.method == "draft_model":
            from workers.models.arch import load_arch
            from workers.models.loader import load_model

            draft_arch = load_arch(sp.speculative_model)
            if draft_arch.vocab_size != target_arch.vocab_size:
                raise DraftVocabMismatch(
                    f"draft model {Path(sp.speculative_model).name} has vocab_size {draft_arch.vocab_size}, "
                    f"the target has {target_arch.vocab_size}; speculative_model must share the "
                    "target's tokenizer and vocabulary"
                )
            self.max_position = max_model_len + 2 * self.k + 2
            self.draft_model, self.draft_arch = load_model(
                sp.speculative_model, tp, dtype, device, self.max_position + 1, cfg.model.load_format
            )
        # 'ngram_host' drafts arrive in the plan; nothing to propose on the worker

    @property
    def draft_num_kv_heads(self) -> int:
        return self.draft_model.layers[0].self_attn.num_kv_heads

    def attach_kv_cache(self, kv_caches, block_size: int) -> None:
        self.proposer = DraftModelProposer(
            self.draft_model, kv_caches, self.k, block_size, bounds_are_exact=False, max_position=self.max_position
        )

    # ------------------------------------------------------------- verify
    def verify(
        self,
        logits_all: torch.Tensor,
        inp: StepInputs,
        batch: SamplingBatch,
        st: DeviceState,
        s_rows: torch.Tensor,
    ) -> tuple[SamplerOutput, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Samples the bonus tokens, verifies the step's drafts and commits the outputs to
        ``st`` (tokens, lengths, penalty counts): ``(sampler output of the bonus tokens,
        tokens [R, K + 1], num_accepted [R], known [R])``. Without penalties, min_tokens,
        logprobs, top-k, top-p or min-p the bonus tokens come from the verify launch itself."""
        plain = batch.penalties is None and batch.min_tokens_mask is None and batch.max_num_logprobs < 0
        plain = plain and batch.logit_bias is None and batch.allowed is None
        so = None
        if not (plain and not batch.any_top_k_top_p and not batch.any_min_p):
            so = sample(logits_all[inp.bonus_idx], batch)
        sampled = self.method == "draft_model" and not batch.all_greedy
        rows = SpecRows(
            logits=logits_all,
            spec_idx=inp.spec_idx,
            input_ids=inp.input_ids,
            draft_idx=inp.draft_token_idx,
            num_drafts=inp.num_drafts_d,
            positions=batch.positions,
            temperature=batch.temperature,
            top_k=batch.top_k,
            top_p=batch.top_p,
            min_p=batch.min_p,
            seeds=batch.seeds,
            draft_probs=st.ensure_draft_probs(self.k) if sampled else None,
            draft_rows=s_rows if sampled else None,
            any_top_k_top_p=batch.any_top_k_top_p,
            any_min_p=batch.any_min_p,
        )
        counts = st.output_counts if batch.penalties is not None else None
        bonus, tokens, n_acc, known = verify_and_commit(
            rows, so.token_ids if so is not None else None, s_rows, st.token_ids, st.num_computed, counts, inp.bonus_idx
        )
        return so if so is not None else SamplerOutput(token_ids=bonus), tokens, n_acc, known

    def warm_up(self, st: DeviceState, logits_width: int | None = None) -> None:
        """Compiles every verify and commit kernel variant this method uses before serving
        (on scratch tensors of the state's dtypes: ``st`` is not touched). ``logits_width``:
        the row stride of the LM head's logits where it differs from the vocabulary (a
        vocabulary padded to a multiple of the TP size); padded verify steps use dense rows.
        Only the kernels that read logits depend on that stride."""
        dev, k, vocab = st.token_ids.device, self.k, st.output_counts.shape[1]
        ids = torch.zeros(k, dtype=torch.int64, device=dev)
        idx, one, t = ids.view(1, k), torch.ones(1, dtype=torch.int64, device=dev), torch.ones(1, device=dev)
        variants = [(None, None)]
        if self.method == "draft_model":
            variants.append((torch.ones(1, k, vocab, device=dev), ids[:1]))
        for width in sorted({vocab, logits_width or vocab}):
            logits = torch.ones(k, width, device=dev)[:, :vocab]
            for q, q_rows in variants:
                if self.method == "draft_model":  # the draft's own next-token kernel
                    table = torch.zeros_like(st.token_ids[:1])
                    draft_sample(logits[:1], t, ids[:1], ids[:1], q, ids[:1], 0, table, ids[:1])
                for probs in (False, True):
                    acc, rec, _ = verify_slots(
                        logits, idx, ids, idx, one * k, t, ids[:1], one * k, q, q_rows, probs=probs,
                        bonus_idx=None if probs else ids[:1],
                    )  # fmt: skip
        if self.method == "draft_model":  # the lookahead step's inputs
            out = (ids[:1].clone(), ids[:1].clone(), torch.zeros_like(st.num_computed[:1]), ids[:1].clone())
            table = torch.zeros(1, 1, dtype=torch.int32, device=dev)
            draft_step_inputs(ids[:1], ids[:1].clone(), table, ids[:1], self.proposer.block_size, 1, out)
        for counts in (None, torch.zeros_like(st.output_counts[:1])):
            table, computed = torch.zeros_like(st.token_ids[:1]), torch.zeros_like(st.num_computed[:1])
            accept_commit(acc, rec, ids, idx, one * k, ids[:1], one * k, ids[:1], table, computed, counts)

    # ------------------------------------------------------------ propose
    def propose(
        self, st: DeviceState, inp: StepInputs, s_rows: torch.Tensor, known: torch.Tensor, batch: SamplingBatch
    ) -> None:
        if self.proposer is not None and inp.handles:
            self.proposer.propose(st, inp, s_rows, known, batch)
        elif self.method == "draft_model" and self.proposer is None:
            raise RuntimeError("the draft model's KV cache was not allocated")

    def sync_draft_kv(self, st: DeviceState, inp: StepInputs) -> None:
        """Steps without sampling rows still advance the draft's KV (prefill chunks)."""
        if self.method == "draft_model" and not inp.handles:
            self.proposer.propose(st, inp, inp.rows[:0], inp.rows[:0], None)
