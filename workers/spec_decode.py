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
from workers.device_state import DeviceState
from workers.rejection_sampler import SpecRows, verify_drafts
from workers.sampler import SamplingBatch
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
        bonus: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        K = inp.max_drafts
        draft_probs = None
        if self.method == "draft_model" and not batch.all_greedy:
            draft_probs = st.ensure_draft_probs(self.k)[s_rows, :K]
        rows = SpecRows(
            logits=logits_all[inp.spec_idx].float(),
            draft_tokens=inp.input_ids[inp.draft_token_idx],
            num_drafts=inp.num_drafts_d,
            draft_probs=draft_probs,
            temperature=batch.temperature,
            top_k=batch.top_k,
            top_p=batch.top_p,
            min_p=batch.min_p,
            seeds=batch.seeds,
            positions=batch.positions - inp.num_drafts_d,
            all_greedy=batch.all_greedy,
            any_top_k_top_p=batch.any_top_k_top_p,
            any_min_p=batch.any_min_p,
        )
        return verify_drafts(rows, bonus)

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
