"""Read a GGUF file's architecture into a ``ModelArch`` (torch-free: the driver uses it).

Llama (Mistral's files too), Phi-3, Qwen2 and Qwen3 files are served; their weights may be
stored as F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 or one of the K-quants (Q2_K .. Q6_K)
and are dequantized at load (``workers.models.gguf_loader``). Anything else is refused here,
before any worker starts, with a ``ModelLoadError`` naming what is supported.
"""

from __future__ import annotations

from pathlib import Path

from workers.models.model_arch import ModelArch, ModelLoadError

# general.architecture -> the Hugging Face class the same weights would have
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
SUPPORTED_QUANT_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)
SUPPORTED_ROPE_SCALING = ("none", "linear")


def is_gguf(path: str | Path) -> bool:
    return str(path).lower().endswith(".gguf")


def open_gguf(path: str | Path):
    """A ``GGUFFile`` over ``path`` (memory-mapped; ``fields`` and ``tensors`` as a
    ``gguf.GGUFReader``'s, parsed in tens of ms); a clear error if it is not one."""
    try:
        import gguf  # noqa: F401 - its constants name the value and tensor types
    except ImportError:
        raise ModelLoadError(
            f"{path}: reading GGUF files needs the 'gguf' package (pip install 'gguf>=0.10')"
        ) from None
    from workers.models.gguf_file import GGUFFile

    p = Path(path)
    if not p.is_file():
        raise ModelLoadError(f"{path}: no such GGUF file")
    try:
        return GGUFFile(p)
    except Exception as exc:  # noqa: BLE001 - bad magic, truncated file, unknown value type ...
        raise ModelLoadError(f"{path}: not a readable GGUF file ({exc})") from None


def field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def load_gguf_arch(path: str | Path, reader=None) -> ModelArch:
    """The ``ModelArch`` a GGUF file describes; refuses unsupported architectures,
    tensor types and rope scalings with a message saying what is supported."""
    reader = reader if reader is not None else open_gguf(path)
    name = field(reader, "general.architecture")
    if name not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: unsupported GGUF architecture {name!r}; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    bad = sorted({t.tensor_type.name for t in reader.tensors} - set(SUPPORTED_QUANT_TYPES))
    if bad:
        raise ModelLoadError(
            f"{path}: unsupported GGUF tensor type(s) {', '.join(bad)}; supported: {', '.join(SUPPORTED_QUANT_TYPES)}"
        )

    def key(suffix: str, default=None, required: bool = False):
        v = field(reader, f"{name}.{suffix}", default)
        if required and v is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks '{name}.{suffix}'")
        return v

    tensors = {t.name for t in reader.tensors}
    hidden = int(key("embedding_length", required=True))
    heads = int(key("attention.head_count", required=True))
    kv_heads = key("attention.head_count_kv", heads)
    if not isinstance(kv_heads, int):  # a per-layer list: only uniform layers are served
        if len(set(kv_heads)) != 1:
            raise ModelLoadError(f"{path}: per-layer KV head counts {kv_heads} are not supported")
        kv_heads = kv_heads[0]
    head_dim = key("attention.key_length") or (key("rope.dimension_count") if name == "llama" else None)
    head_dim = int(head_dim or hidden // heads)
    if key("attention.value_length", head_dim) != head_dim:
        raise ModelLoadError(f"{path}: attention value length differs from key length (not supported)")
    if key("rope.dimension_count", head_dim) != head_dim:
        raise ModelLoadError(f"{path}: partial rotary embeddings are not supported")
    scaling_type = key("rope.scaling.type", "none")
    if scaling_type not in SUPPORTED_ROPE_SCALING:
        raise ModelLoadError(
            f"{path}: rope scaling {scaling_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_SCALING)})"
        )
    scaling = None
    if scaling_type == "linear" and float(key("rope.scaling.factor", 1.0)) != 1.0:
        scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    tokens = field(reader, "tokenizer.ggml.tokens")
    vocab = key("vocab_size") or (len(tokens) if tokens is not None else None)
    if vocab is None:
        vocab = next((t.shape[-1] for t in reader.tensors if t.name == "token_embd.weight"), None)
    if vocab is None:
        raise ModelLoadError(f"{path}: cannot tell the vocabulary size (no token_embd.weight)")
    # llama.cpp stops at EOS and at end-of-turn tokens
    eos = tuple(
        dict.fromkeys(
            int(i)
            for i in (field(reader, "tokenizer.ggml.eos_token_id"), field(reader, "tokenizer.ggml.eot_token_id"))
            if i is not None
        )
    )
    if "blk.0.ffn_gate_inp.weight" in tensors:
        raise ModelLoadError(f"{path}: mixture-of-experts GGUF files are not supported")
    if "rope_factors_long.weight" in tensors:
        raise ModelLoadError(f"{path}: longrope scaling (Phi-3 128k) is not supported")
    window = key("attention.sliding_window")
    return ModelArch(
        architecture=GGUF_ARCHITECTURES[name],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length", required=True)),
        num_layers=int(key("block_count", required=True)),
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(key("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors,
        mlp_bias="blk.0.ffn_down.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        eos_token_ids=eos,
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"),
        torch_dtype=None,
        sliding_window=int(window) if window else None,
    )
