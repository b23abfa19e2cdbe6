"""Generated gRPC modules for ``syncless.proto``: ``pb2`` (messages) and ``pb2_grpc`` (stubs).

The checked-in modules were generated with grpcio-tools 1.84.0 (see README.md).
When the installed protobuf runtime rejects them, they are regenerated with the
installed ``grpc_tools`` into a cache folder and loaded from there.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path

from cluster.cache_dir import syncless_cache_dir

_HERE = Path(__file__).resolve().parent
_PROTO = _HERE / "syncless.proto"


def _regenerate():
    from grpc_tools import protoc

    digest = hashlib.sha256(_PROTO.read_bytes()).hexdigest()[:16]
    out = syncless_cache_dir() / f"proto-{digest}"
    target = out / "cluster" / "proto"
    if not (target / "syncless_pb2_grpc.py").exists():
        target.mkdir(parents=True, exist_ok=True)
        src = out / "cluster" / "proto" / "syncless.proto"
        src.write_bytes(_PROTO.read_bytes())
        rc = protoc.main(["protoc", f"-I{out}", f"--python_out={out}", f"--grpc_python_out={out}", str(src)])
        if rc != 0:
            raise RuntimeError(f"grpc_tools.protoc failed ({rc}) to regenerate {_PROTO}")
    mods = []
    for name in ("syncless_pb2", "syncless_pb2_grpc"):
        full = f"{__name__}.{name}"
        spec = importlib.util.spec_from_file_location(full, target / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[full] = mod
        spec.loader.exec_module(mod)
        mods.append(mod)
    return mods


try:
    from cluster.proto import syncless_pb2 as pb2, syncless_pb2_grpc as pb2_grpc
except Exception:  # gencode/runtime version mismatch: regenerate with the installed tools
    sys.modules.pop(f"{__name__}.syncless_pb2", None)
    sys.modules.pop(f"{__name__}.syncless_pb2_grpc", None)
    pb2, pb2_grpc = _regenerate()

__all__ = ["pb2", "pb2_grpc"]
