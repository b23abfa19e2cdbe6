"""Pipeline parallelism: the layer split and the stage-to-stage transfers of one rank.

The model's layers split into ``P`` contiguous stages; rank ``r`` is TP rank ``r % tp`` of
stage ``r // tp`` (``placement/placement_groups.py``). Stage 0 holds the embedding, the
last stage the final norm, the LM head and sampling. TP rank ``i`` of a stage talks only
to TP rank ``i`` of the neighbouring stages: after the TP all-reduce every rank of a stage
holds the whole hidden state.

Per step with tokens, in plan order (the same on every rank, so sends and receives pair
up in order and no stage waits on a cycle):

- a stage before the last sends ``(hidden, residual)`` of every token, as one
  ``[2, T, H]`` tensor, to the next stage, which receives it before its first layer;
- when the step samples, the last stage sends the sampled tokens ``[S]`` (int64) to
  stage 0, which writes them into its device token table where the next step's input
  preparation reads them. The tokens never visit a host.

Both go through ``torch.distributed`` point-to-point on the default process group (NCCL on
GPU: enqueued on the current stream, so the host never waits for them; gloo on CPU, where
a receive blocks the step thread until the data is there). ``T``, ``H`` and ``S`` are
known on every rank from the plan and the model, so no shapes travel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from metadata.config import ConfigError


def stage_layers(num_layers: int, pipeline_parallel_size: int, split: list[int] | None = None) -> list[tuple[int, int]]:
    """``[start, end)`` layer range of each stage: ``split`` (layers per stage), or an even
    split with earlier stages taking the remainder (the last stage also runs the LM head
    and sampling). ``ConfigError`` when the split does not fit the model."""
    pp = pipeline_parallel_size
    if split is None:
        if pp > num_layers:
            raise ConfigError(
                f"pipeline_parallel_size={pp} exceeds the model's {num_layers} layers: "
                "every stage needs at least one layer"
            )
        base, extra = divmod(num_layers, pp)
        split = [base + (s < extra) for s in range(pp)]
    elif len(split) != pp or sum(split) != num_layers or min(split) < 1:
        raise ConfigError(
            f"pipeline_layer_split {list(split)} must have {pp} entries "
            f"(pipeline_parallel_size) of at least 1 layer summing to the model's "
            f"{num_layers} layers (sums to {sum(split)})"
        )
    bounds, start = [], 0
    for n in split:
        bounds.append((start, start + n))
        start += n
    return bounds


@dataclass(frozen=True)
class PipelineStage:
    """Which layers this rank's stage runs and its place in the pipeline."""

    index: int = 0
    size: int = 1
    start: int = 0
    end: int | None = None  # None: to the last layer (no pipeline)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.size - 1

    def layer_range(self, num_layers: int) -> range:
        return range(self.start, num_layers if self.end is None else self.end)


WHOLE_MODEL = PipelineStage()


def pipeline_stage(
    rank: int, tp_size: int, pipeline_parallel_size: int, num_layers: int, split: list[int] | None = None
) -> PipelineStage:
    index = rank // tp_size
    start, end = stage_layers(num_layers, pipeline_parallel_size, split)[index]
    return PipelineStage(index, pipeline_parallel_size, start, end)


class PipelineComm:
    """This rank's point-to-point transfers (``torch.distributed`` must be initialised when
    the pipeline has more than one stage)."""

    def __init__(self, stage: PipelineStage, rank: int, tp_size: int):
        self.stage = stage
        tp_rank = rank % tp_size
        self.prev_rank = rank - tp_size
        self.next_rank = rank + tp_size
        self.first_rank = tp_rank
        self.last_rank = (stage.size - 1) * tp_size + tp_rank
        self.sent_hidden = self.received_hidden = 0  # transfers so far (tests, stats)
        self.sent_tokens = self.received_tokens = 0

    def send_hidden(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.send(torch.stack((hidden, residual)), self.next_rank)
        self.sent_hidden += 1

    def recv_hidden(
        self, num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        import torch.distributed as dist

        buf = torch.empty(2, num_tokens, hidden_size, dtype=dtype, device=device)
        dist.recv(buf, self.prev_rank)
        self.received_hidden += 1
        return buf[0], buf[1]

    def send_tokens(self, tokens: torch.Tensor) -> None:
        """The last stage's sampled tokens ``[S]`` to stage 0 (nothing when they are one stage)."""
        import torch.distributed as dist

        dist.send(tokens.contiguous(), self.first_rank)
        self.sent_tokens += 1

    def recv_tokens(self, num_rows: int, device: torch.device) -> torch.Tensor:
        import torch.distributed as dist

        buf = torch.empty(num_rows, dtype=torch.int64, device=device)
        dist.recv(buf, self.last_rank)
        self.received_tokens += 1
        return buf

    def forward(self, model, inp, kv_caches, dtype: torch.dtype):
        """This stage's layers over the step (``inp``: ``workers.step_inputs.StepInputs``); a
        later stage first receives the previous stage's ``(hidden, residual)``."""
        if self.stage.is_first:
            return model(inp.input_ids, inp.positions, inp.meta, kv_caches)
        mid = self.recv_hidden(inp.meta.num_actual_tokens, model.arch.hidden_size, dtype, inp.input_ids.device)
        return model(inp.input_ids, inp.positions, inp.meta, kv_caches, mid)

    def pass_on(self, out: tuple[torch.Tensor, torch.Tensor], inp, st) -> None:
        """A stage before the last ends its step: ``out`` goes to the next stage and the rows
        advance by the step's tokens. When the step samples, stage 0 then receives the sampled
        tokens into its token table ``st`` (``workers.device_state.DeviceState``), on the
        device, where the next step's input preparation reads them."""
        from workers.step_inputs import sampling_rows

        self.send_hidden(*out)
        seq_lens = inp.seq_lens
        st.num_computed[inp.rows] = seq_lens
        if inp.handles and self.stage.is_first:
            rows, pos = sampling_rows(inp, seq_lens)
            st.token_ids[rows, pos] = self.recv_tokens(len(inp.handles), seq_lens.device)

    def stats(self) -> dict:
        return {
            "pp_stage": self.stage.index,
            "pp_layers": [self.stage.start, self.stage.end],
            "pp_sent_hidden": self.sent_hidden,
            "pp_received_hidden": self.received_hidden,
            "pp_sent_tokens": self.sent_tokens,
            "pp_received_tokens": self.received_tokens,
        }


def scratch_model(model, pp: PipelineComm | None, dtype: torch.dtype):
    """The model for start-up scratch passes: itself, or on a pipeline stage (which runs them
    alone) a ``ScratchStage``."""
    return model if pp is None else ScratchStage(model, model.arch.hidden_size, dtype)


class ScratchStage:
    """A pipeline stage's model seen as a whole model, for start-up scratch passes (memory
    profiling, kernel compilation) that run one stage alone: a later stage starts from zero
    hidden states instead of the previous stage's, and an earlier stage's "logits" are its
    hidden states. Every other attribute is the model's."""

    def __init__(self, model, hidden_size: int, dtype: torch.dtype):
        self.model, self.hidden_size, self.dtype = model, hidden_size, dtype

    def __getattr__(self, name):
        return getattr(self.__dict__["model"], name)

    def __call__(self, input_ids, positions, meta, kv_caches):
        if self.model.embed_tokens is not None:
            out = self.model(input_ids, positions, meta, kv_caches)
        else:
            zeros = torch.zeros(input_ids.shape[0], self.hidden_size, dtype=self.dtype, device=input_ids.device)
            out = self.model(input_ids, positions, meta, kv_caches, (zeros, zeros))
        return out[0] if isinstance(out, tuple) else out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden) if self.model.lm_head is not None else hidden
