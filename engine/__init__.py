"""The engine layer: the only package that imports vllm (lazily); `engine.types` is the interface the gateway codes
against, `engine.errors` what it may raise."""

from __future__ import annotations

from multiprocessing.context import BaseContext
from typing import Any, Protocol

from engine.config import EngineSettings
from engine.types import Engine, GrammarCheck


class SharedEngine(Protocol):
    """One embedded model's engine core, started in the parent for several worker processes
    (`engine.shared.SharedCore`)."""

    @property
    def pids(self) -> list[int]: ...

    def seat(self, index: int) -> Any: ...  # a worker's `engine.shared.CoreSeat`, for `attach_shared`

    def handed_over(self) -> None: ...

    def alive(self) -> bool: ...

    def shutdown(self) -> None: ...


def start_engine(settings: EngineSettings) -> Engine:
    """Start the embedded vLLM engine (imports vllm, loads the model)."""
    from engine.vllm_engine import VLLMEngine

    return VLLMEngine.start(settings)


def launch_shared(settings: EngineSettings, clients: int, context: BaseContext) -> SharedEngine:
    """Start the engine core of an embedded model for `clients` worker processes (imports vllm, loads
    the model); each worker then calls `attach_shared` with its seat."""
    from engine.shared import SharedCore

    return SharedCore(settings, clients, context)


def attach_shared(seat: Any) -> Engine:
    """In a worker process: the engine of a core started by `launch_shared` (`seat`: its `seat(i)`)."""
    from engine.shared import attach

    return attach(seat)


def check_engine_settings(settings: EngineSettings) -> None:
    """Refuse what the model or the platform cannot use (`engine.errors.EngineConfigError`, naming
    the setting) without starting anything: imports vllm and reads the model's config.json."""
    from engine.vllm_engine import engine_args

    engine_args(settings)


def start_grammar_check(engine: Engine, workers: int, verdicts: int) -> GrammarCheck | None:
    """Processes that compile structured-output constraints for `engine`'s model as vLLM will; None for a model
    without a local directory or a known vocabulary size. Call from the event loop: the workers start in the
    background."""
    from pathlib import Path

    from engine.grammar import GrammarCompiler

    vocab_size = engine.info.extra.get("vocab_size")
    if workers <= 0 or engine.info.task != "generate" or not vocab_size or not Path(engine.info.root).is_dir():
        return None
    return GrammarCompiler(engine.info.root, int(vocab_size), workers, verdicts).start()


__all__ = [
    "Engine", "EngineSettings", "GrammarCheck", "SharedEngine", "attach_shared", "check_engine_settings",
    "launch_shared", "start_engine", "start_grammar_check",
]
