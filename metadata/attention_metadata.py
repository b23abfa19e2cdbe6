"""Worker-side attention metadata built from a ``StepPlan`` and the device state.

The exact sequence lengths exist only on the device (``seq_lens``). The CPU
side holds query starts (known when the driver scheduled the step) and
``seq_lens_upper_bound``: safe for sizing grids, split counts and buffers,
never for exact decisions. ``exact_seq_lens_cpu()`` returns them only when the
engine guarantees the bounds are exact (no speculative decoding); otherwise it
raises, so a consumer that needs exact lengths fails loudly instead of
silently using optimistic values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class ExactLengthUnavailable(RuntimeError):
    """Raised when exact CPU sequence lengths are requested but only bounds exist."""


@dataclass(frozen=True)
class AttentionMetadata:
    query_start_loc: torch.Tensor  # device int32 [num_reqs + 1]
    query_start_loc_cpu: torch.Tensor  # CPU int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # device int32 [num_reqs], authoritative
    seq_lens_upper_bound: torch.Tensor  # CPU int32 [num_reqs], >= seq_lens
    block_table: torch.Tensor  # device int32 [num_reqs, max_blocks]
    slot_mapping: torch.Tensor  # device int64 [num_tokens]; -1 = padded slot, skip
    positions: torch.Tensor  # device int64 [num_tokens]
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len_upper_bound: int
    bounds_are_exact: bool
    """True when no speculative decoding runs: the upper bounds are then exact."""
    eager: bool = True
    """True for a pass that runs outside any CUDA graph (the default: the safe side). Its
    attention launches then take shapes from a small fixed set
    (``kernels.attention_splits.launch_config``): with graphs on, every eager step reuses
    the variants compiled at start-up instead of compiling new ones mid-serving (with
    ``enforce_eager``, start-up also runs a scratch one-token pass per eager decode shape:
    ``workers.eager_warm_up``). A CUDA-graph capture passes False and keeps the tuned exact
    shapes."""

    @property
    def query_lens_cpu(self) -> torch.Tensor:
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]

    def exact_seq_lens_cpu(self, consumer: str) -> torch.Tensor:
        """CPU sequence lengths for a consumer that needs exact values.

        Raises ``ExactLengthUnavailable`` naming ``consumer`` when the rows are
        only upper bounds (speculative decoding). Engines refuse such
        configurations at startup, so reaching this raise is a bug.
        """
        if not self.bounds_are_exact:
            raise ExactLengthUnavailable(
                f"{consumer} needs exact CPU sequence lengths, but this step only has "
                "upper bounds (speculative decoding assumes every draft is accepted); "
                "use device seq_lens, or disable speculative decoding"
            )
        return self.seq_lens_upper_bound

    def num_computed_tokens(self) -> torch.Tensor:
        """Device tokens already in the KV cache before this step (seq_lens - query_lens)."""
        q = self.query_start_loc[1:] - self.query_start_loc[:-1]
        return self.seq_lens - q

    def unpadded(self, num_actual_tokens: int, num_actual_reqs: int) -> "AttentionMetadata":
        """A view without padding rows/tokens (e.g. after CUDA-graph padding)."""
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: num_actual_reqs + 1],
            query_start_loc_cpu=self.query_start_loc_cpu[: num_actual_reqs + 1],
            seq_lens=self.seq_lens[:num_actual_reqs],
            seq_lens_upper_bound=self.seq_lens_upper_bound[:num_actual_reqs],
            block_table=self.block_table[:num_actual_reqs],
            slot_mapping=self.slot_mapping[:num_actual_tokens],
            positions=self.positions[:num_actual_tokens],
            num_reqs=num_actual_reqs,
            num_actual_tokens=num_actual_tokens,
            max_query_len=self.max_query_len,
            max_seq_len_upper_bound=self.max_seq_len_upper_bound,
            bounds_are_exact=self.bounds_are_exact,
            eager=self.eager,
        )
