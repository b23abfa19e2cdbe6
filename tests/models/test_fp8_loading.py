"""FP8 weights on the CPU (the kernels' references): online quantization at load, FP8
checkpoints in llm-compressor's layout (per-row and per-tensor scales, static input scales,
KV-cache scales), tensor parallelism, and the refusals."""

from __future__ import annotations

import random

import pytest
import torch

from cluster import LLM, SamplingParams
from tests.fp8_checkpoints import write_dequantized_checkpoint, write_fp8_checkpoint
from workers.distributed import TPGroup
from workers.models.loader import load_model
from workers.models.model_arch import ModelLoadError

MAX_NEW = 8


def _prompts(vocab: int = 256) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (5, 23, 12)]


def _greedy(model, tops: list | None = None, **options) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens and their logprobs; ``tops`` receives each step's top-5 logprobs."""
    llm = LLM(model=str(model), block_size=8, max_model_len=128, num_kv_blocks=64, **options)
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in _prompts()],
            SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5),
            use_tqdm=False,
        )
    finally:
        llm.shutdown()
    toks = [o.outputs[0].token_ids for o in outs]
    if tops is not None:
        tops += [o.outputs[0].logprobs for o in outs]
    lps = [[lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    return toks, lps


@pytest.fixture(scope="module")
def fp8_pair(ckpt_dir, tmp_path_factory):
    """(FP8 checkpoint with per-row scales, the same weights dequantized into float32)."""
    src = ckpt_dir("llama")
    fp8 = write_fp8_checkpoint(src, tmp_path_factory.mktemp("fp8-channel"))
    return fp8, write_dequantized_checkpoint(fp8, tmp_path_factory.mktemp("fp8-dequant"))


def _load(path):
    return load_model(path, TPGroup(), torch.float32, torch.device("cpu"), 256)[0]


def test_online_quantization_makes_the_projections_fp8(fp8_pair):
    _, plain = fp8_pair
    model, _ = load_model(plain, TPGroup(), torch.float32, torch.device("cpu"), 256, quantization="fp8")
    for proj in model.projections():
        assert proj.weight.dtype == torch.float8_e4m3fn
        assert proj.weight_scale.dtype == torch.float32 and proj.weight_scale.shape == (proj.weight.shape[0],)
    assert model.lm_head.weight.dtype == torch.float32  # the head and the embedding stay unquantized
    assert all(not layer.whole_mlp_block for layer in model.layers)
    assert all(p.weight.dtype == torch.float32 for p in _load(plain).projections())  # off by default


@pytest.mark.parametrize("tp_rank", [None, 0, 1])
def test_quantization_at_load_equals_quantizing_the_loaded_weights(ckpt_dir, monkeypatch, tp_rank):
    """Online FP8 quantizes each 16/32-bit tensor as it arrives, never holding the projection
    in 16 bits: the result is bit for bit that of quantizing the loaded 16-bit model's
    projections (this rank's rows and, row-parallel, its K slice), with no scale left unset."""
    from workers.models import layers, loader

    src = ckpt_dir("llama")
    tp = TPGroup() if tp_rank is None else TPGroup(rank=tp_rank, size=2)
    calls = []
    monkeypatch.setattr(loader, "quantize_fp8", lambda lin: calls.append(lin))  # not the post-load path
    model, _ = load_model(src, tp, torch.float32, torch.device("cpu"), 256, quantization="fp8")
    assert calls == []
    monkeypatch.undo()
    plain, _ = load_model(src, tp, torch.float32, torch.device("cpu"), 256)
    for got, want in zip(model.projections(), plain.projections()):
        layers.quantize_fp8(want)
        assert torch.equal(got.weight.view(torch.uint8), want.weight.view(torch.uint8))
        assert torch.equal(got.weight_scale, want.weight_scale)


def test_fp8_checkpoint_loads_the_stored_values(fp8_pair):
    """The stored e4m3 values and per-row scales land in the fused projections unchanged, and
    quantizing their dequantized copy at load gives back the same values."""
    from safetensors.torch import load_file

    fp8, plain = fp8_pair
    stored = load_file(str(fp8 / "model.safetensors"))
    model = _load(fp8)
    online, _ = load_model(plain, TPGroup(), torch.float32, torch.device("cpu"), 256, quantization="fp8")
    qkv = model.layers[1].self_attn.qkv_proj
    q = stored["model.layers.1.self_attn.q_proj.weight"]
    assert torch.equal(qkv.weight[: q.shape[0]].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(qkv.weight_scale[: q.shape[0]], stored["model.layers.1.self_attn.q_proj.weight_scale"][:, 0])
    gate_up = model.layers[0].mlp.gate_up_proj  # interleaved (gate j, up j) rows
    up = stored["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(gate_up.weight[1::2].view(torch.uint8), up.view(torch.uint8))
    for a, b in zip(model.projections(), online.projections()):
        assert torch.equal(a.weight.view(torch.uint8), b.weight.view(torch.uint8))
        torch.testing.assert_close(a.weight_scale, b.weight_scale, rtol=1e-6, atol=0)


def test_fp8_checkpoint_generates_as_its_online_quantized_twin(ray_local, fp8_pair):
    fp8, plain = fp8_pair
    stored, stored_lp = _greedy(fp8)
    online, online_lp = _greedy(plain, quantization="fp8")
    unquantized, _ = _greedy(plain)
    assert stored == online
    torch.testing.assert_close(torch.tensor(stored_lp), torch.tensor(online_lp), atol=1e-4, rtol=0)
    # FP8 changes the numbers: the logprobs move (a test that could not tell FP8 from fp32 would pass anyway)
    assert stored != unquantized or stored_lp != _greedy(plain)[1]


def test_per_tensor_scales_fill_every_row(ckpt_dir, tmp_path):
    """Each part's per-tensor ``weight_scale`` ([] shape) fills that part's rows of the fused
    projection (q | k | v stacked, gate | up interleaved) and nothing else."""
    src = ckpt_dir("llama")
    scales = {"q_proj": 1e-3, "k_proj": 2e-3, "v_proj": 3e-3, "o_proj": 4e-3}
    scales.update({"gate_proj": 5e-3, "up_proj": 6e-3, "down_proj": 7e-3})
    model = _load(write_fp8_checkpoint(src, tmp_path / "t", strategy="tensor", tensor_scale=scales))
    attn, mlp = model.layers[1].self_attn, model.layers[1].mlp
    nq, nk = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
    qkv = attn.qkv_proj.weight_scale
    expect = torch.tensor([1e-3] * nq + [2e-3] * nk + [3e-3] * nk)
    assert torch.equal(qkv, expect)
    assert torch.all(mlp.gate_up_proj.weight_scale[0::2] == torch.tensor(5e-3))
    assert torch.all(mlp.gate_up_proj.weight_scale[1::2] == torch.tensor(6e-3))
    assert torch.all(attn.o_proj.weight_scale == torch.tensor(4e-3))
    assert torch.all(mlp.down_proj.weight_scale == torch.tensor(7e-3))


def test_static_input_and_kv_scales_are_loaded(ckpt_dir, tmp_path):
    src = ckpt_dir("llama")
    scales = {"q_proj": 0.01, "k_proj": 0.03, "v_proj": 0.02, "o_proj": 0.05, "gate_proj": 0.04, "up_proj": 0.06}
    model = _load(write_fp8_checkpoint(src, tmp_path / "s", input_scales=scales, kv_scales=(0.5, 2.0)))
    layer = model.layers[0]
    assert float(layer.self_attn.qkv_proj.input_scale) == pytest.approx(0.03)  # the largest of q, k, v
    assert float(layer.mlp.gate_up_proj.input_scale) == pytest.approx(0.06)
    assert float(layer.self_attn.o_proj.input_scale) == pytest.approx(0.05)
    assert layer.mlp.down_proj.input_scale is None  # none given: dynamic per-token scales
    assert (layer.self_attn.k_scale, layer.self_attn.v_scale) == (0.5, 2.0)


def test_fp8_tensor_parallel_matches_one_rank(ray_local, fp8_pair):
    """Stored per-row scales shard with their rows (q|k|v, gate|up) or stay whole (o, down).
    Each rank of a row-parallel projection scales its activations over its own half of the
    row, so TP 2 rounds differently from TP 1: the sequences are equal up to a near-tie."""
    from tests.greedy_close import assert_greedy_close

    fp8, _ = fp8_pair
    tops1, tops2 = [], []
    tp2 = _greedy(fp8, tops2, tensor_parallel_size=2)[0]
    tp1 = _greedy(fp8, tops1)[0]
    parted = assert_greedy_close(tp2, tops2, tp1, tops1)
    assert sum(p is None for p in parted) >= 1 and all(p is None or p >= 1 for p in parted)


def test_unsupported_checkpoint_quantization_is_refused(ckpt_dir, tmp_path):
    import json
    import shutil

    src = ckpt_dir("llama")
    dst = tmp_path / "awq"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="quantization 'awq' is not supported"):
        _load(dst)


def test_fp8_with_async_speculation_and_prefix_caching(ray_local, fp8_pair):
    """FP8 weights and KV cache under async scheduling and n-gram speculation (prefix caching
    on) give the plain synchronous FP8 run's greedy output (caching off), up to a near-tie (a
    verify pass rounds its rows in another batch shape)."""
    from tests.greedy_close import assert_greedy_close

    fp8, _ = fp8_pair
    options = {"quantization": "fp8", "kv_cache_dtype": "fp8"}
    plain_tops, fast_tops = [], []
    plain = _greedy(fp8, plain_tops, enable_prefix_caching=False, **options)[0]
    fast = _greedy(
        fp8,
        fast_tops,
        async_scheduling=True,
        speculative_method="ngram",
        num_speculative_tokens=3,
        **options,
    )[0]
    parted = assert_greedy_close(fast, fast_tops, plain, plain_tops)
    assert parted.count(None) >= 2


def test_fp8_kv_cache_holds_more_tokens_in_the_same_memory(ray_local, fp8_pair):
    """One byte an element: the same KV budget holds 4x the blocks of a float32 cache."""
    _, plain = fp8_pair
    blocks = {}
    for kv in ("auto", "fp8"):
        llm = LLM(model=str(plain), block_size=8, max_model_len=128, kv_cache_memory_bytes=1 << 20, kv_cache_dtype=kv)
        try:
            blocks[kv] = llm.engine.executor.num_blocks
        finally:
            llm.shutdown()
    assert blocks["fp8"] == 4 * blocks["auto"], blocks


def test_fp8_pipeline_stages_match_one_stage(ray_local, ckpt_dir, tmp_path_factory):
    """Each pipeline stage loads (and scales) only its own FP8 layers, static input scales and
    KV-cache scales included: the same tokens."""
    scales = {"q_proj": 0.02, "k_proj": 0.02, "v_proj": 0.02, "o_proj": 0.02, "gate_proj": 0.03, "up_proj": 0.03}
    fp8 = write_fp8_checkpoint(
        ckpt_dir("llama"), tmp_path_factory.mktemp("fp8-pp"), input_scales=scales, kv_scales=(0.25, 0.25)
    )
    options = {"kv_cache_dtype": "fp8"}
    assert _greedy(fp8, pipeline_parallel_size=2, **options)[0] == _greedy(fp8, **options)[0]


def test_fp8_kv_scales_from_the_checkpoint_are_applied(ray_local, ckpt_dir, tmp_path_factory):
    """KV-cache scales of 1/16 (named as ModelOpt writes them, ``k_proj.k_scale``) load onto
    the attention layers, and an FP8 cache stores K and V 16x larger with them: read back
    without the scale (or stored without it) the attention would be far off; applied on both
    sides, the FP8 cache gives the 16-bit cache's output up to a near-tie."""
    from safetensors.torch import load_file, save_file

    from tests.greedy_close import assert_greedy_close

    fp8 = write_fp8_checkpoint(ckpt_dir("llama"), tmp_path_factory.mktemp("fp8-kv"), kv_scales=(1 / 16, 1 / 16))
    tensors = load_file(str(fp8 / "model.safetensors"))
    renamed = {
        n.replace("self_attn.k_scale", "self_attn.k_proj.k_scale").replace(
            "self_attn.v_scale", "self_attn.v_proj.v_scale"
        ): t
        for n, t in tensors.items()
    }
    save_file(renamed, str(fp8 / "model.safetensors"))
    assert _load(fp8).layers[0].self_attn.k_scale == 1 / 16
    fp8_tops, auto_tops = [], []
    fp8_kv, fp8_lp = _greedy(fp8, fp8_tops, kv_cache_dtype="fp8")
    auto, auto_lp = _greedy(fp8, auto_tops)
    assert_greedy_close(fp8_kv, fp8_tops, auto, auto_tops)
    # the first token of each prompt (same context in both runs): close logprobs (this tiny
    # random model's near-flat distributions part the sequences early, hence no equality)
    for a, b in zip(fp8_lp, auto_lp):
        assert abs(a[0] - b[0]) < 0.15, (fp8_lp, auto_lp)
