"""Benchmarks end to end on the CPU: real ``ray job submit`` to a local head started here.

The head runs in its own ``--temp-dir`` (so no other ``ray.init()`` on this machine
finds it) and its own process group, which teardown ends; ``ray stop`` is never
used (it would end every Ray instance on the machine).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.serve_helpers import free_port

ROOT = Path(__file__).resolve().parent.parent
JOB_TIMEOUT_S = 300




def _ray_cli() -> list[str]:
    exe = shutil.which("ray")
    return [exe] if exe else [sys.executable, "-m", "ray.scripts.scripts"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("syncless-cache")


@pytest.fixture(scope="module")
def ray_head(cache_dir):
    """A local Ray head with the dashboard (job submission); yields its addresses."""
    temp = tempfile.mkdtemp(prefix="rb", dir="/tmp")  # short: Ray's socket paths have a length limit
    gcs, dash = free_port(), free_port()
    env = dict(os.environ, SYNCLESS_CACHE=str(cache_dir), RAY_DEDUP_LOGS="0", TOKENIZERS_PARALLELISM="false",
               RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    if _has_ray_token(env):  # Ray 2.60: `ray start` turns token auth on when a token exists; the
        env["RAY_AUTH_MODE"] = "token"  # job CLI only sends it when told to
    log = open(Path(temp) / "head.log", "w")
    # Every port explicit: fixed defaults (agent 52365, client server 10001) may be taken by
    # another Ray instance on this machine, which leaves the head without a job agent.
    head = subprocess.Popen(
        [*_ray_cli(), "start", "--head", "--block", f"--temp-dir={temp}", "--num-cpus=4", f"--port={gcs}",
         f"--dashboard-port={dash}", "--dashboard-host=127.0.0.1", "--include-dashboard=true",
         f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
         f"--ray-client-server-port={free_port()}", f"--metrics-export-port={free_port()}",
         f"--runtime-env-agent-port={free_port()}", "--object-store-memory=300000000", "--disable-usage-stats"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    url = f"http://127.0.0.1:{dash}"
    try:
        _wait_for_jobs_api(url, head, Path(temp) / "head.log", env)
        yield {"dashboard": url, "gcs": f"127.0.0.1:{gcs}", "env": env, "temp": temp, "proc": head}
    finally:
        _end_group(head)
        _kill_leftovers(temp)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def _has_ray_token(env: dict) -> bool:
    if env.get("RAY_AUTH_TOKEN"):
        return True
    return Path(env.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token").is_file()


def _kill_leftovers(temp: str) -> None:
    """SIGKILL processes of this head only: those whose command line names its temp dir."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if temp.encode() in cmd:
            try:
                os.kill(int(proc.name), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _wait_for_jobs_api(url: str, head: subprocess.Popen, log: Path, env: dict, timeout: float = 180) -> None:
    """Until ``ray job list`` answers (it carries the cluster's auth token, if any)."""
    end = time.monotonic() + timeout
    last = ""
    while time.monotonic() < end:
        if head.poll() is not None:
            raise RuntimeError(f"ray start exited ({head.returncode}):\n{log.read_text()[-3000:]}")
        proc = subprocess.run([*_ray_cli(), "job", "list", "--address", url], capture_output=True, text=True,
                              timeout=60, env=env)
        if proc.returncode == 0:
            return
        last = proc.stderr[-1000:]
        time.sleep(1)
    raise RuntimeError(f"the Ray job API at {url} did not come up: {last}\n{log.read_text()[-3000:]}")


def _end_group(proc: subprocess.Popen) -> None:
    """SIGTERM the head's process group (``ray start --block`` stops its children), then SIGKILL."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=8)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def submit(head: dict, module: str, *args: str, timeout: float = JOB_TIMEOUT_S) -> subprocess.CompletedProcess:
    runtime_env = {
        "env_vars": {"SYNCLESS_CACHE": head["env"]["SYNCLESS_CACHE"], "TOKENIZERS_PARALLELISM": "false"},
        "excludes": [".git", "**/__pycache__", ".benchmarks", "*.egg-info", "notes"],
    }
    cmd = [*_ray_cli(), "job", "submit", "--address", head["dashboard"], "--working-dir", str(ROOT),
           "--runtime-env-json", json.dumps(runtime_env), "--", "python", "-m", module, *args]
    t0 = time.monotonic()
    while True:  # the job agent registers a little after the dashboard answers
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=head["env"], cwd=ROOT)
        if "No available agent" not in proc.stderr or time.monotonic() - t0 > 120:
            break
        time.sleep(2)
    print(f"{module}: job took {time.monotonic() - t0:.1f} s")
    print("\n".join(line for line in proc.stdout.splitlines()[-12:] if "it/s]" not in line))
    assert proc.returncode == 0, (f"job {module} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n"
                                  f"{proc.stderr[-3000:]}\n{_head_logs(head)}")
    return proc


def _head_logs(head: dict) -> str:
    alive = head["proc"].poll() is None
    logs = Path(head["temp"]) / "session_latest" / "logs"
    parts = [f"head alive: {alive}"]
    for name in ("dashboard.log", "dashboard_agent.log", "raylet.out", "gcs_server.out"):
        f = logs / name
        if f.is_file():
            parts.append(f"--- {name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-15:]))
    return "\n".join(parts)


def load(path: Path) -> dict:
    assert path.is_file(), f"{path} was not written"
    return json.loads(path.read_text())


def check_record(res: dict, benchmark: str) -> None:
    assert res["benchmark"] == benchmark
    assert res["hardware"]["cpu_model"] and res["hardware"]["cpu_count"] >= 1
    for v in ("python", "torch", "ray", "triton"):
        assert v in res["versions"]
    assert res["args"]


# ------------------------------------------------------------------ no Ray needed


def test_shapes_are_the_real_configs(tmp_path):
    from benchmarks.shapes import write_shape
    from workers.models.arch import load_arch

    expect = {
        "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
                           num_heads=16, num_kv_heads=8, head_dim=128, tie_word_embeddings=True, qk_norm=True,
                           max_position_embeddings=40960, rope_theta=1e6),
        "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                             num_heads=32, num_kv_heads=8, head_dim=64, tie_word_embeddings=True,
                             max_position_embeddings=131072, rope_theta=500000.0),
        "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                             num_heads=32, num_kv_heads=8, head_dim=128, tie_word_embeddings=False,
                             max_position_embeddings=131072, rope_theta=500000.0),
    }
    for name, fields in expect.items():
        arch = load_arch(write_shape(tmp_path / name, name))
        for k, v in fields.items():
            assert getattr(arch, k) == v, (name, k)
    l1 = load_arch(tmp_path / "llama-3.2-1b").rope_scaling
    assert (l1["rope_type"], l1["factor"], l1["low_freq_factor"], l1["high_freq_factor"],
            l1["original_max_position_embeddings"]) == ("llama3", 32.0, 1.0, 4.0, 8192)
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
    outs = [RequestFuncOutput(success=True, prompt_len=10, output_tokens=4, ttft=0.1, itl=[0.02, 0.03, 0.05], latency=0.2),
            RequestFuncOutput(success=False, error="boom")]
    m = calculate_metrics(reqs, outs, duration=2.0, selected=["ttft", "tpot", "itl", "e2el"], percentiles=[90, 99])
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (1, 1, 10, 4)
    assert m["request_throughput"] == 0.5 and m["output_throughput"] == 2.0 and m["total_token_throughput"] == 7.0
    assert m["mean_ttft_ms"] == pytest.approx(100.0)
    assert m["mean_tpot_ms"] == pytest.approx((0.2 - 0.1) / 3 * 1000)
    assert m["median_itl_ms"] == pytest.approx(30.0)
    assert m["p99_e2el_ms"] == pytest.approx(200.0)
    assert {"p90_ttft_ms", "std_itl_ms", "p90_tpot_ms"} <= set(m)


# --------------------------------------------------------------- Ray jobs, tiny


def test_throughput_job(ray_head, tmp_path):
    out = tmp_path / "throughput.json"
    submit(ray_head, "benchmarks.throughput", "--shape", "tiny", "--dataset", "random", "--num-prompts", "6",
           "--input-len", "16", "--output-len", "8", "--range-ratio", "0.5", "--seed", "3", "--device", "cpu",
           "--max-num-seqs", "4", "--engine-option", "block_size=16", "--baseline", "hf",
           "--output", str(out), "--plot")
    res = load(out)
    check_record(res, "throughput")
    for k in ("elapsed_time", "num_requests", "total_num_tokens", "requests_per_second", "tokens_per_second",
              "output_tokens_per_second"):
        assert res[k] > 0, k
    assert res["num_requests"] == 6
    assert res["config"]["engine_config"]["scheduler"]["max_num_seqs"] == 4
    assert res["config"]["load_format"] == "dummy"
    assert res["tokens_per_second"] == pytest.approx(res["total_num_tokens"] / res["elapsed_time"])
    base = res["baseline"]
    assert "error" not in base, base
    assert base["num_requests"] == 6 and base["output_tokens_per_second"] > 0
    # its manager warmed and cached before the timed call, which must then reuse it
    assert base["warm_up"] == "before the timed call (cached manager)", base["warm_up"]
    assert base["warm_up_s"] >= 0
    assert res["ratio_vs_baseline"]["output_tokens_per_second"] > 0
    assert out.with_suffix(".png").stat().st_size > 1000


def test_jsonl_dataset(tmp_path):
    from transformers import AutoTokenizer

    from benchmarks.datasets import jsonl_requests
    from benchmarks.shapes import write_shape

    tok = AutoTokenizer.from_pretrained(write_shape(tmp_path / "tiny", "tiny"))
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join([json.dumps({"prompt": "w5 w6 w7 w8"}), json.dumps({"prompt_token_ids": [9, 10, 11]}),
                               "", json.dumps({"prompt": "w12 w13", "output_len": 3})]) + "\n")
    reqs = jsonl_requests(str(data), None, 5, tok)
    assert [(r.prompt_len, r.expected_output_len) for r in reqs] == [(4, 5), (3, 5), (2, 3)]
    assert reqs[1].token_ids == [9, 10, 11] and reqs[0].prompt == "w5 w6 w7 w8"
    assert len(jsonl_requests(str(data), 2, 5, tok)) == 2
    data.write_text('{"text": "no prompt"}\n')
    with pytest.raises(SystemExit, match="needs"):
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


def test_decode_roofline_job(ray_head, tmp_path):
    out = tmp_path / "roofline.json"
    submit(ray_head, "benchmarks.decode_roofline", "--shape", "tiny", "--batch-sizes", "1,4", "--context-lens",
           "32,128", "--warmup", "1", "--iters", "3", "--bandwidth-mib", "32", "--cuda-graphs", "off",
           "--profile", "1,32", "--profile-steps", "1", "--output", str(out), "--plot")
    res = load(out)
    check_record(res, "decode_roofline")
    assert res["bandwidth"]["bandwidth_bytes_per_s"] > 1e8
    assert res["device"] == "cpu" and res["worker_hardware"]["cpu_count"] >= 1
    assert res["placement"] == "ray task (1 CPU)" and res["ray_job"]["job_submission_id"]
    cells = {(c["batch_size"], c["context_len"]): c for c in res["cells"]}
    assert set(cells) == {(1, 32), (4, 32), (1, 128), (4, 128)}
    for c in cells.values():
        assert c["step_ms_median"] > 0 and c["roofline_ms"] > 0
        assert c["ratio"] == pytest.approx(c["step_ms_median"] / c["roofline_ms"])
        assert c["phase_floor_ms"] >= c["roofline_ms"] * (1 - 1e-9)  # compute can only raise it
        assert c["floor_ratio"] == pytest.approx(c["step_ms_median"] / c["phase_floor_ms"])
    # KV read grows with batch x context; weights are read once per step
    assert cells[(4, 128)]["kv_bytes"] > cells[(1, 128)]["kv_bytes"] > cells[(1, 32)]["kv_bytes"]
    assert cells[(1, 32)]["weight_bytes"] == cells[(1, 128)]["weight_bytes"]
    prof = cells[(1, 32)]["profile"]  # CPU: no device kernels, so no host/device split
    assert prof["steps"] == 1 and "kernel_ratio" not in prof and "profile" not in cells[(4, 32)]
    assert out.with_suffix(".png").stat().st_size > 1000


# ------------------------------------------------------------------- serving


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
                chunk = {"id": "c", "object": "text_completion", "model": body["model"],
                         "choices": [{"index": 0, "text": f" w{i + 3}", "finish_reason": None}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            usage = {"prompt_tokens": n_prompt, "completion_tokens": body["max_tokens"],
                     "total_tokens": n_prompt + body["max_tokens"]}
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


def check_serve_result(res: dict, n: int) -> None:
    check_record(res, "serve")
    assert res["completed"] == n and res["failed"] == 0, res["errors"]
    for m in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p90", "p99", "std"):
            assert f"{stat}_{m}_ms" in res, (stat, m)
    assert res["mean_ttft_ms"] > 0 and res["mean_e2el_ms"] >= res["mean_ttft_ms"]
    for k in ("request_throughput", "output_throughput", "total_token_throughput"):
        assert res[k] > 0


def test_serve_against_fake_openai_server(tmp_path):
    """The HTTP client and vLLM's metrics against a scripted OpenAI streaming server
    (in-process: the Ray-job path is covered against the real cluster.serve below)."""
    from benchmarks.serve import main

    out = tmp_path / "serve.json"
    with FakeOpenAIServer() as srv:
        main(["--backend", "http", "--port", str(srv.port), "--vocab-size", "512", "--num-prompts", "8",
              "--input-len", "12", "--output-len", "6", "--request-rate", "50", "--max-concurrency", "4",
              "--output", str(out), "--plot"])
    res = load(out)
    check_serve_result(res, 8)
    assert res["total_output_tokens"] == 8 * 6 and res["total_input_tokens"] == 8 * 12
    assert len(srv.requests) == 9  # one untimed test request, then the 8
    assert all(r["stream"] and r["ignore_eos"] and r["model"] == "fake-tiny" for r in srv.requests)
    assert all(isinstance(r["prompt"], list) and len(r["prompt"]) == 12 for r in srv.requests)
    assert sum(len(x) for x in res["itls"]) == 8 * 5
    assert res["config"]["max_concurrency"] == 4 and res["config"]["request_rate"] == 50
    assert out.with_suffix(".png").stat().st_size > 1000


# REAL SERVER: `python -m cluster.serve` (skipped in a tree without it).
@pytest.mark.skipif(not (ROOT / "cluster" / "serve.py").exists() and not (ROOT / "cluster" / "serve").is_dir(),
                    reason="cluster.serve is not in the tree yet")
def test_serve_jobs_against_real_cluster_serve(ray_head, tmp_path, cache_dir):
    from benchmarks.shapes import shape_dir

    os.environ["SYNCLESS_CACHE"] = str(cache_dir)
    model = shape_dir("tiny")
    http, grpc_port = free_port(), free_port()
    env = dict(ray_head["env"], RAY_ADDRESS=ray_head["gcs"])
    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "cluster.serve", "--model", str(model), "--load-format", "dummy", "--device", "cpu",
         "--http-port", str(http), "--grpc-port", str(grpc_port), "--shutdown-timeout", "1"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    common = ["--shape", "tiny", "--num-prompts", "6", "--input-len", "10", "--output-len", "5", "--max-concurrency",
              "3", "--ready-timeout", "180", "--output", str(tmp_path / "serve-http.json")]
    try:  # HTTP through a Ray job; gRPC with plain `python -m` (both paths, less time)
        out = tmp_path / "serve-http.json"
        submit(ray_head, "benchmarks.serve", "--backend", "http", "--port", str(http), *common)
        res = load(out)
        check_serve_result(res, 6)
        assert res["total_output_tokens"] == 6 * 5
        out = tmp_path / "serve-grpc.json"
        proc = subprocess.run([sys.executable, "-m", "benchmarks.serve", "--backend", "grpc", "--port", str(grpc_port),
                               *common[:-1], str(out)], capture_output=True, text=True, timeout=JOB_TIMEOUT_S,
                              env=ray_head["env"], cwd=ROOT)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        res = load(out)
        check_serve_result(res, 6)
        assert res["total_output_tokens"] == 6 * 5
        assert res["config"]["server_info"]["vocab_size"] in (512, "512")
    finally:
        _end_group(server)
        log.close()
        if server.returncode not in (0, -signal.SIGTERM, -signal.SIGKILL, None):
            print((tmp_path / "serve.log").read_text()[-3000:])


def test_recorded_commit_is_this_checkout_or_named(monkeypatch, tmp_path):
    """Results name the code that produced them: this checkout's HEAD, the commit given in
    SYNCLESS_COMMIT, and nothing (never an enclosing repository's HEAD) for a bare export."""
    from benchmarks import common

    root = Path(__file__).resolve().parents[1]
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
    out = subprocess.run([sys.executable, "-c", code], cwd=export, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(export)})
    assert out.stdout.strip().splitlines()[-1] == "None", out.stderr


def test_roofline_table_lines(tmp_path, capsys):
    from benchmarks.roofline_table import main, table

    top = [{"name": "_paged_attention_kernel", "us_per_step": 300.5},
           {"name": "_rope_kv_kernel", "us_per_step": 20.0},
           {"name": "_skinny_kernel", "us_per_step": 4000.0}]
    cells = [{"batch_size": 1, "context_len": 512, "step_ms_median": 4.3421, "ratio": 1.2346,
              "profile": {"kernel_us_per_step": 4355.6, "top": top}},
             {"batch_size": 8, "context_len": 4096, "step_ms_median": 4.9, "ratio": 1.36},
             {"batch_size": 256, "context_len": 4096, "skipped": "KV cache needs 129.0 GiB"}]
    path = tmp_path / "rl-llama-3.1-8b-off.json"
    path.write_text(json.dumps({"cells": cells}))
    lines = table([str(path)])
    assert lines == [
        "llama-3.1-8b-off         b1    ctx512   4.342 ms ratio 1.235 kern  4355.6 us attn+rope  320.5",
        "llama-3.1-8b-off         b8    ctx4096  4.900 ms ratio 1.360 kern     0.0 us attn+rope    0.0"]
    main([str(path)])
    assert capsys.readouterr().out.splitlines() == lines
