"""The random-weight demo model, for tests only (its answers are noise; the served default
is SmolLM2-135M-Instruct, ``cluster.model_source``): a small Llama-architecture checkpoint
with a byte-level tokenizer, written once, deterministically (seeded generator, fixed shapes),
to a cache folder and loaded through the same safetensors path as any user model. Tests ask
for it explicitly: ``LLM(model=str(ensure_demo_model()))``."""

from __future__ import annotations

import json
import os
from pathlib import Path

from cluster.cache_dir import syncless_cache_dir

DEMO_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 259,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "torch_dtype": "float32",
}
DEMO_VERSION = "v1"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def demo_model_dir() -> Path:
    return syncless_cache_dir() / f"demo-llama-{DEMO_VERSION}"


def _write_tokenizer(out: Path) -> None:
    """Byte-level tokenizer: 256 byte tokens plus <s>, </s>, <pad> (no merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda c: ord(c))
    vocab = {c: i for i, c in enumerate(byte_chars)}
    for i, name in enumerate(["<s>", "</s>", "<pad>"]):
        vocab[name] = 256 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    from tokenizers import AddedToken

    tok.add_special_tokens(
        [AddedToken("<s>", special=True), AddedToken("</s>", special=True), AddedToken("<pad>", special=True)]
    )
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "add_bos_token": False,
                "chat_template": CHAT_TEMPLATE,
                "model_max_length": DEMO_CONFIG["max_position_embeddings"],
            },
            indent=1,
        )
    )


def _write_weights(out: Path) -> None:
    import torch
    from safetensors.torch import save_file

    c = DEMO_CONFIG
    g = torch.Generator().manual_seed(1234)
    h, inter, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).contiguous()

    t = {
        "model.embed_tokens.weight": w(c["vocab_size"], h),
        "model.norm.weight": torch.ones(h),
        "lm_head.weight": w(c["vocab_size"], h),
    }
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t.update(
            {
                p + "self_attn.q_proj.weight": w(q, h),
                p + "self_attn.k_proj.weight": w(kv, h),
                p + "self_attn.v_proj.weight": w(kv, h),
                p + "self_attn.o_proj.weight": w(h, q),
                p + "mlp.gate_proj.weight": w(inter, h),
                p + "mlp.up_proj.weight": w(inter, h),
                p + "mlp.down_proj.weight": w(h, inter),
                p + "input_layernorm.weight": torch.ones(h),
                p + "post_attention_layernorm.weight": torch.ones(h),
            }
        )
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})


def ensure_demo_model() -> Path:
    out = demo_model_dir()
    if (out / "DONE").exists():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(DEMO_CONFIG, indent=1))
    _write_tokenizer(tmp)
    _write_weights(tmp)
    (tmp / "DONE").write_text("ok\n")
    try:
        tmp.rename(out)
    except OSError:  # another process won the race
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out
