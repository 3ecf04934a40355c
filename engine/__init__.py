"""The engine layer: the only package that imports vllm (in `engine.vllm_engine`, lazily).

`engine.types` is the interface the gateway codes against; `engine.errors` what it may raise.
"""

from __future__ import annotations

from engine.config import EngineSettings
from engine.types import Engine


def start_engine(settings: EngineSettings) -> Engine:
    """Start the embedded vLLM engine (imports vllm, loads the model: tens of seconds)."""
    from engine.vllm_engine import VLLMEngine

    return VLLMEngine.start(settings)


def check_engine_settings(settings: EngineSettings) -> None:
    """Refuse what the model or the platform cannot use (`engine.errors.EngineConfigError`, naming
    the setting) without starting anything: imports vllm and reads the model's config.json."""
    from engine.vllm_engine import engine_args

    engine_args(settings)


__all__ = ["Engine", "EngineSettings", "check_engine_settings", "start_engine"]
