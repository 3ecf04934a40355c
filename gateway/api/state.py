"""What the app holds for its lifetime, handed to handlers as typed lifespan state."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.backends.registry import ModelRegistry
from gateway.cache import ResponseCache
from gateway.middleware.lifecycle import Lifecycle
from gateway.quota import Quota
from gateway.responses_store import ResponseStore
from gateway.serving.guards.pipeline import Guards
from gateway.settings import Settings
from gateway.tenants import Tenants


@dataclass(slots=True)
class GatewayState:
    settings: Settings
    models: ModelRegistry
    lifecycle: Lifecycle
    quota: Quota  # rate limits and token budgets per key
    cache: ResponseCache
    guards: Guards
    responses: ResponseStore  # the Responses API's stored responses
    tenants: Tenants  # the keys file: each key's policy
