"""Front-end helpers shared by the online (``cluster.dp_engine``) and offline
(``cluster.dp_offline``) data-parallel front ends: starting replica actors, turning a
client's request into a ``ReplicaRequest`` plus its block hashes, and turning a
replica's refusal back into the exception the single-engine path raises."""

from __future__ import annotations

import re
from typing import Any

import msgspec

from cluster.dp_policy import PrefixLoadRouter
from cluster.replica_wire import AddResult, ReplicaRequest, encode
from metadata.config import EngineConfig
from metadata.sampling_params import SamplingParams


def front_end_tokenizer(cfg: EngineConfig, model_path: str):
    """The front end's own tokenizer, loaded as the replicas load theirs (``model_path``: the
    checkpoint a replica reported, the same path on every node of the cluster)."""
    try:
        from cluster.model_source import load_tokenizer
    except ImportError:  # an engine without model_source: checkpoint directories only
        load_tokenizer = None
    if load_tokenizer is not None:
        return load_tokenizer(model_path, cfg.model.tokenizer)
    from transformers import AutoTokenizer

    from workers.models.arch import ModelLoadError

    path = cfg.model.tokenizer or model_path
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {exc}") from None


def start_replica_actor(cfg: EngineConfig, index: int, max_waiting_requests: int):
    """Create replica ``index``'s actor (it builds its engine and workers in its constructor)."""
    import ray

    from cluster.replica import ReplicaActor, replica_actor_options

    cls = ray.remote(ReplicaActor)
    return cls.options(**replica_actor_options()).remote(encode(cfg), index, max_waiting_requests)


def startup_timeout_s(cfg: EngineConfig) -> float:
    """How long a replica may take to build its engine (tokenizer, placement, model load)."""
    return 3 * cfg.parallel.worker_start_timeout_s + 60


def actor_error(exc: BaseException) -> str:
    """The useful line of a replica actor's failure (its constructor's exception, or its death)."""
    from cluster.executor import death_cause

    text = str(exc)
    found = re.findall(r"^\s*((?:[\w.]+\.)?\w*(?:Error|Exception)\w*: .+)$", text, flags=re.MULTILINE)
    if found:
        return found[-1].strip()[:500]
    return death_cause(exc)


def wire_request(
    tokenizer,
    router: PrefixLoadRouter,
    request_id: str,
    prompt: Any,
    params: SamplingParams | None,
    strict_field: str | None = None,
) -> tuple[ReplicaRequest, list[bytes]]:
    """The request for a replica, plus its prompt's block hashes for routing. A text prompt
    is tokenized here once (the replica does not tokenize it again); other prompt forms go
    as they are and the replica validates them."""
    ids: list[int] | None = None
    tokenized = False
    if isinstance(prompt, str) and prompt:
        ids = list(tokenizer.encode(prompt, add_special_tokens=True))
        tokenized = bool(ids)
    elif isinstance(prompt, dict) and isinstance(prompt.get("prompt_token_ids"), list):
        ids = prompt["prompt_token_ids"]
    elif isinstance(prompt, list):
        ids = prompt
    hashes: list[bytes] = []
    if ids and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 62 for t in ids):
        salt = params.cache_salt if isinstance(params, SamplingParams) else None
        hashes = router.block_hashes(ids, salt)
    try:
        req = ReplicaRequest(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=ids if tokenized else None,
            params=params if isinstance(params, SamplingParams) else None,
            strict_field=strict_field,
        )
        encode(req)
    except (TypeError, msgspec.EncodeError):
        from cluster.input_processor import InvalidRequestError

        raise InvalidRequestError(
            "a prompt must be a string, a list of token ids or {'prompt_token_ids': [...]}", "prompt"
        ) from None
    if params is not None and not isinstance(params, SamplingParams):
        from cluster.input_processor import InvalidRequestError

        raise InvalidRequestError("sampling_params must be a SamplingParams", "sampling_params")
    return req, hashes


def add_error(res: AddResult) -> BaseException:
    """The exception a refused add raises (the single-engine path's types)."""
    from cluster.request_stream import EngineUnavailable, Overloaded
    from cluster.input_processor import InvalidRequestError

    if res.error_kind == "invalid":
        return InvalidRequestError(res.error, res.error_field)
    if res.error_kind == "overloaded":
        return Overloaded(res.error)
    if res.error_kind == "unavailable":
        return EngineUnavailable(res.error)
    return RuntimeError(res.error)
