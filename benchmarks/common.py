"""Shared pieces: environment record, engine-option flags, results, plots."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# ------------------------------------------------------------------ environment


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(mod: str) -> str | None:
    try:
        m = __import__(mod)
        return getattr(m, "__version__", "unknown")
    except Exception:
        return None


def _git_commit() -> str | None:
    """HEAD of this checkout; ``SYNCLESS_COMMIT`` where the code is an export without ``.git``
    (else git would answer for whatever repository encloses the export: a wrong commit)."""
    if os.environ.get("SYNCLESS_COMMIT"):
        return os.environ["SYNCLESS_COMMIT"]
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except Exception:
        return None


def hardware_info() -> dict[str, Any]:
    """CPU and (if visible) GPU of the process that calls it."""
    info: dict[str, Any] = {
        "hostname": platform.node(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
    }
    try:
        info["memory_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    try:
        import torch

        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            info["gpu_count"] = n
            info["gpus"] = [
                {
                    "name": torch.cuda.get_device_name(i),
                    "memory_bytes": torch.cuda.get_device_properties(i).total_memory,
                }
                for i in range(n)
            ]
            info["cuda_version"] = torch.version.cuda
        else:
            info["gpu_count"] = 0
    except Exception as exc:  # torch missing or broken: still record the rest
        info["gpu_error"] = str(exc)
    return info


def versions() -> dict[str, Any]:
    return {
        "python": sys.version.split()[0],
        **{name: _version(name) for name in ("torch", "triton", "ray", "transformers", "tokenizers")},
        "syncless_commit": _git_commit(),
    }


def ray_cluster_info() -> dict[str, Any] | None:
    try:
        import ray

        if not ray.is_initialized():
            return None
        return {"resources": ray.cluster_resources(), "nodes": len([n for n in ray.nodes() if n.get("Alive")])}
    except Exception:
        return None


def remote_hardware_info(num_gpus: float) -> dict[str, Any] | None:
    """Hardware as seen by a Ray task holding ``num_gpus`` (where the engine's workers run)."""
    try:
        import ray

        if not ray.is_initialized():
            return None
        task = ray.remote(num_cpus=0 if num_gpus else 1, num_gpus=num_gpus)(hardware_info)
        return ray.get(task.remote(), timeout=120)
    except Exception as exc:
        return {"error": str(exc)}


# ---------------------------------------------------------------- engine flags

# Common engine options as flags (None = engine default); anything else: --engine-option k=v.
ENGINE_FLAGS: dict[str, type] = {
    "dtype": str,
    "quantization": str,
    "kv_cache_dtype": str,
    "max_model_len": int,
    "block_size": int,
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "tensor_parallel_size": int,
    "pipeline_parallel_size": int,
    "data_parallel_size": int,
    "gpu_memory_utilization": float,
    "num_kv_blocks": int,
    "kv_cache_memory_bytes": int,
    "device": str,
}
ENGINE_BOOL_FLAGS = ("async_scheduling", "enforce_eager", "enable_chunked_prefill")


def add_model_args(p: argparse.ArgumentParser) -> None:
    from benchmarks.shapes import SHAPES

    g = p.add_argument_group("model")
    g.add_argument("--shape", choices=sorted(SHAPES), help="random-weight model of a real shape (no download)")
    g.add_argument("--model", help="a local Hugging Face checkpoint folder")
    g.add_argument(
        "--load-format",
        choices=("safetensors", "dummy"),
        default=None,
        help="default: dummy with --shape, safetensors with --model",
    )


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine (passed to cluster.LLM)")
    for name, typ in ENGINE_FLAGS.items():
        g.add_argument("--" + name.replace("_", "-"), type=typ, default=None)
    for name in ENGINE_BOOL_FLAGS:
        g.add_argument("--" + name.replace("_", "-"), action=argparse.BooleanOptionalAction, default=None)
    g.add_argument(
        "--engine-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other engine option (value parsed as JSON, else a string); repeatable",
    )


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    for name in (*ENGINE_FLAGS, *ENGINE_BOOL_FLAGS):
        v = getattr(args, name, None)
        if v is not None:
            opts[name] = v
    for item in args.engine_option:
        if "=" not in item:
            raise SystemExit(f"--engine-option expects KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        try:
            opts[k.strip().replace("-", "_")] = json.loads(v)
        except json.JSONDecodeError:
            opts[k.strip().replace("-", "_")] = v
    return opts


def model_and_format(args: argparse.Namespace) -> tuple[str, str]:
    from benchmarks.shapes import resolve_model

    model_dir, fmt = resolve_model(args.model, args.shape)
    return model_dir, args.load_format or fmt


# --------------------------------------------------------------------- results


def add_output_args(p: argparse.ArgumentParser, default_name: str) -> None:
    p.add_argument(
        "--output",
        "--output-json",
        dest="output",
        default=None,
        help=f"JSON result path (default: {default_name}-<time>.json in $SYNCLESS_RESULTS_DIR, "
        "else ~/syncless-results in a Ray job, else the current directory)",
    )
    p.add_argument(
        "--plot",
        nargs="?",
        const="",
        default=None,
        metavar="PNG",
        help="also write a PNG of the main curve (default: the JSON path with .png)",
    )


def in_ray_job() -> bool:
    """True in the entrypoint of ``ray job submit`` (Ray sets this for the job's driver)."""
    return "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ


def ray_job_metadata() -> dict[str, Any] | None:
    try:
        return json.loads(os.environ["RAY_JOB_CONFIG_JSON_ENV_VAR"]).get("metadata")
    except (KeyError, ValueError):
        return None


def default_results_dir() -> Path:
    """``$SYNCLESS_RESULTS_DIR``; in a Ray job ``~/syncless-results`` on the node that runs
    the entrypoint (the job's own working dir is temporary); else the current directory."""
    if os.environ.get("SYNCLESS_RESULTS_DIR"):
        return Path(os.environ["SYNCLESS_RESULTS_DIR"])
    return Path("~/syncless-results").expanduser() if in_ray_job() else Path.cwd()


def output_paths(args: argparse.Namespace, name: str) -> tuple[Path, Path | None]:
    out = Path(args.output or default_results_dir() / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out = out.expanduser().resolve()
    png = None
    if args.plot is not None:
        png = Path(args.plot).expanduser().resolve() if args.plot else out.with_suffix(".png")
    return out, png


def record(benchmark: str, args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    """The common header of every result: what ran, where, with which versions."""
    return {
        "benchmark": benchmark,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(sys.argv),
        "args": {k: v for k, v in vars(args).items()},
        "hardware": hardware_info(),
        "ray_job": ray_job_metadata(),
        "versions": versions(),
        **extra,
    }


def _strict(obj: Any) -> Any:
    """inf / nan as strings, so the file is strict JSON (``--request-rate inf``)."""
    if isinstance(obj, float) and (obj != obj or obj in (float("inf"), float("-inf"))):
        return str(obj)
    if isinstance(obj, dict):
        return {str(k): _strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_strict(v) for v in obj]
    return obj


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_strict(data), indent=2, default=str, allow_nan=False))
    tmp.replace(path)
    print(f"results written to {path}", flush=True)


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}", flush=True)


def measure_matmul_rate(dev) -> dict[str, Any]:
    """Dense matmul FLOP/s on ``dev`` (bf16 8192^3 on a GPU, fp32 1024^3 on the CPU): the
    compute ceiling beside the copy bandwidth."""
    import torch

    n, dtype, iters = (8192, torch.bfloat16, 10) if dev.type == "cuda" else (1024, torch.float32, 3)
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    for _ in range(3):
        a @ b
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t = time.perf_counter()
    for _ in range(iters):
        a @ b
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    sec = (time.perf_counter() - t) / iters
    return {
        "matmul_flops_per_s": 2 * n**3 / sec,
        "matmul_method": f"{n}^3 {str(dtype).removeprefix('torch.')} torch matmul, random data, "
        f"mean of {iters} after 3 warm-ups",
    }


def phase_medians(run: dict) -> dict[str, list[float]]:
    """Median ms of each launch phase (``workers.model_runner.LAUNCH_PHASES``), for the decode
    steps and for the mixed ones (steps no decode graph fits); empty where none ran."""
    out = {}
    for kind, mixed in (("decode", False), ("mixed", True)):
        rows = [p[1:] for p in run.get("launch_phases_ms", []) if bool(p[0]) == mixed]
        out[kind] = [statistics.median(col) for col in zip(*rows)] if rows else []
    return out


def thread_time_medians(run: dict) -> dict[str, tuple[float, float]]:
    """``(wall, thread CPU)`` median ms of the decode and of the mixed launches
    (``launch_cpu_ms``); where the CPU time falls short of the wall time, the launching
    thread did not run: another thread of the worker held the GIL, or the thread blocked (on
    the CPU also: the operators' own intra-op threads did the work)."""
    out = {}
    for kind, mixed in (("decode", False), ("mixed", True)):
        rows = [c[1:] for c in run.get("launch_cpu_ms", []) if bool(c[0]) == mixed]
        if rows:
            out[kind] = (statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows))
    return out
