"""Consumers of exact host-side sequence lengths, refused at startup where none exist.

With async scheduling *and* speculative decoding the host never knows how many
drafts an in-flight step accepted, so it holds only upper bounds. A feature
that needs exact lengths on the host cannot work then; instead of failing at
step time, the engine refuses the configuration when it starts, naming the
options that would make it valid.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the config calls in here, never the other way
    from metadata.config import EngineConfig


@dataclass(frozen=True)
class ExactLengthConsumer:
    name: str
    enabled: Callable[[EngineConfig], bool]
    why: str
    alternatives: str


EXACT_LENGTH_CONSUMERS: list[ExactLengthConsumer] = [
    ExactLengthConsumer(
        name="speculative_method='ngram_host'",
        enabled=lambda cfg: cfg.speculative.speculative_method == "ngram_host",
        why="the driver looks up n-grams in each request's exact token list, but under async "
        "scheduling the tokens accepted by in-flight steps are not known yet",
        alternatives="use speculative_method='ngram' (the lookup runs on the device from the "
        "device sequence lengths) or async_scheduling=False",
    ),
]


def exact_length_refusal(cfg: EngineConfig) -> str | None:
    """Why the config is refused if an enabled feature needs exact host lengths (async +
    spec; ``EngineConfig.validate`` raises it as a ``ConfigError``), else None."""
    bad = [c for c in EXACT_LENGTH_CONSUMERS if c.enabled(cfg)]
    if bad:
        c = bad[0]
        return (
            f"{c.name} needs exact sequence lengths on the host, which async scheduling with "
            f"speculative decoding never has ({c.why}); {c.alternatives}"
        )
    return None
