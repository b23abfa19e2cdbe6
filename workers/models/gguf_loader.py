"""Weights of a GGUF file as Hugging Face-named float32 tensors (worker side).

Each worker reads the file itself (its path is in the config): nothing crosses a process
boundary but the path. Quantized tensors are dequantized with ``gguf.quants.dequantize``;
the loader (``workers.models.loader``) casts them to the run dtype and shards them like
safetensors weights (Phi-3's fused q|k|v and gate|up split as its safetensors ones are).
llama.cpp's converter permutes the rows of a Llama-family model's
Q and K projections (to its own rotary layout, pairs interleaved per head); that is
undone here. Qwen2/Qwen3 files are converted without the permutation.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from workers.models.gguf_arch import field, load_gguf_arch, open_gguf
from workers.models.model_arch import ModelArch, ModelLoadError

_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3: q|k|v in one tensor (the loader splits it)
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# tensors llama.cpp stores that the model does not need (rope_freqs is applied separately)
_SKIP = {"rope_freqs.weight"}


def hf_name(gguf_name: str, fused_ffn: bool = False) -> str | None:
    """The Hugging Face checkpoint name of a GGUF tensor; None for an unknown one.
    ``fused_ffn``: ``ffn_up`` holds gate|up (Phi-3), as Hugging Face's ``gate_up_proj``."""
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _BLOCK:
        part = "mlp.gate_up_proj" if fused_ffn and m.group(2) == "ffn_up" else _BLOCK[m.group(2)]
        return f"model.layers.{m.group(1)}.{part}.{m.group(3)}"
    return None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of Q/K rows: per head, its converter reorders rows from
    (half, pair index) to (pair index, half) so that rotary pairs are adjacent; this restores
    Hugging Face's rotate-half order (weights [rows, cols] and biases [rows])."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFCheckpoint:
    """One GGUF file opened (memory-mapped) once for its weights and rope factors."""

    def __init__(self, path: str | Path):
        self.path = path
        self.reader = open_gguf(path)  # parsed once per process (tens of ms)
        self.arch: ModelArch = load_gguf_arch(path, self.reader)
        name = field(self.reader, "general.architecture")
        self.llama, self.fused_ffn = name == "llama", name == "phi3"  # (fused_ffn: gate|up in ffn_up)

    def tensors(self, wanted=None) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, float32 tensor) for every weight (or each one whose name
        ``wanted`` accepts: the others are never dequantized), dequantized and, for Llama,
        with Q/K rows restored. Unknown names pass through unchanged (the loader refuses them)."""
        for t in self.reader.tensors:
            name = hf_name(t.name, self.fused_ffn) or t.name
            if t.name in _SKIP or (wanted is not None and not wanted(name)):
                continue
            w = _dequantize(t)
            if self.llama and ".attn_q." in t.name:
                w = unpermute_qk(w, self.arch.num_heads)
            elif self.llama and ".attn_k." in t.name:
                w = unpermute_qk(w, self.arch.num_kv_heads)
            yield name, torch.from_numpy(w)

    def rope_factors(self) -> torch.Tensor | None:
        """llama.cpp's per-frequency rope divisors (``rope_freqs.weight``, written for Llama 3
        rope scaling), or None."""
        for t in self.reader.tensors:
            if t.name == "rope_freqs.weight":
                return torch.from_numpy(_dequantize(t).ravel())
        return None


def _dequantize(t) -> np.ndarray:
    from gguf.quants import dequantize

    w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
    if not w.flags.writeable:  # F32 tensors come back as views of the read-only map
        w = w.copy()
    return w.reshape([int(d) for d in reversed(t.shape)])  # GGUF lists dims fastest first


def cos_sin_with_factors(arch: ModelArch, max_pos: int, factors: torch.Tensor) -> torch.Tensor:
    """``rope.cos_sin_cache`` with each inverse frequency divided by its factor (llama.cpp)."""
    from workers.models.rope import inverse_frequencies

    inv = inverse_frequencies(arch.head_dim, arch.rope_theta, arch.rope_scaling)
    if factors.numel() != inv.numel():
        raise ModelLoadError(f"rope_freqs has {factors.numel()} entries, expected {inv.numel()}")
    inv = inv / factors.to(torch.float64)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(torch.float32)
