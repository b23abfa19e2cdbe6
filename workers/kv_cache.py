"""Paged KV cache sizing and allocation."""

from __future__ import annotations

import math

import numpy as np
import torch

from metadata.config import EngineConfig
from workers.models.arch import ModelArch

DEFAULT_CPU_KV_BYTES = 1 << 30


def bytes_per_block(arch: ModelArch, num_kv_heads_local: int, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty(0, dtype=dtype).element_size()
    return 2 * arch.num_layers * block_size * num_kv_heads_local * arch.head_dim * elem


def num_blocks_for_budget(cfg: EngineConfig, per_block: int, budget_bytes: int | None) -> int:
    """Blocks to allocate: the explicit count, else the budget (explicit bytes, else
    ``budget_bytes`` measured by the runner, else the CPU default)."""
    if cfg.cache.num_kv_blocks is not None:
        return cfg.cache.num_kv_blocks
    budget = cfg.cache.kv_cache_memory_bytes or budget_bytes or DEFAULT_CPU_KV_BYTES
    n = budget // per_block
    if n < 1:
        raise RuntimeError(
            f"KV cache budget of {budget} bytes holds no block of {per_block} bytes; "
            "raise kv_cache_memory_bytes / gpu_memory_utilization or lower block_size"
        )
    return int(n)


def allocate(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [(_zeros(shape, dtype, device), _zeros(shape, dtype, device)) for _ in range(num_layers)]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed cache tensor. On the CPU its pages come from calloc (numpy), which the OS
    zeroes when first touched: the default 1 GiB cache costs no time at start-up and only the
    blocks in use take memory (``torch.zeros`` writes every byte first)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)
