"""Errors an engine raises. The vLLM adapter maps vLLM's exceptions onto these, once, at its edge.

    EngineError                  something went wrong inside the engine (500)
    ├── EngineInvalidRequest     the engine refused the request's parameters (400)
    │   └── PromptTooLong        prompt and output exceed the model's context (400)
    └── EngineUnavailable        the engine is dead or not started (503)

    EngineConfigError            a setting the model or the platform cannot use (refused at start)
"""

from __future__ import annotations


class EngineError(Exception):
    def __init__(self, message: str = "the engine failed") -> None:
        super().__init__(message)
        self.message = message


class EngineInvalidRequest(EngineError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLong(EngineInvalidRequest):
    pass


class EngineUnavailable(EngineError):
    pass


class EngineConfigError(ValueError):
    """An engine setting the model or the platform cannot use; the message names the setting."""

    def __init__(self, setting: str, why: str) -> None:
        super().__init__(f"{setting} (GATEWAY_ENGINE__{setting.upper()}): {why}")
        self.setting = setting
