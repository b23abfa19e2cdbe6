"""Benchmark parts that need no Ray: model shapes, datasets, vLLM's serving metrics, the
HTTP client against a scripted OpenAI server, the recorded commit, the roofline table.
(The Ray-job paths are in ``tests/benchmarks/test_benchmarks.py``.)"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.benchmark_results import check_serve_result, load
from tests.serve_helpers import free_port


def test_shapes_are_the_real_configs(tmp_path):
    from benchmarks.shapes import write_shape
    from workers.models.arch import load_arch

    expect = {
        "qwen3-0.6b": dict(
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            num_layers=28,
            num_heads=16,
            num_kv_heads=8,
            head_dim=128,
            tie_word_embeddings=True,
            qk_norm=True,
            max_position_embeddings=40960,
            rope_theta=1e6,
        ),
        "llama-3.2-1b": dict(
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_layers=16,
            num_heads=32,
            num_kv_heads=8,
            head_dim=64,
            tie_word_embeddings=True,
            max_position_embeddings=131072,
            rope_theta=500000.0,
        ),
        "llama-3.1-8b": dict(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_layers=32,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            tie_word_embeddings=False,
            max_position_embeddings=131072,
            rope_theta=500000.0,
        ),
    }
    for name, fields in expect.items():
        arch = load_arch(write_shape(tmp_path / name, name))
        for k, v in fields.items():
            assert getattr(arch, k) == v, (name, k)
    l1 = load_arch(tmp_path / "llama-3.2-1b").rope_scaling
    assert (
        l1["rope_type"],
        l1["factor"],
        l1["low_freq_factor"],
        l1["high_freq_factor"],
        l1["original_max_position_embeddings"],
    ) == ("llama3", 32.0, 1.0, 4.0, 8192)
    assert load_arch(tmp_path / "llama-3.1-8b").rope_scaling["factor"] == 8.0
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "qwen3-0.6b")
    assert len(tok) == 151936
    assert tok.encode("w5 w151935", add_special_tokens=False) == [5, 151935]


def test_serve_metrics_match_vllm_definitions():
    from benchmarks.datasets import SampleRequest
    from benchmarks.serve import calculate_metrics
    from benchmarks.serve_client import RequestFuncOutput

    reqs = [SampleRequest({"prompt_token_ids": [1] * 10}, 10, 4), SampleRequest({"prompt_token_ids": [1] * 6}, 6, 3)]
    outs = [
        RequestFuncOutput(success=True, prompt_len=10, output_tokens=4, ttft=0.1, itl=[0.02, 0.03, 0.05], latency=0.2),
        RequestFuncOutput(success=False, error="boom"),
    ]
    m = calculate_metrics(reqs, outs, duration=2.0, selected=["ttft", "tpot", "itl", "e2el"], percentiles=[90, 99])
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (1, 1, 10, 4)
    assert m["request_throughput"] == 0.5 and m["output_throughput"] == 2.0 and m["total_token_throughput"] == 7.0
    assert m["mean_ttft_ms"] == pytest.approx(100.0)
    assert m["mean_tpot_ms"] == pytest.approx((0.2 - 0.1) / 3 * 1000)
    assert m["median_itl_ms"] == pytest.approx(30.0)
    assert m["p99_e2el_ms"] == pytest.approx(200.0)
    assert {"p90_ttft_ms", "std_itl_ms", "p90_tpot_ms"} <= set(m)


def test_jsonl_dataset(tmp_path):
    from transformers import AutoTokenizer

    from benchmarks.datasets import jsonl_requests
    from benchmarks.shapes import write_shape

    tok = AutoTokenizer.from_pretrained(write_shape(tmp_path / "tiny", "tiny"))
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "\n".join(
            [
                json.dumps({"prompt": "w5 w6 w7 w8"}),
                json.dumps({"prompt_token_ids": [9, 10, 11]}),
                "",
                json.dumps({"prompt": "w12 w13", "output_len": 3}),
            ]
        )
        + "\n"
    )
    reqs = jsonl_requests(str(data), None, 5, tok)
    assert [(r.prompt_len, r.expected_output_len) for r in reqs] == [(4, 5), (3, 5), (2, 3)]
    assert reqs[1].token_ids == [9, 10, 11] and reqs[0].prompt == "w5 w6 w7 w8"
    assert len(jsonl_requests(str(data), 2, 5, tok)) == 2
    data.write_text('{"text": "no prompt"}\n')
    with pytest.raises(SystemExit, match="needs"):
        jsonl_requests(str(data), None, 5, tok)
    # real text to a random-weight shape: its word-level tokenizer knows none of it (all <unk>)
    data.write_text(json.dumps({"prompt": "The capital of France is"}) + "\n")
    with pytest.raises(SystemExit, match=r"prompts.jsonl:1: the tokenizer reads this text as unknown tokens"):
        jsonl_requests(str(data), None, 5, tok)


def test_random_and_fixed_datasets():
    from benchmarks.datasets import fixed_requests, random_requests

    a = random_requests(50, 100, 20, 0.5, 1000, seed=7)
    assert a == random_requests(50, 100, 20, 0.5, 1000, seed=7)
    assert a != random_requests(50, 100, 20, 0.5, 1000, seed=8)
    assert all(50 <= r.prompt_len == len(r.token_ids) <= 150 and 10 <= r.expected_output_len <= 30 for r in a)
    assert all(0 <= t < 1000 for r in a for t in r.token_ids)
    assert len({r.prompt_len for r in a}) > 5
    same = random_requests(4, 64, 8, 0.0, 1000, seed=1)
    assert {(r.prompt_len, r.expected_output_len) for r in same} == {(64, 8)}
    f = fixed_requests(3, 12, 5, 512, None)
    assert len({tuple(r.token_ids) for r in f}) == 1 and f[0].prompt_len == 12 and f[0].expected_output_len == 5
    t = fixed_requests(2, 0, 4, 512, "w5 w6 w7")
    assert t[0].prompt == "w5 w6 w7" and t[0].prompt_len == 3


def test_a_text_prompt_a_shape_cannot_read_is_refused(tmp_path):
    from transformers import AutoTokenizer

    from benchmarks.datasets import fixed_requests
    from benchmarks.shapes import write_shape
    from cluster.demo_model import ensure_demo_model

    shape_tok = AutoTokenizer.from_pretrained(write_shape(tmp_path / "tiny", "tiny"))
    with pytest.raises(SystemExit, match="--prompt: the tokenizer reads this text as unknown tokens"):
        fixed_requests(2, 0, 4, 512, "The capital of France is", shape_tok)
    assert fixed_requests(2, 0, 4, 512, "w5 w6 w7", shape_tok)[0].prompt_len == 3  # its own words
    real = AutoTokenizer.from_pretrained(ensure_demo_model())  # (byte-level: reads any text)
    assert fixed_requests(1, 0, 4, 512, "The capital of France is", real)[0].prompt_len > 0


class FakeOpenAIServer:
    """A minimal OpenAI-compatible streaming /v1/completions server (one token per chunk)."""

    def __init__(self):
        self.port = free_port()
        self.requests: list[dict] = []
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._main, daemon=True)

    def _main(self):
        from aiohttp import web

        async def models(_):
            return web.json_response({"object": "list", "data": [{"id": "fake-tiny", "object": "model"}]})

        async def completions(request):
            body = await request.json()
            self.requests.append(body)
            n_prompt = len(body["prompt"]) if isinstance(body["prompt"], list) else len(body["prompt"].split())
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(body["max_tokens"]):
                await asyncio.sleep(0.002)
                chunk = {
                    "id": "c",
                    "object": "text_completion",
                    "model": body["model"],
                    "choices": [{"index": 0, "text": f" w{i + 3}", "finish_reason": None}],
                }
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            usage = {
                "prompt_tokens": n_prompt,
                "completion_tokens": body["max_tokens"],
                "total_tokens": n_prompt + body["max_tokens"],
            }
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
            await resp.write_eof()
            return resp

        async def start():
            app = web.Application()
            app.router.add_get("/v1/models", models)
            app.router.add_post("/v1/completions", completions)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.port).start()
            self.ready.set()

        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(start())
        self.loop.run_forever()

    def __enter__(self):
        self.thread.start()
        assert self.ready.wait(30)
        return self

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self.loop.stop)


def test_serve_against_fake_openai_server(tmp_path):
    """The HTTP client and vLLM's metrics against a scripted OpenAI streaming server
    (in-process: the Ray-job path is covered against the real cluster.serve in test_benchmarks.py)."""
    from benchmarks.serve import main

    out = tmp_path / "serve.json"
    with FakeOpenAIServer() as srv:
        main(
            [
                "--backend",
                "http",
                "--port",
                str(srv.port),
                "--vocab-size",
                "512",
                "--num-prompts",
                "8",
                "--input-len",
                "12",
                "--output-len",
                "6",
                "--request-rate",
                "50",
                "--max-concurrency",
                "4",
                "--output",
                str(out),
                "--plot",
            ]
        )
    res = load(out)
    check_serve_result(res, 8)
    assert res["total_output_tokens"] == 8 * 6 and res["total_input_tokens"] == 8 * 12
    assert len(srv.requests) == 9  # one untimed test request, then the 8
    assert all(r["stream"] and r["ignore_eos"] and r["model"] == "fake-tiny" for r in srv.requests)
    assert all(isinstance(r["prompt"], list) and len(r["prompt"]) == 12 for r in srv.requests)
    assert sum(len(x) for x in res["itls"]) == 8 * 5
    assert res["config"]["max_concurrency"] == 4 and res["config"]["request_rate"] == 50
    assert out.with_suffix(".png").stat().st_size > 1000


def test_serve_rate_sweep_against_fake_openai_server(tmp_path, capsys):
    """``--request-rates``: one run a rate against the same server, one JSON holding every run,
    and the summary table; bad rates are refused with a message."""
    from benchmarks.serve import main

    out = tmp_path / "sweep.json"
    with FakeOpenAIServer() as srv:
        args = ["--backend", "http", "--port", str(srv.port), "--vocab-size", "512", "--num-prompts", "5"]
        main([*args, "--input-len", "8", "--output-len", "4", "--request-rates", "40,inf", "--output", str(out)])
    res = load(out)
    assert [r["config"]["request_rate"] for r in res["runs"]] == [40, "inf"]  # (JSON has no inf)
    for r in res["runs"]:
        check_serve_result(r, 5)
    assert len(srv.requests) == 2 * 6  # each run: an untimed test request, then the 5
    table = capsys.readouterr().out
    assert "| 40 |" in table and "| inf |" in table and res["table"] in table
    for bad in ("0", "fast", "4,-1"):
        with pytest.raises(SystemExit):
            main([*args, "--request-rates", bad])
    assert "rates must be" in capsys.readouterr().err


def test_recorded_commit_is_this_checkout_or_named(monkeypatch, tmp_path):
    """Results name the code that produced them: this checkout's HEAD, the commit given in
    SYNCLESS_COMMIT, and nothing (never an enclosing repository's HEAD) for a bare export."""
    from benchmarks import common

    root = Path(__file__).resolve().parents[2]
    monkeypatch.delenv("SYNCLESS_COMMIT", raising=False)
    if (root / ".git").exists():
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
        assert common.versions()["syncless_commit"] == head
    monkeypatch.setenv("SYNCLESS_COMMIT", "abc123")
    assert common.versions()["syncless_commit"] == "abc123"
    monkeypatch.delenv("SYNCLESS_COMMIT")
    export = tmp_path / "repo" / "export"
    shutil.copytree(root / "benchmarks", export / "benchmarks")
    subprocess.run(["git", "init", "-q", str(tmp_path / "repo")], check=True)
    code = "from benchmarks import common; print(common.versions()['syncless_commit'])"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=export,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(export)},
    )
    assert out.stdout.strip().splitlines()[-1] == "None", out.stderr


def test_roofline_table_lines(tmp_path, capsys):
    from benchmarks.roofline_table import main, table

    top = [
        {"name": "_paged_attention_kernel", "us_per_step": 300.5},
        {"name": "_rope_kv_kernel", "us_per_step": 20.0},
        {"name": "_skinny_kernel", "us_per_step": 4000.0},
    ]
    cells = [
        {
            "batch_size": 1,
            "context_len": 512,
            "step_ms_median": 4.3421,
            "ratio": 1.2346,
            "profile": {"kernel_us_per_step": 4355.6, "top": top},
        },
        {"batch_size": 8, "context_len": 4096, "step_ms_median": 4.9, "ratio": 1.36},
        {"batch_size": 256, "context_len": 4096, "skipped": "KV cache needs 129.0 GiB"},
    ]
    path = tmp_path / "rl-llama-3.1-8b-off.json"
    path.write_text(json.dumps({"cells": cells}))
    lines = table([str(path)])
    assert lines == [
        "llama-3.1-8b-off         b1    ctx512   4.342 ms ratio 1.235 kern  4355.6 us attn+rope  320.5",
        "llama-3.1-8b-off         b8    ctx4096  4.900 ms ratio 1.360 kern     0.0 us attn+rope    0.0",
    ]
    main([str(path)])
    assert capsys.readouterr().out.splitlines() == lines


def test_launch_calls_profiles_each_launch(ray_local, tmp_path, capsys):
    """``benchmarks.launch_calls`` on the CPU (no CUDA runtime calls to count): one record per
    profiled launch and mode, labelled by step kind (the first places the prompts), the
    table (a row per mode and kind), the JSON; a bad mode is refused."""
    from benchmarks.launch_calls import KINDS, main

    out = tmp_path / "calls.json"
    runs = main(
        ["--shape", "tiny", "--modes", "async,async+ngram", "--launches", "5", "--vocab", "500"]
        + ["--output", str(out)]
    )
    assert set(runs) == {"async", "async+ngram"} and all(len(rows) == 5 for rows in runs.values())
    for rows in runs.values():
        assert [r["launch"] for r in rows] == [f"launch#{i}" for i in range(1, 6)]
        assert all(r["ms"] > 0 and all(r[k] >= 0 for k in KINDS) for r in rows)
        assert rows[0]["kind"] == "mixed" and rows[-1]["kind"] == "decode"
    assert json.loads(out.read_text()) == runs
    printed = capsys.readouterr().out
    for mode, rows in runs.items():
        for kind in ("decode", "mixed"):
            assert f"| {mode} | {kind} | {sum(r['kind'] == kind for r in rows)} |" in printed
    # more launches asked than the workload has: said so (the profiler stops on its own thread only)
    runs = main(["--shape", "tiny", "--modes", "async", "--launches", "100000", "--vocab", "500"])
    assert runs["async"].startswith("only ") and "rerun with --launches" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--modes", "async+nothing"])


@pytest.mark.parametrize(
    "argv,says",
    [
        (["--modes", "async,async+nothing"], "unknown modes async+nothing"),
        (["--wait-ms", "0"], "--wait-ms must be"),
        (["--passes", "0"], "--passes must be at least 1"),
    ],
)
def test_launch_wait_refuses_bad_arguments(argv, says, capsys):
    """``benchmarks.launch_wait`` (a GPU benchmark) names a bad mode or wait before starting anything."""
    from benchmarks.launch_wait import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_launch_wait_summary_counts_waits_and_mixed_steps():
    """``benchmarks.launch_wait.summarize``: a launch waited above a quarter of the busy-wait;
    the mixed-step launches (no decode graph fit) get their own count and median."""
    from benchmarks.launch_wait import summarize

    run = {
        "mode": "async",
        "wait_ms": 100.0,
        "launch_ms": [1.0, 2.0, 30.0, 1.5, 26.0, 4.0],
        "mixed_launch_ms": [2.0, 30.0, 4.0],
        "preemptions": 0,
        "mixed_graph_replays": 3,
    }
    row = summarize(run)
    assert (row["launches"], row["waited"], row["max_ms"]) == (6, 2, 30.0)
    assert (row["mixed_launches"], row["mixed_median_ms"], row["decode_median_ms"]) == (3, 4.0, 1.5)
    assert summarize({**run, "launch_ms": [], "mixed_launch_ms": []})["mixed_median_ms"] == 0.0


def test_launch_wait_counts_allocations_by_step_kind():
    """``benchmarks.launch_wait.allocations``: the pinned host blocks and device segments the
    launches created, decode and mixed launches apart (a run without the counters: zeros)."""
    from benchmarks.launch_wait import allocations, summarize

    allocs = [[False, 0, 1], [True, 2, 0], [True, 1, 3], [False, 4, 0]]
    assert allocations(allocs) == {
        "decode_pinned_allocs": 4,
        "decode_device_allocs": 1,
        "mixed_pinned_allocs": 3,
        "mixed_device_allocs": 3,
    }
    run = {"mode": "async", "wait_ms": 100.0, "launch_ms": [1.0], "mixed_launch_ms": [], "preemptions": 0}
    assert summarize({**run, "mixed_graph_replays": 0})["mixed_pinned_allocs"] == 0


def test_launch_wait_phase_medians():
    """``benchmarks.launch_wait.phase_medians``: per phase, the decode steps' and the mixed
    steps' medians apart."""
    from benchmarks.common import phase_medians

    run = {"launch_phases_ms": [[False, 1, 2], [True, 10, 20], [False, 3, 4], [False, 5, 0], [True, 30, 40]]}
    assert phase_medians(run) == {"decode": [3, 2], "mixed": [20, 30]}
    assert phase_medians({"launch_phases_ms": []}) == {"decode": [], "mixed": []}


def test_launch_wait_thread_time_medians():
    """``benchmarks.common.thread_time_medians``: (wall, thread CPU) medians of the decode and
    the mixed launches apart; a kind with no launch is left out."""
    from benchmarks.common import thread_time_medians

    run = {"launch_cpu_ms": [[False, 1.0, 0.5], [True, 10.0, 2.0], [False, 3.0, 2.5], [False, 2.0, 2.0]]}
    assert thread_time_medians(run) == {"decode": (2.0, 2.0), "mixed": (10.0, 2.0)}
    assert thread_time_medians({"launch_cpu_ms": [[True, 4.0, 4.0]]}) == {"mixed": (4.0, 4.0)}
    assert thread_time_medians({}) == {}
