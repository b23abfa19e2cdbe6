"""Tiny random-weight checkpoints written with ``transformers`` for tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

ARCHS = ("llama", "mistral", "phi3", "qwen2", "qwen3")


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
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
                "{% if add_generation_prompt %}w3{% endif %}",
            }
        )
    )


def write_checkpoint(
    out: Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    vocab_size: int = 256,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    max_pos: int = 512,
    shards: int = 1,
    **extra,
) -> Path:
    """Save a transformers model with random weights; returns the directory."""
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    cls = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "mistral": ("MistralConfig", "MistralForCausalLM"),
        "phi3": ("Phi3Config", "Phi3ForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    }[arch]
    kw = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_pos,
        bos_token_id=0,
        eos_token_id=1,
    )
    if arch == "qwen3":
        kw["head_dim"] = hidden // heads
    if arch == "phi3":
        kw["pad_token_id"] = 0
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
            g = model.generate(
                ids,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                min_new_tokens=max_new_tokens,
            )
            outs.append(g[0, len(p) :].tolist())
    return outs


_GGUF_ARCH = {
    "LlamaForCausalLM": "llama",
    "Phi3ForCausalLM": "phi3",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_GGUF_NAMES = {  # Hugging Face suffix -> GGUF block tensor (llama.cpp's names)
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.qkv_proj": "attn_qkv",  # Phi-3's fused tensors
    "mlp.gate_up_proj": "ffn_up",
}


def write_gguf(hf_dir: Path, out: Path, qtype: str = "F32", rope_freqs=None) -> Path:
    """Convert a tiny checkpoint of ``write_checkpoint`` to a GGUF file as llama.cpp's
    converter does (its tensor names, Q/K rows permuted for Llama, 2-D weights stored as
    ``qtype``, norms as F32); ``rope_freqs``: llama.cpp's per-frequency rope divisors."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = _GGUF_ARCH[cfg["architectures"][0]]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or {}
    w = gguf.GGUFWriter(str(out), arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_vocab_size(cfg["vocab_size"])
    w.add_rope_dimension_count(head_dim)
    if arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    if cfg.get("pad_token_id") is not None:
        w.add_pad_token_id(cfg["pad_token_id"])
    qt = gguf.GGMLQuantizationType[qtype]

    def permute(t, n_head):  # llama.cpp's LlamaModel.permute
        return t.reshape(n_head, 2, t.shape[0] // n_head // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    tensors = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    for name, t in tensors.items():
        a = t.float().numpy()
        if name == "model.embed_tokens.weight":
            g = "token_embd.weight"
        elif name == "model.norm.weight":
            g = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.get("tie_word_embeddings"):
                continue
            g = "output.weight"
        else:
            parts = name.removeprefix("model.layers.").split(".")
            g = f"blk.{parts[0]}.{_GGUF_NAMES['.'.join(parts[1:-1])]}.{parts[-1]}"
            if arch == "llama" and ".attn_q." in g:
                a = permute(a, heads)
            elif arch == "llama" and ".attn_k." in g:
                a = permute(a, kv)
        if a.ndim == 2 and qt != gguf.GGMLQuantizationType.F32:
            w.add_tensor(g, gguf.quants.quantize(a, qt), raw_dtype=qt)
        else:
            w.add_tensor(g, a.astype(np.float32))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def hf_gguf_greedy(
    gguf_file: Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    dtype=torch.float32,
    device: str = "cpu",
    top_logprobs: int = 0,
):
    """transformers' own load of a GGUF file (its dequantization and Q/K unpermute), greedy:
    the tokens of each prompt, and with ``top_logprobs`` also each step's top log-probabilities
    (``{token: logprob}`` dicts) as a second list."""
    import transformers

    model = (
        transformers.AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name, dtype=dtype)
        .to(device)
        .eval()
    )
    model.generation_config.eos_token_id = None  # plain argmax: never stop, never suppress EOS
    outs, tops = [], []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            g = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
                output_logits=bool(top_logprobs),
                return_dict_in_generate=True,
            )
            outs.append(g.sequences[0, len(p) :].tolist())
            if top_logprobs:
                steps = []
                for logits in g.logits:
                    lp = torch.log_softmax(logits[0].float(), dim=-1)
                    v, i = lp.topk(top_logprobs)
                    steps.append(dict(zip(i.tolist(), v.tolist())))
                tops.append(steps)
    return (outs, tops) if top_logprobs else outs
