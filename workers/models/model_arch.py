"""What the engine needs to know about a model (``ModelArch``), and the error for a checkpoint
it cannot serve; filled from a ``config.json`` (``workers.models.arch``) or a GGUF file's
metadata (``workers.models.gguf_arch``). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass


class ModelLoadError(ValueError):
    """The checkpoint cannot be served; the message says why and what is supported."""


@dataclass(frozen=True)
class ModelArch:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    mlp_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str | None
    quantization: str | None = None
    """'fp8' for a checkpoint whose projections are stored in FP8 (``weight_scale`` tensors)."""
    sliding_window: int | None = None
    """A token attends to the last ``sliding_window`` positions only (Mistral v0.1, Qwen2 with
    ``use_sliding_window``). Not implemented: such a model is served only up to a context that
    fits the window, where both attentions are the same (``usable_context``)."""

    def usable_context(self) -> int:
        """The longest context served exactly: ``max_position_embeddings``, or the sliding window
        when it is shorter (inside it, windowed and full attention see the same positions)."""
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    def kv_bytes_per_token(self, dtype_bytes: int, tp_size: int = 1) -> int:
        kv_heads = max(1, self.num_kv_heads // tp_size)
        return 2 * self.num_layers * kv_heads * self.head_dim * dtype_bytes
