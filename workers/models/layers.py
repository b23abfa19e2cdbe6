"""Tensor-parallel building blocks. Each parameter carries a ``shard`` rule the
loader applies to the full checkpoint tensor, so checkpoints load unchanged at
any tensor-parallel size."""

from __future__ import annotations

import torch
from torch import nn

from kernels import ops
from workers.distributed import TPGroup


def _param(shape: tuple[int, ...], dtype: torch.dtype, shard: tuple[int, int, int] | None) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.shard = shard  # (dim, rank, size) or None for replicated
    return p


class _Sharded(nn.Module):
    """Keeps each parameter's ``shard`` rule across ``to_empty`` / ``to`` (which may
    replace the Parameter objects, e.g. meta -> device, dropping their attributes)."""

    def _apply(self, fn, recurse=True):
        rules = {n: getattr(p, "shard", None) for n, p in self._parameters.items() if p is not None}
        out = super()._apply(fn, recurse)
        for n, rule in rules.items():
            if self._parameters.get(n) is not None:
                self._parameters[n].shard = rule
        return out


class ColumnParallelLinear(_Sharded):
    """y = x W^T with W split by output rows across ranks (output stays sharded)."""

    def __init__(self, in_f: int, out_f: int, bias: bool, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        if out_f % tp.size:
            raise ValueError(f"output size {out_f} is not divisible by tensor_parallel_size {tp.size}")
        self.weight = _param((out_f // tp.size, in_f), dtype, (0, tp.rank, tp.size))
        self.bias = _param((out_f // tp.size,), dtype, (0, tp.rank, tp.size)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class MergedColumnLinear(nn.Module):
    """Several column-parallel projections fused into one matmul (q|k|v, gate|up).

    ``parts[i] = (start, length)``: the rows of checkpoint tensor i that this rank
    holds (a slice for sharded heads, a whole head for replicated KV heads).
    ``interleave`` (equal parts): row ``j`` of part ``i`` lands at row ``j * len(parts) + i``
    instead of after the previous part (gate|up as (gate j, up j) pairs, which the decode
    GEMV streams as one contiguous row set: ``act="silu_and_mul_pairs"``).
    """

    def __init__(
        self, in_f: int, parts: list[tuple[int, int]], bias: bool, dtype: torch.dtype, interleave: bool = False
    ):
        super().__init__()
        if interleave and len({n for _, n in parts}) != 1:
            raise ValueError(f"interleaved parts must have equal lengths, got {parts}")
        self.parts = parts
        self.interleave = interleave
        self.offsets = [sum(n for _, n in parts[:i]) for i in range(len(parts))]
        total = sum(n for _, n in parts)
        self.weight = _param((total, in_f), dtype, None)
        self.bias = _param((total,), dtype, None) if bias else None
        self.weight_scale = self.input_scale = None  # FP8 (``fp8_layout``, ``quantize_fp8``)

    def load_part(self, target: torch.Tensor, tensor: torch.Tensor, index: int) -> None:
        """Copy this rank's rows of checkpoint part ``index`` into ``target`` (weight or bias)."""
        start, length = self.parts[index]
        if target is self.weight_scale and tensor.numel() == 1:  # a per-tensor FP8 scale: every row
            tensor = tensor.reshape(1).expand(start + length)
        rows = tensor.narrow(0, start, length)
        if target is self.weight_scale:
            rows = rows.reshape(length)
        if self.interleave:
            target.data[index :: len(self.parts)].copy_(rows)
        else:
            off = self.offsets[index]
            target.data[off : off + length].copy_(rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias, weight_scale=self.weight_scale, input_scale=self.input_scale)[0]

    def norm_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: "RMSNorm", act: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``act(self(norm(x [+ residual])))`` and the new residual (``x`` itself when
        ``residual`` is None, the first layer). One launch at decode batch sizes on CUDA
        (``ops.linear``'s skinny GEMM fuses the norm and the activation)."""
        y, new_res = ops.linear(
            x,
            self.weight,
            self.bias,
            weight_scale=self.weight_scale,
            input_scale=self.input_scale,
            residual=residual,
            norm_weight=norm.weight,
            eps=norm.eps,
            act=act,
        )
        return y, (x if residual is None else new_res)


def fp8_layout(linear: nn.Module) -> None:
    """Turn a (meta) ``MergedColumnLinear`` / ``RowParallelLinear`` into the FP8 checkpoint
    layout before loading: an e4m3 weight and a float32 ``weight_scale`` per output row (a
    checkpoint's per-tensor scale fills its part's rows)."""
    w = linear.weight
    linear.weight = _param(tuple(w.shape), torch.float8_e4m3fn, getattr(w, "shard", None))
    linear.weight_scale = _param((w.shape[0],), torch.float32, None)


def quantize_fp8(linear: nn.Module) -> None:
    """Quantize a loaded 16/32-bit projection in place: e4m3 weight, one scale per output row."""
    from kernels.fp8_reference import quantize_weight_fp8

    w = linear.weight
    wq, scale = quantize_weight_fp8(w.data)
    linear.weight = nn.Parameter(wq, requires_grad=False)
    linear.weight.shard = getattr(w, "shard", None)
    linear.weight_scale = nn.Parameter(scale, requires_grad=False)
    linear.weight_scale.shard = None


def shard_rows(full: int, tp: TPGroup) -> tuple[int, int]:
    if full % tp.size:
        raise ValueError(f"size {full} is not divisible by tensor_parallel_size {tp.size}")
    n = full // tp.size
    return tp.rank * n, n


class RowParallelLinear(_Sharded):
    """y = x W^T with W split by input columns; partial sums are all-reduced."""

    def __init__(self, in_f: int, out_f: int, bias: bool, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        if in_f % tp.size:
            raise ValueError(f"input size {in_f} is not divisible by tensor_parallel_size {tp.size}")
        self.tp = tp
        self.weight = _param((out_f, in_f // tp.size), dtype, (1, tp.rank, tp.size))
        # the bias is added once, after the reduction
        self.bias = _param((out_f,), dtype, None) if bias else None
        self.weight_scale = self.input_scale = None  # FP8 (``fp8_layout``, ``quantize_fp8``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ops.linear(x, self.weight, weight_scale=self.weight_scale, input_scale=self.input_scale)[0]
        y = self.tp.all_reduce(y)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(_Sharded):
    """Embedding rows split across ranks; out-of-shard ids contribute zeros, then all-reduce."""

    def __init__(self, vocab: int, dim: int, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        self.per_rank = (vocab + tp.size - 1) // tp.size
        self.start = tp.rank * self.per_rank
        self.vocab = vocab
        self.weight = _param((self.per_rank, dim), dtype, (0, tp.rank, tp.size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return nn.functional.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.per_rank)
        emb = nn.functional.embedding(local.clamp(0, self.per_rank - 1), self.weight)
        emb = emb * inside.unsqueeze(-1).to(emb.dtype)
        return self.tp.all_reduce(emb)


class ParallelLMHead(_Sharded):
    """Vocab-sharded output projection; logits are gathered to every rank."""

    def __init__(self, vocab: int, dim: int, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        self.vocab = vocab
        self.per_rank = (vocab + tp.size - 1) // tp.size
        self.weight = _param((self.per_rank, dim), dtype, (0, tp.rank, tp.size))

    @property
    def padded_vocab(self) -> int:
        """The gathered logits' row stride: the vocabulary rounded up to a multiple of the TP size."""
        return self.per_rank * self.tp.size

    def forward(self, h: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Logits, optionally widened to ``out_dtype`` (rounded to the weights' dtype
        first, as ``linear(...).to(out_dtype)`` would be; fused into the skinny GEMM)."""
        logits = ops.linear(h, self.weight, out_dtype=out_dtype)[0]
        return self.tp.all_gather_last_dim(logits)[..., : self.vocab]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = _param((dim,), dtype, None)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return ops.rms_norm(x, self.weight, self.eps, residual)
