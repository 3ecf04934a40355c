"""API keys (pure ASGI): a key on every route but the open ones, as `Authorization: Bearer` (OpenAI's
clients) or `x-api-key` (Anthropic's).

Keys come from settings and from the keys file (`gateway.tenants`, whose keys are named by their
id there) and are kept only as SHA-256 hashes; a presented key is hashed and compared
with every stored hash in constant time. The key's id (safe to log) goes into the request's record
and scope state, for the rate limits, the access line and sticky A/B splits.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from pydantic import SecretStr
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.context import current_record
from gateway.errors import APIError, AuthenticationFailed, dialect_of, send_error
from gateway.tenants import Tenants

ANONYMOUS = "anonymous"


class KeyRing:
    def __init__(self, keys: Iterable[SecretStr]) -> None:
        self._hashes = [hashlib.sha256(k.get_secret_value().encode()).digest() for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._hashes)

    def identify(self, presented: str) -> str | None:
        """The key's id (a prefix of its hash, safe to log), or None for an unknown key."""
        digest = hashlib.sha256(presented.encode()).digest()
        found = None
        for stored in self._hashes:  # no early exit: the time taken does not depend on which key
            if hmac.compare_digest(stored, digest):
                found = stored
        return found.hex()[:12] if found else None


class AuthMiddleware:
    """`open_paths`: the routes that take no key (from the route table)."""

    def __init__(self, app: ASGIApp, keys: KeyRing, open_paths: frozenset[str], tenants: Tenants | None = None) -> None:
        self.app = app
        self.keys = keys
        self.open = open_paths
        self.tenants = tenants  # the keys file's keys, named by their id there (gateway.tenants)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open:
            await self.app(scope, receive, send)
            return
        try:
            key_id = self._identify(scope)
        except APIError as error:
            await send_error(send, error, dialect=dialect_of(scope))
            return
        current_record().api_key_id = key_id
        scope.setdefault("state", {})["api_key_id"] = key_id
        await self.app(scope, receive, send)

    def _identify(self, scope: Scope) -> str:
        if not self.keys.enabled and not (self.tenants and self.tenants.enabled):
            return ANONYMOUS
        presented = presented_key(scope)
        if not presented:
            raise AuthenticationFailed(
                "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY' (or 'x-api-key: YOUR_KEY')."
            )
        key_id = (self.tenants and self.tenants.identify(presented)) or self.keys.identify(presented)
        if key_id is None:
            raise AuthenticationFailed("Incorrect API key provided.")
        return key_id


def presented_key(scope: Scope) -> str:
    """The key a request presents: a Bearer token (OpenAI's clients), else `x-api-key` (Anthropic's)."""
    headers: dict[bytes, bytes] = dict(scope.get("headers", ()))
    scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return headers.get(b"x-api-key", b"").decode("latin-1").strip()
