"""Pipeline stage models in one process: each stage loads only its layers (and the embedding
or the head), and chaining the stages' ``(hidden, residual)`` gives the whole model's logits
exactly, for a prefill and the decode step after it (no Ray, no process group)."""

from __future__ import annotations

import pytest
import torch

from metadata.wire import NewRequest, SamplingOptions, ScheduledRow, StepPlan
from workers.device_state import DeviceState
from workers.distributed import SINGLE
from workers.models.loader import load_model
from workers.pipeline import PipelineStage, stage_layers
from workers.step_inputs import build_step_inputs

BS = 8
GREEDY = SamplingOptions(0.0, 1.0, 0, 0.0, 1, 1.0, 0.0, 0.0, 0, [], -1)


def chained_vs_whole(
    ckpt, split: list[int], device: torch.device, dtype: torch.dtype, prompt_len: int = 13
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(whole-model logits, chained-stages logits) of a prefill and the decode step after it."""
    from workers import kv_cache

    whole, arch = load_model(ckpt, SINGLE, dtype, device, 128)
    bounds = stage_layers(arch.num_layers, len(split), split)
    stages = [
        load_model(ckpt, SINGLE, dtype, device, 128, stage=PipelineStage(i, len(split), a, b))[0]
        for i, (a, b) in enumerate(bounds)
    ]
    assert [len(s.layers) for s in stages] == split
    assert stages[0].lm_head is None and stages[-1].embed_tokens is None
    kv_heads = whole.layers[0].self_attn.num_kv_heads

    def cache(n_layers):
        return kv_cache.allocate(n_layers, 8, BS, kv_heads, arch.head_dim, dtype, device)

    whole_kv, stage_kv = cache(arch.num_layers), [cache(n) for n in split]
    st = DeviceState(4, 64, 8, arch.vocab_size, device)
    prompt = [3 + (7 * i) % (arch.vocab_size - 3) for i in range(prompt_len)]
    n_blocks = -(-(prompt_len + 1) // BS)
    plans = [
        StepPlan(
            step_id=1,
            new_requests=[NewRequest.of(0, prompt, [], GREEDY, list(range(n_blocks)))],
            rows=[ScheduledRow(0, prompt_len, prompt_len, [], True)],
        ),
        StepPlan(step_id=2, rows=[ScheduledRow(0, 1, prompt_len + 1, [], True)]),
    ]
    out = []
    with torch.inference_mode():
        for plan in plans:
            for req in plan.new_requests:
                st.add(req)
            inp = build_step_inputs(plan, st, BS, True)
            args = (inp.input_ids, inp.positions, inp.meta)
            ref = whole.compute_logits(whole(*args, whole_kv)[inp.logits_idx])
            mid = None
            for model, kv in zip(stages, stage_kv):
                mid = model(*args, kv) if mid is None else model(*args, kv, mid)
            got = stages[-1].compute_logits(mid[inp.logits_idx])
            out.append((ref, got))
            st.num_computed[inp.rows] = inp.meta.seq_lens
            st.token_ids[inp.rows, inp.meta.seq_lens.long()] = ref.argmax(-1)  # the next input
    return out


@pytest.mark.parametrize(
    "arch,kw,split",
    [
        ("llama", {}, [2, 2]),
        ("qwen2", {"tie_word_embeddings": True, "kv_heads": 1}, [1, 3]),  # the last stage's own head
        ("qwen3", {}, [1, 2, 1]),  # a middle stage with neither embedding nor head
    ],
    ids=["llama-even", "qwen2-tied-uneven", "qwen3-three-stages"],
)
def test_chained_stages_equal_the_whole_model(ckpt_dir, arch, kw, split):
    ckpt = ckpt_dir(arch, layers=4, **kw)
    for ref, got in chained_vs_whole(ckpt, split, torch.device("cpu"), torch.float32):
        assert torch.equal(ref, got)


def test_a_later_stage_needs_the_previous_hidden_states(ckpt_dir):
    model, _ = load_model(
        ckpt_dir("llama", layers=4), SINGLE, torch.float32, torch.device("cpu"), 64, stage=PipelineStage(1, 2, 2, 4)
    )
    with pytest.raises(ValueError, match="pipeline stage 1 needs the previous stage's hidden states"):
        model(torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), None, [])


@pytest.mark.parametrize("arch,kw", [("llama", {}), ("qwen2", {"tie_word_embeddings": True})])
def test_a_stage_reads_only_its_own_tensors(ckpt_dir, monkeypatch, arch, kw):
    """Each stage reads from disk the tensors of its layers (plus the embedding on the first,
    the norm and head on the last; a tied head reads the embedding), never another stage's;
    together the stages read every tensor once, as the whole model does."""
    from safetensors import safe_open

    from workers.models import loader

    read: list[str] = []

    class Spy:
        def __init__(self, path, framework):
            self.f = safe_open(path, framework=framework)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(loader, "safe_open", Spy)
    ckpt = ckpt_dir(arch, layers=4, **kw)
    load_model(ckpt, SINGLE, torch.float32, torch.device("cpu"), 64)
    whole = sorted(read)
    per_stage = []
    for i, (a, b) in enumerate(stage_layers(4, 2, [1, 3])):
        read.clear()
        load_model(ckpt, SINGLE, torch.float32, torch.device("cpu"), 64, stage=PipelineStage(i, 2, a, b))
        per_stage.append(sorted(read))
        layers = {int(n.split(".")[2]) for n in read if n.startswith("model.layers.")}
        assert layers == set(range(a, b)), (i, layers)
    first, last = per_stage
    assert any("embed_tokens" in n for n in first) and not any(n.startswith(("model.norm", "lm_head")) for n in first)
    assert any(n.startswith("model.norm") for n in last)
    tied = kw.get("tie_word_embeddings", False)
    assert any("embed_tokens" in n for n in last) == tied  # the last stage's own head
    assert sorted(set(first) | set(last)) == whole
