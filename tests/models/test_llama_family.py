"""Llama-layout checkpoints beyond Llama and Qwen: Mistral (its own head_dim, an optional sliding
window) equals transformers' ``MistralForCausalLM`` greedily; a sliding-window model (Mistral
v0.1, Phi-3-mini) is served up to its window, where windowed and full attention are the same,
and a longer ``max_model_len`` is refused; partial rotary embeddings are refused. (Phi-3's fused
projections against transformers: ``tests/engine/test_engine_correctness.py``.)"""

import json
import logging

import pytest

from cluster import LLM, SamplingParams
from metadata.config import ConfigError
from tests.checkpoints import hf_greedy
from workers.models.arch import ModelLoadError, load_arch

WINDOW = 64


@pytest.fixture(scope="module")
def mistral(ckpt_dir):
    # head_dim 32 with hidden 64 and 4 heads: not hidden // heads, as in Mistral-Nemo
    return ckpt_dir("mistral", head_dim=32, sliding_window=WINDOW, seed=3)


def test_greedy_matches_transformers_within_the_window(ray_local, mistral, caplog):
    prompts = [[5 + (7 * i + 3 * j) % 240 for j in range(n)] for i, n in enumerate([1, 9, 30, 50])]
    expected = hf_greedy(mistral, prompts, 12)  # 50 + 12 < WINDOW: transformers' window masks nothing
    with caplog.at_level(logging.WARNING, logger="cluster.model_source"):
        llm = LLM(model=str(mistral), block_size=8, max_num_batched_tokens=24)
    try:
        assert llm.engine.max_model_len == WINDOW
        assert "sliding window of 64 tokens" in caplog.text
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        )
        assert [o.outputs[0].token_ids for o in outs] == expected
    finally:
        llm.shutdown()


def test_a_context_longer_than_the_window_is_refused(ray_local, mistral):
    with pytest.raises(ConfigError, match="sliding window of 64 tokens.*max_model_len 64"):
        LLM(model=mistral, max_model_len=WINDOW + 1)  # (a pathlib.Path is taken as its string)


@pytest.mark.parametrize(
    "arch,fields,window",
    [
        ("MistralForCausalLM", {"sliding_window": 4096}, 4096),
        ("MistralForCausalLM", {"sliding_window": None}, None),  # Mistral v0.2+: full attention
        ("Qwen2ForCausalLM", {"sliding_window": 4096, "use_sliding_window": False}, None),
        ("Qwen2ForCausalLM", {"sliding_window": 4096, "use_sliding_window": True}, 4096),
        ("LlamaForCausalLM", {}, None),
        ("Phi3ForCausalLM", {"sliding_window": 2047}, 2047),  # Phi-3-mini-4k
        ("Phi3ForCausalLM", {"sliding_window": None}, None),
    ],
)
def test_which_configs_have_a_window(tmp_path, arch, fields, window):
    config = {
        "architectures": [arch],
        "vocab_size": 32,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "max_position_embeddings": 32768,
        **fields,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    arch_info = load_arch(tmp_path)
    assert arch_info.sliding_window == window
    assert arch_info.usable_context() == (window or 32768)


@pytest.mark.parametrize(
    "fields",
    [{"partial_rotary_factor": 0.75}, {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}],
)
def test_partial_rotary_embeddings_are_refused(tmp_path, fields):
    config = {
        "architectures": ["Phi3ForCausalLM"],
        "vocab_size": 32,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        **fields,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="partial rotary embeddings"):
        load_arch(tmp_path)


def test_a_gguf_files_sliding_window_is_read(ckpt_dir, tmp_path):
    """llama.cpp's ``phi3.attention.sliding_window`` bounds the context as config.json's does."""
    from tests.checkpoints import write_gguf

    f = write_gguf(ckpt_dir("phi3", sliding_window=48), tmp_path / "phi3-window.gguf")
    arch = load_arch(f)
    assert (arch.architecture, arch.sliding_window, arch.usable_context()) == ("Phi3ForCausalLM", 48, 48)
