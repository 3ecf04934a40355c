"""What the app holds for its lifetime, handed to handlers as typed lifespan state."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.backends.registry import ModelRegistry
from gateway.cache import ResponseCache
from gateway.limits import RateLimiter
from gateway.middleware.lifecycle import Lifecycle
from gateway.responses_store import ResponseStore
from gateway.serving.guards.pipeline import Guards
from gateway.settings import Settings


@dataclass(slots=True)
class GatewayState:
    settings: Settings
    models: ModelRegistry
    lifecycle: Lifecycle
    limiter: RateLimiter
    cache: ResponseCache
    guards: Guards
    responses: ResponseStore  # the Responses API's stored responses
