"""Token buckets and OpenAI's reset duration format, as the per-key limits count in process."""

from __future__ import annotations

import time


def duration(seconds: float) -> str:
    """OpenAI's reset format: 1s, 6m0s, 20ms."""
    if seconds < 1:
        return f"{max(1, round(seconds * 1000))}ms"
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


class TokenBucket:
    """Full at the start, refilled at `capacity` a minute."""

    __slots__ = ("capacity", "tokens", "updated")

    def __init__(self, capacity: float) -> None:
        self.capacity = self.tokens = capacity
        self.updated = time.monotonic()

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

    def wait_for(self, amount: float) -> float:
        self._refill(time.monotonic())
        return max(0.0, (amount - self.tokens) * 60.0 / self.capacity)
