"""STAND-IN for mcp41g's boundary (deleted once merged)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gateway.errors import InvalidRequest


@dataclass(frozen=True)
class Target:
    label: str
    url: str
    headers: Mapping[str, str]


async def reach(policy: object, *, servers: object, server_label: str, server_url: str | None,
                headers: Mapping[str, str]) -> Target:
    if server_url is None:
        raise InvalidRequest("server_url is required", "server_url")
    return Target(server_label, server_url, headers)


def tool_allowed(policy: object, label: str, tool: str) -> bool:
    return True
