"""Benchmarks end to end on the CPU: real ``ray job submit`` to a local head started here.

The parts that need no Ray (datasets, metrics, the HTTP client, result tables) are
tested in ``tests/benchmarks/test_benchmarks_offline.py``.

The head runs in its own ``--temp-dir`` (so no other ``ray.init()`` on this machine
finds it) and its own process group, which teardown ends; ``ray stop`` is never
used (it would end every Ray instance on the machine).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from benchmarks.child_process import spawn_session
from tests.benchmark_results import check_record, check_serve_result, load
from tests.serve_helpers import free_port

ROOT = Path(__file__).resolve().parents[2]
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
    env = dict(
        os.environ,
        SYNCLESS_CACHE=str(cache_dir),
        RAY_DEDUP_LOGS="0",
        TOKENIZERS_PARALLELISM="false",
        RAY_USAGE_STATS_ENABLED="0",
    )
    env.pop("RAY_ADDRESS", None)
    if _has_ray_token(env):  # Ray 2.60: `ray start` turns token auth on when a token exists; the
        env["RAY_AUTH_MODE"] = "token"  # job CLI only sends it when told to
    log = open(Path(temp) / "head.log", "w")
    # Every port explicit: fixed defaults (agent 52365, client server 10001) may be taken by
    # another Ray instance on this machine, which leaves the head without a job agent.
    head = spawn_session(
        [
            *_ray_cli(),
            "start",
            "--head",
            "--block",
            f"--temp-dir={temp}",
            "--num-cpus=4",
            f"--port={gcs}",
            f"--dashboard-port={dash}",
            "--dashboard-host=127.0.0.1",
            "--include-dashboard=true",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--ray-client-server-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
            "--object-store-memory=300000000",
            "--disable-usage-stats",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
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
        proc = subprocess.run(
            [*_ray_cli(), "job", "list", "--address", url], capture_output=True, text=True, timeout=60, env=env
        )
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
    cmd = [
        *_ray_cli(),
        "job",
        "submit",
        "--address",
        head["dashboard"],
        "--working-dir",
        str(ROOT),
        "--runtime-env-json",
        json.dumps(runtime_env),
        "--",
        "python",
        "-m",
        module,
        *args,
    ]
    t0 = time.monotonic()
    while True:  # the job agent registers a little after the dashboard answers
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=head["env"], cwd=ROOT)
        if "No available agent" not in proc.stderr or time.monotonic() - t0 > 120:
            break
        time.sleep(2)
    print(f"{module}: job took {time.monotonic() - t0:.1f} s")
    print("\n".join(line for line in proc.stdout.splitlines()[-12:] if "it/s]" not in line))
    assert proc.returncode == 0, (
        f"job {module} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}\n{_head_logs(head)}"
    )
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


# --------------------------------------------------------------- Ray jobs, tiny


def test_throughput_job(ray_head, tmp_path):
    out = tmp_path / "throughput.json"
    submit(
        ray_head,
        "benchmarks.throughput",
        "--shape",
        "tiny",
        "--dataset",
        "random",
        "--num-prompts",
        "6",
        "--input-len",
        "16",
        "--output-len",
        "8",
        "--range-ratio",
        "0.5",
        "--seed",
        "3",
        "--device",
        "cpu",
        "--max-num-seqs",
        "4",
        "--engine-option",
        "block_size=16",
        "--baseline",
        "hf",
        "--output",
        str(out),
        "--plot",
    )
    res = load(out)
    check_record(res, "throughput")
    for k in (
        "elapsed_time",
        "num_requests",
        "total_num_tokens",
        "requests_per_second",
        "tokens_per_second",
        "output_tokens_per_second",
    ):
        assert res[k] > 0, k
    assert res["num_requests"] == 6
    assert res["config"]["engine_config"]["scheduler"]["max_num_seqs"] == 4
    assert res["config"]["load_format"] == "dummy"
    assert res["tokens_per_second"] == pytest.approx(res["total_num_tokens"] / res["elapsed_time"])
    # rank 0's host launch per step; on the CPU no decode graph exists, so every step counts apart
    wl = res["worker_launch_ms"]
    assert wl["steps"] > 0 and wl["median"] > 0 and wl["mixed_steps"] == wl["steps"], wl
    from workers.model_runner import LAUNCH_PHASES

    assert wl["phases"]["decode"] == [] and len(wl["phases"]["mixed"]) == len(LAUNCH_PHASES), wl  # ms by phase
    assert 0 < sum(wl["phases"]["mixed"]) <= wl["mixed_median"] * 2, wl
    base = res["baseline"]
    assert "error" not in base, base
    assert base["num_requests"] == 6 and base["output_tokens_per_second"] > 0
    # its manager warmed and cached before the timed call, which must then reuse it
    assert base["warm_up"] == "before the timed call (cached manager)", base["warm_up"]
    assert base["warm_up_s"] >= 0
    assert res["ratio_vs_baseline"]["output_tokens_per_second"] > 0
    assert out.with_suffix(".png").stat().st_size > 1000


def test_decode_roofline_job(ray_head, tmp_path):
    out = tmp_path / "roofline.json"
    submit(
        ray_head,
        "benchmarks.decode_roofline",
        "--shape",
        "tiny",
        "--batch-sizes",
        "1,4",
        "--context-lens",
        "32,128",
        "--warmup",
        "1",
        "--iters",
        "3",
        "--bandwidth-mib",
        "32",
        "--cuda-graphs",
        "off",
        "--profile",
        "1,32",
        "--profile-steps",
        "1",
        "--output",
        str(out),
        "--plot",
    )
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


# REAL SERVER: `python -m cluster.serve` (skipped in a tree without it).
@pytest.mark.skipif(
    not (ROOT / "cluster" / "serve.py").exists() and not (ROOT / "cluster" / "serve").is_dir(),
    reason="cluster.serve is not in the tree yet",
)
def test_serve_jobs_against_real_cluster_serve(ray_head, tmp_path, cache_dir):
    from benchmarks.shapes import shape_dir

    os.environ["SYNCLESS_CACHE"] = str(cache_dir)
    model = shape_dir("tiny")
    http, grpc_port = free_port(), free_port()
    env = dict(ray_head["env"], RAY_ADDRESS=ray_head["gcs"])
    log = open(tmp_path / "serve.log", "w")
    server = spawn_session(
        [
            sys.executable,
            "-m",
            "cluster.serve",
            "--model",
            str(model),
            "--load-format",
            "dummy",
            "--device",
            "cpu",
            "--http-port",
            str(http),
            "--grpc-port",
            str(grpc_port),
            "--shutdown-timeout",
            "1",
        ],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    common = [
        "--shape",
        "tiny",
        "--num-prompts",
        "6",
        "--input-len",
        "10",
        "--output-len",
        "5",
        "--max-concurrency",
        "3",
        "--ready-timeout",
        "180",
        "--output",
        str(tmp_path / "serve-http.json"),
    ]
    try:  # HTTP through a Ray job; gRPC with plain `python -m` (both paths, less time)
        out = tmp_path / "serve-http.json"
        submit(ray_head, "benchmarks.serve", "--backend", "http", "--port", str(http), *common)
        res = load(out)
        check_serve_result(res, 6)
        assert res["total_output_tokens"] == 6 * 5
        out = tmp_path / "serve-grpc.json"
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "benchmarks.serve",
                "--backend",
                "grpc",
                "--port",
                str(grpc_port),
                *common[:-1],
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=JOB_TIMEOUT_S,
            env=ray_head["env"],
            cwd=ROOT,
        )
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


def test_throughput_sets_host_time_beside_device_time():
    """``host_against_device``: means a step over the engine's counters; the device's busy time
    where the timeline ran, else the elapsed time a step; 'NOT below' when either host part
    (the worker's launch, or the driver's scheduling plus processing) reaches it."""
    from benchmarks.throughput import host_against_device

    st = {"steps": 100, "worker_launch_s": 0.1, "driver_schedule_s": 0.05, "driver_process_s": 0.15}
    line = host_against_device({"engine_stats": st, "elapsed_time": 0.9})
    assert "elapsed (device time unmeasured) 9.00 ms" in line and "worker launch 1.00 ms" in line
    assert "driver schedule + process 2.00 ms: below" in line
    timeline = {"steps": 100, "device_busy_s": 0.15}
    line = host_against_device({"engine_stats": st, "elapsed_time": 0.9, "device_timeline": timeline})
    assert "device busy 1.50 ms" in line and line.endswith("NOT below the device time")
    assert host_against_device({"engine_stats": {}, "elapsed_time": 1.0}) is None
