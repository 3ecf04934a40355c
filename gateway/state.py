"""What the app holds for its lifetime, handed to handlers as typed lifespan state."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.generation import ModelRegistry
from gateway.settings import Settings


@dataclass(slots=True)
class GatewayState:
    settings: Settings
    models: ModelRegistry
    draining: bool = False
