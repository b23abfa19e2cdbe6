"""Parse a Hugging Face ``config.json`` (or, by suffix, a ``.gguf`` file) into the shape this
engine needs."""

from __future__ import annotations

import json
from pathlib import Path

from workers.models.gguf_arch import is_gguf, load_gguf_arch
from workers.models.model_arch import ModelArch, ModelLoadError

# Mistral is Llama's layout (its own head_dim, an optional sliding window); Phi-3 too, with its
# q|k|v and gate|up projections stored fused (the loader splits them)
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Phi3ForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
_WINDOWED = ("MistralForCausalLM", "Phi3ForCausalLM")  # a sliding_window these set is on


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedRope(ValueError):
    pass


def rope_type_of(scaling: dict | None) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default")) or "default"


def check_rope_scaling(scaling: dict | None) -> None:
    """Refuse a rope type ``workers.models.rope`` cannot build (pure: no torch, so the driver
    reads an architecture without importing the model code)."""
    rope_type = rope_type_of(scaling)
    if rope_type in ("linear", "llama3"):
        float(scaling["factor"])
    if rope_type == "llama3":
        float(scaling["original_max_position_embeddings"])
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedRope(
            f"rope type '{rope_type}' is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)}); "
            "'dynamic' scaling would need exact CPU sequence lengths at every step"
        )


def load_arch(model_dir: str | Path) -> ModelArch:
    """A checkpoint directory's ``config.json``, or a ``.gguf`` file's metadata."""
    if is_gguf(model_dir):
        return load_gguf_arch(model_dir)
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{model_dir}: no config.json (expected a Hugging Face checkpoint directory)")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path}: not valid JSON ({exc})") from None
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"unsupported architecture {archs or cfg.get('model_type')!r} in {path}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    window = None  # Mistral's is on when set; Qwen2 keeps one in its config, on only with use_sliding_window
    if cfg.get("sliding_window") and (arch in _WINDOWED or cfg.get("use_sliding_window")):
        window = int(cfg["sliding_window"])
    rope = cfg.get("rope_parameters") or {}
    rotary = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    rotary = float(rotary if rotary is not None else 1.0)
    if rotary != 1.0:
        raise ModelLoadError(f"{path}: partial rotary embeddings (partial_rotary_factor {rotary}) are not supported")
    heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or (rope if rope else None)
    head_dim = cfg.get("head_dim") or hidden // heads
    check_rope_scaling(scaling)  # refuses unsupported rope types now
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    qwen2 = arch == "Qwen2ForCausalLM"
    return ModelArch(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=True if qwen2 else bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
        eos_token_ids=eos_ids,
        bos_token_id=cfg.get("bos_token_id"),
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        quantization=checkpoint_quantization(cfg.get("quantization_config"), path),
        sliding_window=window,
    )


def checkpoint_quantization(qcfg: dict | None, path: Path) -> str | None:
    """'fp8' for an FP8 checkpoint (``quant_method`` 'fp8', or 'compressed-tensors' with
    float 8-bit weights as llm-compressor writes them), None for an unquantized one; any
    other scheme is refused."""
    if not qcfg:
        return None
    method = qcfg.get("quant_method")
    if qcfg.get("weight_block_size") or qcfg.get("strategy") == "block":
        raise ModelLoadError(
            f"{path}: FP8 with block scales (weight_block_size {qcfg.get('weight_block_size')}) is not "
            "supported; per-tensor or per-row scales only"
        )
    if method == "fp8":
        return "fp8"
    if method == "compressed-tensors":
        groups = (qcfg.get("config_groups") or {}).values()
        weights = [g.get("weights") or {} for g in groups]
        if not weights and qcfg.get("kv_cache_scheme"):
            return None  # 16-bit weights; only the KV-cache scales (k_scale / v_scale) are stored
        if weights and all(w.get("type") == "float" and w.get("num_bits") == 8 for w in weights):
            if any(w.get("strategy") not in ("tensor", "channel") for w in weights):
                raise ModelLoadError(
                    f"{path}: FP8 weights with strategy {[w.get('strategy') for w in weights]} are not "
                    "supported (per-tensor or per-channel scales only)"
                )
            return "fp8"
    raise ModelLoadError(
        f"{path}: quantization {method!r} is not supported; supported: FP8 checkpoints (quant_method "
        "'fp8' or compressed-tensors float8), or an unquantized checkpoint with quantization='fp8'"
    )
