"""The embedded default (SmolLM2-135M-Instruct GGUF) on the GPU in bfloat16: the greedy chat
answers of ``tests/models/test_gguf_model.py`` equal transformers' GGUF load, token for token, for
16 tokens (same prompts and check, another device and dtype)."""

import pytest
import torch

from tests.models.test_gguf_model import check_default_model_matches_transformers

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_default_model_greedy_matches_transformers_gguf_bf16(ray_gpu):
    answers = check_default_model_matches_transformers(16, "bfloat16", "cuda")
    assert "Paris" in answers[0]
