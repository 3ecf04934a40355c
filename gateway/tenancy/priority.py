"""A request's priority: from its key's class (the keys file's `priority`) and, where the key allows
it (`request_priority: true`), from the request itself (OpenAI's `service_tier`, vLLM's integer
`priority`). One decision, made once per request (`pipeline.attempt`), read by admission (the class:
its queue order and share) and by the engine (the integer: vLLM's priority scheduling, lower first).

    class    engine priority   service_tier echoed
    high     -1                priority
    normal    0 (vLLM's own)   default
    low       1                flex
    (batch)   2                flex      a batch's lines (`BATCH`): below every key's class, admitted as low

A request may always *lower* its priority (`service_tier: flex`, an integer above its class's):
yielding to others harms no one. Raising it (`service_tier: priority`, a lower integer) needs the
key's `request_priority`; without it the request runs at its key's class, and its answer says so
(`service_tier` names the tier actually used, as OpenAI's does). `auto` and no tier: the key's class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from gateway.settings import Priority
from gateway.tenancy.tenants import KeyPolicy

ServiceTier = Literal["auto", "default", "flex", "priority"]

ENGINE_PRIORITY: dict[Priority, int] = {"high": -1, "normal": 0, "low": 1}
_TIER_CLASS: dict[str, Priority] = {"priority": "high", "default": "normal", "flex": "low"}
_CLASS_TIER: dict[Priority, str] = {"high": "priority", "normal": "default", "low": "flex"}


@dataclass(frozen=True, slots=True)
class Scheduled:
    """Where a request runs: its class (admission) and vLLM's priority (the engine), and the tier
    its answer names."""

    klass: Priority = "normal"
    priority: int = 0

    @property
    def tier(self) -> str:
        return _CLASS_TIER[self.klass]

    def forwarded(self, payload: dict[str, Any]) -> dict[str, Any]:
        """A request for a remote model, its priority fields (those given a value) saying what was
        decided here: the upstream must not run at a priority the key may not raise to (or a batch
        line above the batch lane)."""
        if payload.get("priority") is not None:
            payload["priority"] = self.priority
        if payload.get("service_tier") is not None:
            payload["service_tier"] = self.tier
        return payload


NORMAL = Scheduled()
BATCH = Scheduled("low", ENGINE_PRIORITY["low"] + 1)  # the batch lane: after everything interactive


def class_of(priority: int) -> Priority:
    """The admission class of an engine priority: below 0 high, 0 normal, above 0 low."""
    return "high" if priority < 0 else "low" if priority > 0 else "normal"


def scheduled(key_class: Priority, may_raise: bool, tier: str | None = None, priority: int | None = None) -> Scheduled:
    """The request's place: its key's class, or what it asks for (`priority` over `tier`) when that
    is lower, or when the key may raise it."""
    own = ENGINE_PRIORITY[key_class]
    if priority is not None:
        wanted = priority
    elif tier is not None and tier in _TIER_CLASS:
        wanted = ENGINE_PRIORITY[_TIER_CLASS[tier]]
    else:
        wanted = own
    if wanted < own and not may_raise:
        wanted = own
    if wanted == own:
        return Scheduled(key_class, own) if key_class != "normal" else NORMAL
    return Scheduled(class_of(wanted), wanted)


def of(policy: KeyPolicy, body: object) -> Scheduled:
    """A request's place, from its key's policy and the fields it sent (chat, completions and the
    Responses API carry `service_tier` and `priority`; other routes run at the key's class)."""
    tier, wanted = getattr(body, "service_tier", None), getattr(body, "priority", None)
    if tier is None and wanted is None:
        return NORMAL if policy.priority == "normal" else Scheduled(policy.priority, ENGINE_PRIORITY[policy.priority])
    return scheduled(policy.priority, policy.request_priority, tier, wanted)
