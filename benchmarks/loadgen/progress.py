"""The progress bar of a measured run (tqdm, imported only when a bar is wanted: the CLI on a terminal)."""

from __future__ import annotations

from typing import Protocol

from benchmarks.loadgen.config import LoadConfig


class Bar(Protocol):
    """What the runner needs of a progress bar (tqdm's)."""

    def update(self, n: int = 1) -> object: ...

    def close(self) -> None: ...


def open_bar(config: LoadConfig) -> Bar | None:
    """A bar counting the run's requests when `config.progress`, else None."""
    if not config.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=config.num_requests, desc=config.label or f"c={config.concurrency}", unit="req", leave=False)
