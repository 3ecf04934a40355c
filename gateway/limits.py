"""Per-key rate limits: token buckets for requests per minute and tokens per minute.

Each API key (or, without keys, everyone together) has two buckets: requests per minute (taken by
`middleware.rate_limit` before the route runs) and tokens per minute (prompt plus the requested
output budget, counted up front as OpenAI does, taken by the dispatcher once the prompt is known).
Every check adds OpenAI's x-ratelimit-* headers to the response; a refusal also `Retry-After`.
A request that asks for more than a whole minute's budget can never fit: it is refused once, with
a 400 and no `Retry-After` (a 429 would have clients retry it for ever).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from gateway import metrics
from gateway.context import current_record
from gateway.errors import OverTokenLimit, RateLimited


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
        """Seconds until `amount` can be taken."""
        self._refill(time.monotonic())
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
        if amount > limit:
            metrics.RATE_LIMITED.labels(kind).inc()
            raise OverTokenLimit(
                f"This request asks for {int(amount)} {kind} (the prompt and max_tokens for every choice), "
                f"more than the limit of {limit} {kind} per minute allows: reduce the prompt, max_tokens or n.",
                param="max_tokens",
            )
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
            wait = bucket.wait_for(amount)
            headers["retry-after"] = str(max(1, round(wait)))
            raise RateLimited(
                f"Rate limit reached for {kind} per minute: limit {limit}, asked {int(amount)}. "
                f"Please try again in {_duration(wait)}.",
            )
