"""``benchmarks.host_sections`` in-process on the CPU (tiny shape)."""

import json

import pytest


def test_host_sections_times_the_step_and_restores_the_functions(tmp_path):
    """In-process on the CPU (tiny shape): every timed section appears, inclusive sections
    nest (launch >= build_step_inputs >= prepare_inputs), and the wrapped functions are the
    originals again afterwards."""
    from benchmarks import host_sections
    from workers.model_runner import ModelRunner
    from workers.pending_step import PendingStep

    launch, start_copy = ModelRunner.launch, PendingStep.start_copy
    out = tmp_path / "hs.json"
    res = host_sections.main(
        [
            "--shape",
            "tiny",
            "--batch-sizes",
            "1,3",
            "--context-lens",
            "16",
            "--warmup",
            "1",
            "--iters",
            "4",
            "--output",
            str(out),
        ]
    )
    assert ModelRunner.launch is launch and PendingStep.start_copy is start_copy
    assert json.loads(out.read_text())["cells"] == json.loads(json.dumps(res["cells"]))
    assert [c["batch_size"] for c in res["cells"]] == [1, 3]
    for c in res["cells"]:
        s = c["sections_us"]
        assert c["step_us"] > 0 and c["busy_us"] == pytest.approx(c["step_us"] - s.get("wait", 0.0))
        assert s["launch"] >= s["build_step_inputs"] >= s["prepare_inputs"] > 0
        assert c["calls_per_step"]["launch"] == pytest.approx(1.0)
        assert "graph replay" not in s  # no CUDA graphs on the CPU
    table = host_sections.table(res["cells"])
    assert "build_step_inputs" in table and "b3/16" in table


def test_driver_sections_time_schedule_update_and_outputs(tmp_path):
    """``--driver``: the driver's side of a decode step (real scheduler, output processor and
    tokenizer, no workers), split at the point where the next plan leaves."""
    from benchmarks import host_sections
    from tests.checkpoints import write_tokenizer

    write_tokenizer(tmp_path, 64)
    out = tmp_path / "drv.json"
    res = host_sections.main(
        [
            "--driver",
            "--tokenizer",
            str(tmp_path),
            "--batch-sizes",
            "2,4",
            "--context-lens",
            "8",
            "--iters",
            "5",
            "--output",
            str(out),
        ]
    )
    cells = res["cells"]
    assert json.loads(out.read_text())["cells"] == json.loads(json.dumps(cells))
    assert [c["batch_size"] for c in cells] == [2, 4]
    for c in cells:
        assert c["decode_steps"] == 4  # 5 tokens: the prefill samples the first
        assert c["schedule_us"] > 0 and c["update_us"] > 0 and c["outputs_us"] > 0
        assert c["to_next_plan_us"] == pytest.approx(c["schedule_us"] + c["update_us"])
        assert c["sampled_tokens"] == "vocabulary"  # the word-level tokenizer knows no real text
    assert "update_from_result" in host_sections.driver_table(cells)


def test_driver_cells_sample_ids_that_decode_to_text(tmp_path):
    """Real text where the tokenizer knows it, else the tokenizer's own plain ids: never
    unknown tokens, which decode to nothing."""
    from transformers import AutoTokenizer

    from benchmarks.host_sections import sampled_ids
    from cluster.demo_model import ensure_demo_model
    from tests.checkpoints import write_tokenizer

    write_tokenizer(tmp_path, 64)
    word = AutoTokenizer.from_pretrained(tmp_path)
    ids, source = sampled_ids(word, 500)
    assert source == "vocabulary" and len(ids) >= 500
    assert word.unk_token_id not in ids and not set(ids) & set(word.all_special_ids)
    assert len(word.decode(ids[:50], skip_special_tokens=True).split()) == 50
    byte_level = AutoTokenizer.from_pretrained(ensure_demo_model())
    ids, source = sampled_ids(byte_level, 500)
    assert source == "text" and len(ids) >= 500
