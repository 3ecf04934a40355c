"""Admission control: per model, a bound on engine requests running and on engine requests waiting.

A request takes as many permits as the engine runs requests for it (every choice of every prompt)
before its response starts, and holds them for the life of its answer; one that asks for more than
`max_running` can never run (400). Beyond that it waits, at most `wait_timeout_s`, and is refused with
429 (Retry-After) or 503 when the queue is full or the wait is over: errors the dispatcher may answer
with a fallback. Within a class the waiting are admitted in the order `fairness.order` says
(`tenancy.fairness`: the least served key's first, or arrival order); the request next in that order
is not overtaken when it does not fit yet (a large one holds up the rest, so it never starves).

Priority classes (`tenancy.priority`) are admitted high, normal, low, each filling only its share of
`max_waiting` (`queue_share`), so low requests are refused first as the queue fills. With
`key_share`, one key holds at most that share of `max_running` while other keys wait (with nobody
else waiting it may use the whole model): a cap beneath the order.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from gateway.errors import InvalidRequest, ModelOverloaded, ModelUnavailable
from gateway.settings import AdmissionSettings, Priority
from gateway.telemetry import metrics
from gateway.tenancy import fairness
from gateway.tenancy.fairness import Served

_ORDER: tuple[Priority, ...] = ("high", "normal", "low")


@dataclass(eq=False, slots=True)
class _Waiter:
    count: int
    key: str
    future: asyncio.Future[None]
    served: Served


class Permit:
    def __init__(self, admission: Admission, count: int, key: str = "", served: Served | None = None) -> None:
        self._admission: Admission | None = admission
        self.count = count
        self.key = key
        self.served = served or Served()

    def release(self) -> None:
        if self._admission is not None:
            self._admission.give_back(self.count, self.key, self.served)
            self._admission = None


class Admission:
    def __init__(self, model: str, settings: AdmissionSettings) -> None:
        self.model = model
        self.settings = settings
        self.running = 0  # engine requests admitted
        self.waiting = 0  # engine requests waiting
        self._queues: dict[Priority, deque[_Waiter]] = {klass: deque() for klass in _ORDER}
        self._held: dict[str, int] = {}  # engine requests admitted, per key
        self._queued: dict[str, int] = {}  # requests waiting, per key
        self.fairness = fairness.order(settings.fairness)  # who of a class goes first

    def admit_now(self, count: int = 1, key: str = "", served: Served | None = None) -> Permit | None:
        """The permits when `acquire` would take them at once (room, nobody ahead), without a
        coroutine to await; None otherwise (then `acquire` waits, refuses or says it never can).
        `served`: what the request is served (its prompt, its output as it comes), for the order."""
        if self.running + count <= self.settings.max_running and not self._anyone_waiting():
            permit = Permit(self, count, key, served)
            self._take(count, key, permit.served)  # count > max_running never fits
            return permit
        return None

    async def acquire(
        self, count: int = 1, priority: Priority = "normal", key: str = "", served: Served | None = None
    ) -> Permit:
        if count > self.settings.max_running:
            raise InvalidRequest(
                f"This request would run {count} engine requests at once (each choice of each prompt), "
                f"more than the model '{self.model}' ever admits ({self.settings.max_running}): "
                "lower n, best_of or the number of prompts",
                param="n",
            )
        permit = self.admit_now(count, key, served)  # room, and nobody ahead: taken at once, without suspending
        if permit is None:
            permit = Permit(self, count, key, served)
            await self._wait(permit, priority)
        return permit

    def _anyone_waiting(self) -> bool:
        queues = self._queues
        return bool(queues["high"] or queues["normal"] or queues["low"])

    async def _wait(self, permit: Permit, priority: Priority = "normal") -> None:
        count, key = permit.count, permit.key
        if self.waiting + count > self.settings.max_waiting * self.settings.queue_share.get(priority, 1.0):
            raise self._refuse("queue_full", "too many requests are waiting for this model")
        waiter = _Waiter(count, key, asyncio.get_running_loop().create_future(), permit.served)
        self._queues[priority].append(waiter)
        if key not in self._queued:  # (re)joins: no credit banked while away
            self.fairness.joined(key, self._queued, self._held)
        self._queued[key] = self._queued.get(key, 0) + 1
        self._waiting(count)
        self._wake()  # it may be next in the order (or those ahead passed over): then it runs at once
        try:
            async with asyncio.timeout(self.settings.wait_timeout_s):
                await waiter.future
        except TimeoutError:
            if not self._granted(waiter):
                self._leave(priority, waiter)
                raise self._refuse("queue_timeout", "the request waited too long for this model") from None
            # admitted at the deadline: the permits are ours, keep them
        except BaseException:
            if self._granted(waiter):
                permit.release()  # admitted, then cancelled (the client left) before it ran
            else:
                self._leave(priority, waiter)
            raise
        finally:
            self._waiting(-count)

    @staticmethod
    def _granted(waiter: _Waiter) -> bool:
        return waiter.future.done() and not waiter.future.cancelled()

    def _waiting(self, change: int) -> None:
        self.waiting += change
        metrics.labelled(metrics.WAITING, self.model).set(self.waiting)

    def _take(self, count: int, key: str, served: Served) -> None:
        self.running += count
        self._held[key] = self._held.get(key, 0) + count
        self.fairness.admitted(key, served)

    def _dequeued(self, queue: deque[_Waiter], waiter: _Waiter) -> bool:
        try:
            queue.remove(waiter)
        except ValueError:
            return False  # already taken off (granted, or passed by `_wake` once it gave up)
        left = self._queued[waiter.key] - 1
        if left:
            self._queued[waiter.key] = left
        else:
            del self._queued[waiter.key]
        return True

    def _leave(self, priority: Priority, waiter: _Waiter) -> None:
        self._dequeued(self._queues[priority], waiter)
        self._wake()  # it may have held up smaller requests behind it

    def give_back(self, count: int, key: str = "", served: Served | None = None) -> None:
        """Permits a `Permit` held, returned (`Permit.release`)."""
        self.running -= count
        left = self._held.get(key, 0) - count
        if left > 0:
            self._held[key] = left
        else:
            self._held.pop(key, None)
        if served is not None:
            self.fairness.finished(key, served)
        self._wake()

    def _wake(self) -> None:
        """Admit waiting requests, high class first, each class in its order while they fit (the
        request next in order is not overtaken: it holds up the rest, lower classes too)."""
        share = self.settings.key_share
        limit = None if share is None else max(1, int(share * self.settings.max_running))
        for klass in _ORDER:
            if not self._wake_class(self._queues[klass], limit):
                return

    def _wake_class(self, queue: deque[_Waiter], limit: int | None) -> bool:
        """False when the waiter next in order does not fit (nothing after it may go first)."""
        passed: set[str] = set()  # keys at their share (key_share): passed over
        while (waiter := self.fairness.pick(queue, passed, len(self._queued))) is not None:
            if waiter.future.done():  # its waiter gave up (timeout or cancel) and will leave
                self._dequeued(queue, waiter)
                continue
            if limit is not None and self._over_share(waiter, limit):
                passed.add(waiter.key)
                continue
            if self.running + waiter.count > self.settings.max_running:
                return False
            self._dequeued(queue, waiter)
            self._take(waiter.count, waiter.key, waiter.served)
            waiter.future.set_result(None)
        return True

    def _over_share(self, waiter: _Waiter, limit: int) -> bool:
        """Its key would pass its share while another key waits: it is passed over."""
        if self._held.get(waiter.key, 0) + waiter.count <= limit:
            return False
        return len(self._queued) > 1 or waiter.key not in self._queued

    def _refuse(self, reason: str, why: str) -> ModelOverloaded | ModelUnavailable:
        metrics.labelled(metrics.REJECTED, self.model, reason).inc()
        message = f"The model '{self.model}' is overloaded: {why}. Please retry later."
        headers = {"Retry-After": str(self.settings.retry_after_s)}
        if self.settings.reject_status == 503:
            return ModelUnavailable(message, headers=headers)
        return ModelOverloaded(message, headers=headers)
