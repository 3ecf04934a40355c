"""A request's priority: its key's class, lowered (or raised, where the key allows) by the request's `service_tier` or
`priority`; read by admission (the class) and the engine (the integer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.settings import Priority
from gateway.tenancy.tenants import KeyPolicy

ENGINE_PRIORITY: dict[Priority, int] = {"high": -1, "normal": 0, "low": 1}
_TIER_CLASS: dict[str, Priority] = {"priority": "high", "default": "normal", "flex": "low"}
_CLASS_TIER: dict[Priority, str] = {"high": "priority", "normal": "default", "low": "flex"}


@dataclass(frozen=True, slots=True)
class Scheduled:
    klass: Priority = "normal"
    priority: int = 0

    @property
    def tier(self) -> str:
        return _CLASS_TIER[self.klass]

    def forwarded(self, payload: dict[str, Any]) -> dict[str, Any]:
        """The request's priority fields as decided here, for a remote model: the upstream must not run it higher than
        the key may."""
        if payload.get("priority") is not None:
            payload["priority"] = self.priority
        if payload.get("service_tier") is not None:
            payload["service_tier"] = self.tier
        return payload


NORMAL = Scheduled()
BATCH = Scheduled("low", ENGINE_PRIORITY["low"] + 1)  # the batch lane: after everything interactive


def scheduled(key_class: Priority, may_raise: bool, tier: str | None = None, priority: int | None = None) -> Scheduled:
    """The key's class, or what the request asks for (`priority` over `tier`) when lower, or when the key may raise
    it."""
    own = ENGINE_PRIORITY[key_class]
    if priority is not None:
        wanted = priority
    elif tier is not None and tier in _TIER_CLASS:
        wanted = ENGINE_PRIORITY[_TIER_CLASS[tier]]
    else:
        wanted = own
    if wanted < own and not may_raise:
        wanted = own
    return NORMAL if wanted == 0 else Scheduled("high" if wanted < 0 else "low", wanted)


def of(policy: KeyPolicy, body: object) -> Scheduled:
    tier, wanted = getattr(body, "service_tier", None), getattr(body, "priority", None)
    return scheduled(policy.priority, policy.request_priority, tier, wanted)
