"""Rotary-embedding tables (cos|sin cache) for the rope types checkpoints declare."""

from __future__ import annotations

import math

import torch

from workers.models.arch import SUPPORTED_ROPE_TYPES, UnsupportedRope, rope_type_of


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    rope_type = rope_type_of(scaling)
    if rope_type == "default":
        return inv
    if rope_type == "linear":
        return inv / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise UnsupportedRope(
        f"rope type '{rope_type}' is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)}); "
        "'dynamic' scaling would need exact CPU sequence lengths at every step"
    )


def cos_sin_cache(head_dim: int, max_pos: int, theta: float, scaling: dict | None, dtype) -> torch.Tensor:
    """[max_pos, head_dim] = cat(cos, sin) over the first head_dim/2 frequencies."""
    inv = inverse_frequencies(head_dim, theta, scaling)
    t = torch.arange(max_pos, dtype=torch.float64)
    freqs = torch.outer(t, inv)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)
