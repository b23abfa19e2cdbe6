"""Loading a measured tuning table (``{"entries": {key: config | null}, ...}``) and checking
the GEMM tile configs such tables (and sweeps) hold."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable


def load_entries(
    path: str, packaged: Path, option: str, what: str, check: Callable[[str, dict], None] | None = None
) -> dict[str, dict | None]:
    """The entries of the table at ``path``, each non-null one passed to ``check``. The
    packaged table may be absent (no entries: every caller's fallback); a table named by the
    engine option ``option`` must load, else ``ValueError`` naming the option and the file."""
    try:
        entries = json.loads(Path(path).read_text())["entries"]
        if not isinstance(entries, dict):
            raise ValueError(f"'entries' is a {type(entries).__name__}, not an object")
    except (OSError, ValueError, KeyError, TypeError) as e:
        if path != str(packaged):
            raise ValueError(f"{option}={path}: not a {what} tuning file ({e!r})") from e
        return {}
    if check is not None:
        for key, cfg in entries.items():
            if cfg is not None:
                check(key, cfg)
    return entries


def check_tiles(cfg: dict, int_keys: tuple[str, ...], what: str) -> None:
    """Reject a GEMM config its kernel cannot run (a bad tuning entry, a typo in a sweep):
    every ``int_keys`` a positive int, ``block_m`` / ``block_n`` / ``block_k`` powers of two
    >= 16."""
    for key in int_keys:
        if not isinstance(cfg.get(key), int) or cfg[key] < 1:
            raise ValueError(f"{what} config needs a positive int {key!r}: {cfg}")
    for key in ("block_m", "block_n", "block_k"):
        if cfg[key] < 16 or cfg[key] & (cfg[key] - 1):
            raise ValueError(f"{what} {key} must be a power of two >= 16: {cfg}")
