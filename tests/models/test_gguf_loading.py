"""GGUF checkpoints written by the test itself (llama.cpp's layout, ``gguf.GGUFWriter``): our
load equals transformers' own GGUF load token for token; unsupported files are refused."""

import random

import numpy as np
import pytest

from cluster import LLM, SamplingParams
from tests.checkpoints import hf_gguf_greedy, hf_greedy, write_gguf
from workers.models.arch import ModelLoadError, load_arch

MAX_NEW = 10


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (5, 23, 40)]


def _generate(gguf_file, tokenizer_dir, prompts, n=MAX_NEW):
    llm = LLM(model=str(gguf_file), tokenizer=str(tokenizer_dir), block_size=8, num_kv_blocks=64, max_model_len=128)
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        )
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    "arch,qtype,extra",
    [
        ("llama", "F32", {}),
        ("llama", "Q8_0", {"tie_word_embeddings": True}),
        ("qwen3", "F16", {"head_dim": 128}),  # transformers reads no head_dim for qwen3 GGUF: 128
        ("qwen2", "BF16", {}),
        ("phi3", "Q8_0", {}),  # fused attn_qkv and ffn_up (gate|up)
    ],
    ids=["llama-f32", "llama-q8_0-tied", "qwen3-f16", "qwen2-bf16", "phi3-q8_0"],
)
def test_gguf_greedy_matches_transformers_gguf(ray_local, ckpt_dir, tmp_path, arch, qtype, extra):
    hf_dir = ckpt_dir(arch, **extra)
    f = write_gguf(hf_dir, tmp_path / f"{arch}-{qtype}.gguf", qtype)
    a = load_arch(f)
    assert a.architecture == load_arch(hf_dir).architecture
    assert (a.tie_word_embeddings, a.qk_norm, a.qkv_bias) == (
        bool(extra.get("tie_word_embeddings")),
        arch == "qwen3",
        arch == "qwen2",
    )
    prompts = _prompts(a.vocab_size)
    expected = hf_gguf_greedy(f, prompts, MAX_NEW)
    assert _generate(f, hf_dir, prompts) == expected
    if qtype == "F32":  # lossless: also the original checkpoint's own output
        assert expected == hf_greedy(hf_dir, prompts, MAX_NEW)


def test_gguf_rope_freqs_apply_llama3_scaling(ray_local, ckpt_dir, tmp_path):
    """llama.cpp stores Llama 3 rope scaling as per-frequency divisors (``rope_freqs``);
    transformers' GGUF load ignores them, so the reference is the original checkpoint."""
    import torch
    import transformers

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    hf_dir = ckpt_dir("llama", rope_scaling=scaling)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    scaled = model.model.rotary_emb.inv_freq.double()
    d = scaled.numel() * 2
    plain = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    factors = (plain / scaled).numpy()
    assert (factors > 1.5).any(), "the scaling should change some frequencies"
    f = write_gguf(hf_dir, tmp_path / "llama3-rope.gguf", "F32", rope_freqs=factors)
    prompts = _prompts(256)
    assert _generate(f, hf_dir, prompts) == hf_greedy(hf_dir, prompts, MAX_NEW)


def _write_minimal(path, arch: str, tensor_type: str = "F32"):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_context_length(64)
    qt = gguf.GGMLQuantizationType[tensor_type]
    if qt == gguf.GGMLQuantizationType.F32:
        w.add_tensor("token_embd.weight", np.zeros((16, 32), np.float32))
    else:  # raw blocks of the given type: 32 x 32 values
        block, nbytes = gguf.GGML_QUANT_SIZES[qt]
        w.add_tensor("token_embd.weight", np.zeros((32, 32 // block * nbytes), np.uint8), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_gguf_refused_with_what_is_supported(tmp_path):
    f = _write_minimal(tmp_path / "gpt2.gguf", "gpt2")
    with pytest.raises(
        ModelLoadError, match=r"unsupported GGUF architecture 'gpt2'; supported: llama, phi3, qwen2, qwen3"
    ):
        load_arch(f)
    f = _write_minimal(tmp_path / "iq4.gguf", "llama", "IQ4_NL")
    with pytest.raises(
        ModelLoadError, match=r"unsupported GGUF tensor type\(s\) IQ4_NL; supported: F32, F16, BF16, Q8_0"
    ):
        LLM(model=str(f))  # refused on the driver, before any worker starts
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        load_arch(tmp_path / "junk.gguf")
    with pytest.raises(ModelLoadError, match="no such GGUF file"):
        load_arch(tmp_path / "missing.gguf")


def test_a_gguf_pipeline_stage_dequantizes_only_its_tensors(ckpt_dir, tmp_path, monkeypatch):
    """A later pipeline stage of a GGUF file dequantizes its own layers (and the final norm
    and head), not the embedding or another stage's blocks; its weights equal the whole
    model's."""
    import torch

    from workers.distributed import SINGLE
    from workers.models import gguf_loader
    from workers.models.loader import load_model
    from workers.pipeline import PipelineStage

    f = write_gguf(ckpt_dir("llama", layers=4), tmp_path / "stage.gguf", "Q8_0")
    whole, _ = load_model(f, SINGLE, torch.float32, torch.device("cpu"), 64)
    seen: list[str] = []
    inner = gguf_loader._dequantize
    monkeypatch.setattr(gguf_loader, "_dequantize", lambda t: seen.append(t.name) or inner(t))
    stage, _ = load_model(f, SINGLE, torch.float32, torch.device("cpu"), 64, stage=PipelineStage(1, 2, 2, 4))
    blocks = {int(n.split(".")[1]) for n in seen if n.startswith("blk.")}
    assert blocks == {2, 3} and "token_embd.weight" not in seen and "output_norm.weight" in seen
    for i in (0, 1):
        assert torch.equal(stage.layers[i].mlp.down_proj.weight, whole.layers[i + 2].mlp.down_proj.weight)
