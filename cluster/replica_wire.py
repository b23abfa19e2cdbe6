"""The wire between the data-parallel front end and its replica actors (msgspec msgpack).

Requests go in with their sampling parameters; output deltas, finished outputs and the
replica's load come back in batches (``PollBatch``), one per long-poll call. Only these
typed structs cross the process boundary, as bytes: never pickled user data.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from cluster.outputs import RequestOutput, StreamDelta
from metadata.sampling_params import SamplingParams

ErrorKind = Literal["invalid", "overloaded", "unavailable", "internal"]


class ReplicaRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One request for a replica. ``prompt_token_ids`` set: the front end tokenized it already
    (``prompt`` is then its text, if any); else ``prompt`` is what the client sent."""

    request_id: str
    prompt: Any = None
    prompt_token_ids: list[int] | None = None
    params: SamplingParams | None = None
    strict_field: str | None = None

    def engine_prompt(self) -> Any:
        if self.prompt_token_ids is None:
            return self.prompt
        out: dict[str, Any] = {"prompt_token_ids": self.prompt_token_ids}
        if isinstance(self.prompt, str):
            out["prompt"] = self.prompt
        return out


class AddResult(msgspec.Struct, kw_only=True):
    """The replica's answer to one ``ReplicaRequest``: its tokens, or why it was refused."""

    request_id: str
    prompt_token_ids: list[int] = msgspec.field(default_factory=list)
    prompt: str | None = None
    error: str | None = None
    error_kind: ErrorKind | None = None
    error_field: str | None = None


class ReplicaLoad(msgspec.Struct, kw_only=True):
    """A replica's state as its step thread last saw it (routing and /metrics)."""

    time: float = 0.0
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    num_free_blocks: int = 0
    num_blocks: int = 0
    num_preemptions: int = 0
    steps: int = 0
    generation_tokens: int = 0
    prompt_tokens: int = 0
    groups: int = 0
    prefix_cache: dict[str, Any] = msgspec.field(default_factory=dict)
    dead: str | None = None
    """Why the replica's workers are down (it is restarting them), or None while it serves."""
    num_restarts: int = 0

    @property
    def load(self) -> float:
        """Routing load: sequences running and waiting, plus the KV cache's used fraction."""
        return self.running + self.waiting + self.kv_usage


class PollBatch(msgspec.Struct, kw_only=True):
    """Everything a replica produced since the previous poll, in step order."""

    deltas: list[StreamDelta] = msgspec.field(default_factory=list)
    finals: list[RequestOutput] = msgspec.field(default_factory=list)
    load: ReplicaLoad = msgspec.field(default_factory=ReplicaLoad)


def aggregate_loads(loads: list[ReplicaLoad]) -> dict[str, Any]:
    """The replicas' loads as one engine snapshot (``AsyncEngine.snapshot``'s keys): sums,
    the mean KV-cache usage, and the prefix-cache counters summed (hit rate recomputed)."""
    import time

    snap: dict[str, Any] = {"time": time.monotonic()}
    for k in (
        "running",
        "waiting",
        "num_free_blocks",
        "num_blocks",
        "num_preemptions",
        "steps",
        "generation_tokens",
        "prompt_tokens",
        "groups",
    ):
        snap[k] = sum(getattr(x, k) for x in loads)
    snap["kv_usage"] = sum(x.kv_usage for x in loads) / max(1, len(loads))
    pcs = [x.prefix_cache for x in loads]
    q, h = sum(p.get("queries", 0) for p in pcs), sum(p.get("hits", 0) for p in pcs)
    snap["prefix_cache"] = {
        "queries": q,
        "hits": h,
        "hit_rate": h / q if q else 0.0,
        "num_cached_blocks": sum(p.get("num_cached_blocks", 0) for p in pcs),
        "evictions": sum(p.get("evictions", 0) for p in pcs),
    }
    return snap


_encoder = msgspec.msgpack.Encoder()
_decoders: dict[Any, msgspec.msgpack.Decoder] = {}


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


def decode(data: bytes, typ: Any) -> Any:
    dec = _decoders.get(typ)
    if dec is None:
        dec = _decoders[typ] = msgspec.msgpack.Decoder(typ)
    return dec.decode(data)
