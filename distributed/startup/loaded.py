"""The end of a rank's loading: every rank says whether it loaded (check_every_rank_loaded: all
fail together), and what rank 0 holds then (Loaded)."""

from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from ..runtime.pipeline import Pipeline
from .handshake import StartupRefused, exchange_errors
from .watchdog import Watchdog


def check_every_rank_loaded(group, error: Optional[BaseException], hosts: List[str],
                            watchdog: Optional[Watchdog]) -> None:
    """Every rank says whether it loaded, with its error text; all fail together
    instead of one waiting forever for a peer that already exited, and rank 0
    shows each failed rank's own error (that rank may be on another machine)."""
    texts = exchange_errors(group, None if error is None else str(error) or type(error).__name__)
    failed = [f"rank {r} failed to start on host {hosts[r]}: {text}" for r, text in enumerate(texts) if text is not None]
    if failed and watchdog is not None:
        watchdog.close()  # every rank knows now, and exits with its own message
    if error is not None:
        raise error
    if failed:
        raise StartupRefused("; ".join(failed))


@dataclass
class Loaded:
    """What rank 0 holds once every rank has loaded."""

    pipeline: Pipeline
    path: Path  # this rank's checkpoint folder (config, tokenizer)
    config: dict
    memory_bytes: List[int]  # each stage's usable memory, measured before loading (shared per host)
