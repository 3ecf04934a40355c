"""The gateway's one Settings object.

Sources, strongest first: keyword arguments (the CLI passes its flags this way), environment
variables prefixed `GATEWAY_` (nested with `__`, e.g. `GATEWAY_ENGINE__MAX_MODEL_LEN=4096`), a
`.env` file. Built once at the entry point and passed in; nothing else reads the environment.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from engine.config import EngineSettings


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="GATEWAY_",
        env_nested_delimiter="__",
        env_file=".env",
        extra="ignore",
    )

    host: str = Field("127.0.0.1", description="Address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="Port to listen on")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["console", "json"] = Field(
        "console", description="console: readable lines for development; json: one JSON object a line"
    )
    log_prompts: bool = Field(
        False, description="Put prompts and outputs in the access log (they may hold personal data)"
    )
    max_body_bytes: int = Field(4 * 1024 * 1024, gt=0, description="Larger request bodies get 413")
    default_max_tokens: int | None = Field(
        None, description="max_tokens when a request sends none; unset: what the context leaves"
    )
    warmup: bool = Field(
        True,
        description="Before serving, run one structured-output request so that xgrammar's one-time "
        "set-up (about 30 s on the CPU) is not paid by the first client asking for JSON",
    )
    engine: EngineSettings = Field(default_factory=EngineSettings)
