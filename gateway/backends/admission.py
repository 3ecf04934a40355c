"""Admission control: per model, a bound on requests generating and on requests waiting.

A request takes a permit before its response starts and holds it for the life of its answer (the
whole stream). Beyond `max_running` it waits, in arrival order, for at most `wait_timeout_s`;
beyond `max_waiting` waiting requests, or after the wait, it is refused at once with 429 (and
Retry-After) or 503, as configured: errors the dispatcher may answer with a fallback.

Priority classes (the keys file's `priority`): each may fill only its share of `max_waiting`
(`queue_share`, by default low half of it, normal and high all of it), so as the queue fills, low
requests are refused first, and a lower share for normal holds room for high.
"""

from __future__ import annotations

import asyncio

from gateway import metrics
from gateway.errors import ModelOverloaded, ModelUnavailable
from gateway.settings import AdmissionSettings, Priority


class Permit:
    def __init__(self, admission: Admission) -> None:
        self._admission: Admission | None = admission

    def release(self) -> None:
        if self._admission is not None:
            self._admission._release()
            self._admission = None


class Admission:
    def __init__(self, model: str, settings: AdmissionSettings) -> None:
        self.model = model
        self.settings = settings
        self._slots = asyncio.Semaphore(settings.max_running)
        self.running = 0
        self.waiting = 0

    async def acquire(self, priority: Priority = "normal") -> Permit:
        if self._slots.locked():
            await self._wait(priority)
        else:
            await self._slots.acquire()  # a free slot: taken at once, without suspending
        self.running += 1
        return Permit(self)

    async def _wait(self, priority: Priority) -> None:
        if self.waiting >= self.settings.max_waiting * self.settings.queue_share.get(priority, 1.0):
            raise self._refuse("queue_full", "too many requests are waiting for this model")
        self.waiting += 1
        metrics.WAITING.labels(self.model).set(self.waiting)
        try:
            # asyncio.timeout, not wait_for: no extra task, so a slot won at the deadline is not lost
            async with asyncio.timeout(self.settings.wait_timeout_s):
                await self._slots.acquire()
        except TimeoutError:
            raise self._refuse("queue_timeout", "the request waited too long for this model") from None
        finally:
            self.waiting -= 1
            metrics.WAITING.labels(self.model).set(self.waiting)

    def _release(self) -> None:
        self.running -= 1
        self._slots.release()

    def _refuse(self, reason: str, why: str) -> ModelOverloaded | ModelUnavailable:
        metrics.REJECTED.labels(self.model, reason).inc()
        message = f"The model '{self.model}' is overloaded: {why}. Please retry later."
        headers = {"Retry-After": str(self.settings.retry_after_s)}
        if self.settings.reject_status == 503:
            return ModelUnavailable(message, headers=headers)
        return ModelOverloaded(message, headers=headers)
