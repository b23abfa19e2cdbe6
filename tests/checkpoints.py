"""Tiny random-weight checkpoints written with ``transformers`` for tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

ARCHS = ("llama", "qwen2", "qwen3")


def write_tokenizer(out: Path, vocab_size: int) -> None:
    """A word-level tokenizer over the checkpoint's vocabulary (ids 0..vocab-1)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2}
    for i in range(3, vocab_size):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>",
        "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}w3{% endif %}",
    }))


def write_checkpoint(out: Path, arch: str = "llama", *, seed: int = 0, vocab_size: int = 256,
                     hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                     max_pos: int = 512, shards: int = 1, **extra) -> Path:
    """Save a transformers model with random weights; returns the directory."""
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
           "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}[arch]
    kw = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2,
              num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
              max_position_embeddings=max_pos, bos_token_id=0, eos_token_id=1)
    if arch == "qwen3":
        kw["head_dim"] = hidden // heads
    kw.update(extra)
    config = getattr(transformers, cls[0])(**kw)
    torch.manual_seed(seed)
    model = getattr(transformers, cls[1])(config)
    with torch.no_grad():  # larger weights: sharper distributions, fewer greedy near-ties
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    size = None
    if shards > 1:
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        size = f"{max(1, total // shards // 1000)}KB"
    model.save_pretrained(out, safe_serialization=True, **({"max_shard_size": size} if size else {}))
    write_tokenizer(out, vocab_size)
    return out


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own greedy continuation of each prompt (float32, no batching)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            g = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                               pad_token_id=0, min_new_tokens=max_new_tokens)
            outs.append(g[0, len(p):].tolist())
    return outs
