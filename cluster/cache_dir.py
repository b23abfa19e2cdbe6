"""The folder syncless caches generated files in (the demo model, gRPC stubs, benchmark shapes,
GGUF tokenizers): ``$SYNCLESS_CACHE``, else ``$XDG_CACHE_HOME/syncless``, else
``~/.cache/syncless``. Read at start-up and by tools only."""

from __future__ import annotations

import os
from pathlib import Path


def syncless_cache_dir() -> Path:
    base = os.environ.get("SYNCLESS_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "syncless"
    )
    return Path(base)
