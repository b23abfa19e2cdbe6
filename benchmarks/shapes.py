"""Random-weight models of real shapes, built without any download.

``write_shape(dir, "qwen3-0.6b")`` writes the model's real ``config.json`` plus a
word-level ``tokenizer.json`` over its vocabulary, so the engine loads it with
``load_format="dummy"`` (random weights generated on the device from the config
alone). ``shape_dir(name)`` does that once into a cache folder and returns it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from cluster.cache_dir import syncless_cache_dir

SHAPES_VERSION = "v1"

_LLAMA3_ROPE_1B = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_LLAMA3_ROPE_8B = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

SHAPES: dict[str, dict] = {
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": True,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
    },
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "tie_word_embeddings": True,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": _LLAMA3_ROPE_1B,
        "rms_norm_eps": 1e-5,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
    },
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": False,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": _LLAMA3_ROPE_8B,
        "rms_norm_eps": 1e-5,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
    },
    # a Qwen3-0.6B-class draft for Llama-3.1-8B: Qwen3-0.6B dimensions, Llama-3 vocabulary
    "qwen3-0.6b-llama3-vocab": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 128256,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": True,
        "max_position_embeddings": 131072,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
    },
    # CPU tests: seconds, not minutes.
    "tiny": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "tie_word_embeddings": False,
        "max_position_embeddings": 8192,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    },
    "tiny-draft": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 512,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "tie_word_embeddings": True,
        "max_position_embeddings": 8192,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    },
    "tiny-qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "tie_word_embeddings": True,
        "max_position_embeddings": 8192,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    },
}
# Word-level tokenizer specials (ids 0..2); every other id is the word "w<id>".
BOS_ID, EOS_ID, UNK_ID = 0, 1, 2


def config_for(shape: str) -> dict:
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    cfg = dict(SHAPES[shape])
    cfg.update(bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    return cfg


def write_tokenizer(out: Path, vocab_size: int, max_len: int) -> None:
    """A word-level tokenizer: <s>, </s>, <unk>, then "w3" ... "w<vocab-1>"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<s>": BOS_ID, "</s>": EOS_ID, "<unk>": UNK_ID}
    vocab.update((f"w{i}", i) for i in range(3, vocab_size))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "pad_token": "<unk>",
                "model_max_length": max_len,
                "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}",
            },
            indent=1,
        )
    )


def write_shape(out: str | Path, shape: str) -> Path:
    """Write config.json + tokenizer for ``shape`` into ``out`` (no weights)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = config_for(shape)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    write_tokenizer(out, cfg["vocab_size"], cfg["max_position_embeddings"])
    (out / "SHAPE").write_text(f"{shape} {SHAPES_VERSION}\n")
    return out


def cache_root() -> Path:
    return syncless_cache_dir() / "shapes"


def shape_dir(shape: str) -> Path:
    """The cached checkpoint folder of ``shape``, written on first use (atomically)."""
    config_for(shape)  # validates the name
    out = cache_root() / f"{shape}-{SHAPES_VERSION}"
    if (out / "SHAPE").exists():
        return out
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    write_shape(tmp, shape)
    try:
        tmp.rename(out)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_model(model: str | None, shape: str | None) -> tuple[str, str]:
    """(model dir, load_format) for ``--model DIR`` or ``--shape NAME``."""
    if model and shape:
        raise SystemExit("give --model or --shape, not both")
    if shape:
        return str(shape_dir(shape)), "dummy"
    if model:
        return model, "safetensors"
    raise SystemExit("give --shape NAME (random weights, no download) or --model DIR")
