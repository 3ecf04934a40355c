"""What the app holds for its lifetime, handed to handlers as typed lifespan state."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.auth import RateLimiter
from gateway.cache import ResponseCache
from gateway.lifecycle import Lifecycle
from gateway.registry import ModelRegistry
from gateway.settings import Settings


@dataclass(slots=True)
class GatewayState:
    settings: Settings
    models: ModelRegistry
    lifecycle: Lifecycle
    limiter: RateLimiter
    cache: ResponseCache
