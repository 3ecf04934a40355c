"""API keys and per-key rate limits.

Keys come from settings and are kept only as SHA-256 hashes; a presented key is hashed and compared
with every stored hash in constant time. Each key (or, without keys, everyone together) has two
token buckets: requests per minute and tokens per minute (prompt plus the requested output budget,
counted up front as OpenAI does). Responses carry OpenAI's x-ratelimit-* headers.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from pydantic import SecretStr
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway import metrics
from gateway.errors import APIError, AuthenticationFailed, RateLimited, send_error
from gateway.lifecycle import OPS_ROUTES
from gateway.logs import current_record

ANONYMOUS = "anonymous"
OPEN_ROUTES = frozenset({"/openapi.json"})


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


def _duration(seconds: float) -> str:
    """OpenAI's reset format: 1s, 6m0s, 20ms."""
    if seconds < 1:
        return f"{max(1, round(seconds * 1000))}ms"
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


@dataclass(slots=True)
class TokenBucket:
    capacity: float
    tokens: float = field(init=False)
    updated: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.tokens = self.capacity

    def _refill(self, now: float) -> None:
        self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.capacity / 60.0)
        self.updated = now

    def take(self, amount: float) -> bool:
        now = time.monotonic()
        self._refill(now)
        if amount > self.tokens:
            return False
        self.tokens -= amount
        return True

    def reset_after(self) -> float:
        """Seconds until the bucket is full again."""
        return (self.capacity - self.tokens) * 60.0 / self.capacity

    def wait_for(self, amount: float) -> float:
        return max(0.0, (amount - self.tokens) * 60.0 / self.capacity)


class RateLimiter:
    def __init__(self, rpm: int | None, tpm: int | None) -> None:
        self.rpm, self.tpm = rpm, tpm
        self._requests: dict[str, TokenBucket] = {}
        self._tokens: dict[str, TokenBucket] = {}

    def take_request(self, key: str) -> None:
        if self.rpm is not None:
            self._take(self._requests, key, self.rpm, 1, "requests")

    def take_tokens(self, key: str, amount: int) -> None:
        if self.tpm is not None:
            self._take(self._tokens, key, self.tpm, amount, "tokens")

    def _take(self, buckets: dict[str, TokenBucket], key: str, limit: int, amount: float, kind: str) -> None:
        bucket = buckets.get(key)
        if bucket is None:
            bucket = buckets[key] = TokenBucket(float(limit))
        allowed = bucket.take(amount)
        headers = current_record().response_headers
        headers[f"x-ratelimit-limit-{kind}"] = str(limit)
        headers[f"x-ratelimit-remaining-{kind}"] = str(int(bucket.tokens))
        headers[f"x-ratelimit-reset-{kind}"] = _duration(bucket.reset_after())
        if not allowed:
            metrics.RATE_LIMITED.labels(kind).inc()
            wait = bucket.wait_for(amount) if amount <= limit else 60.0
            headers["retry-after"] = str(max(1, round(wait)))
            raise RateLimited(
                f"Rate limit reached for {kind} per minute: limit {limit}, asked {int(amount)}. "
                f"Please try again in {_duration(wait)}.",
            )


class AuthMiddleware:
    """Bearer API keys on every API route, then the per-key request limit (pure ASGI)."""

    def __init__(self, app: ASGIApp, keys: KeyRing, limiter: RateLimiter, protect_ops: bool) -> None:
        self.app = app
        self.keys = keys
        self.limiter = limiter
        self.open = OPEN_ROUTES if protect_ops else OPEN_ROUTES | OPS_ROUTES

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open:
            await self.app(scope, receive, send)
            return
        try:
            key_id = self._identify(scope)
            current_record().api_key_id = key_id
            self.limiter.take_request(key_id)
        except APIError as error:
            await send_error(send, error)
            return
        scope.setdefault("state", {})["api_key_id"] = key_id
        await self.app(scope, receive, send)

    def _identify(self, scope: Scope) -> str:
        if not self.keys.enabled:
            return ANONYMOUS
        header = dict(scope.get("headers", ())).get(b"authorization", b"").decode("latin-1")
        scheme, _, presented = header.partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            raise AuthenticationFailed(
                "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'."
            )
        key_id = self.keys.identify(presented.strip())
        if key_id is None:
            raise AuthenticationFailed("Incorrect API key provided.")
        return key_id
