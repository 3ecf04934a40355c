"""Errors an engine raises; the vLLM adapter maps vLLM's exceptions onto these, once, at its edge."""

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
