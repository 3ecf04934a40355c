"""Admission control: per model, a bound on engine requests running and on engine requests waiting.

A request counts as many engine requests as the engine runs for it (every choice of every prompt:
a completions request of 100 prompts with n=4 is 400), takes that many permits before its
response starts, and holds them for the life of its answer (the whole stream). A request that
asks for more than `max_running` at once can never run: it is a 400. Beyond `max_running` a
request waits, in arrival order (a large request at the head is not overtaken), for at most
`wait_timeout_s`; when `max_waiting` would be passed, or after the wait, it is refused at once
with 429 (and Retry-After) or 503, as configured: errors the dispatcher may answer with a fallback.

Priority classes (the keys file's `priority`): each may fill only its share of `max_waiting`
(`queue_share`, by default low half of it, normal and high all of it), so as the queue fills, low
requests are refused first, and a lower share for normal holds room for high.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

from gateway.errors import InvalidRequest, ModelOverloaded, ModelUnavailable
from gateway.settings import AdmissionSettings, Priority
from gateway.telemetry import metrics


class Permit:
    def __init__(self, admission: Admission, count: int) -> None:
        self._admission: Admission | None = admission
        self.count = count

    def release(self) -> None:
        if self._admission is not None:
            self._admission._release(self.count)
            self._admission = None


class Admission:
    def __init__(self, model: str, settings: AdmissionSettings) -> None:
        self.model = model
        self.settings = settings
        self.running = 0  # engine requests admitted
        self.waiting = 0  # engine requests waiting
        self._queue: deque[tuple[int, asyncio.Future[None]]] = deque()

    def admit_now(self, count: int = 1) -> Permit | None:
        """The permits when `acquire` would take them at once (room, nobody ahead), without a
        coroutine to await; None otherwise (then `acquire` waits, refuses or says it never can)."""
        if not self._queue and self.running + count <= self.settings.max_running:  # count > max_running never fits
            self.running += count
            return Permit(self, count)
        return None

    async def acquire(self, count: int = 1, priority: Priority = "normal") -> Permit:
        if count > self.settings.max_running:
            raise InvalidRequest(
                f"This request would run {count} engine requests at once (each choice of each prompt), "
                f"more than the model '{self.model}' ever admits ({self.settings.max_running}): "
                "lower n, best_of or the number of prompts",
                param="n",
            )
        permit = self.admit_now(count)  # room, and nobody ahead: taken at once, without suspending
        if permit is None:
            await self._wait(count, priority)
            permit = Permit(self, count)
        return permit

    async def _wait(self, count: int, priority: Priority = "normal") -> None:
        if self.waiting + count > self.settings.max_waiting * self.settings.queue_share.get(priority, 1.0):
            raise self._refuse("queue_full", "too many requests are waiting for this model")
        entry = (count, asyncio.get_running_loop().create_future())
        self._queue.append(entry)
        self._waiting(count)
        try:
            async with asyncio.timeout(self.settings.wait_timeout_s):
                await entry[1]
        except TimeoutError:
            if not self._granted(entry):
                self._leave(entry)
                raise self._refuse("queue_timeout", "the request waited too long for this model") from None
            # admitted at the deadline: the permits are ours, keep them
        except BaseException:
            if self._granted(entry):
                self._release(count)  # admitted, then cancelled (the client left) before it ran
            else:
                self._leave(entry)
            raise
        finally:
            self._waiting(-count)

    @staticmethod
    def _granted(entry: tuple[int, asyncio.Future[None]]) -> bool:
        return entry[1].done() and not entry[1].cancelled()

    def _waiting(self, change: int) -> None:
        self.waiting += change
        metrics.labelled(metrics.WAITING, self.model).set(self.waiting)

    def _leave(self, entry: tuple[int, asyncio.Future[None]]) -> None:
        with contextlib.suppress(ValueError):
            self._queue.remove(entry)
        self._wake()  # it may have held up smaller requests behind it

    def _release(self, count: int) -> None:
        self.running -= count
        self._wake()

    def _wake(self) -> None:
        """Admit waiting requests from the head of the queue while they fit."""
        while self._queue:
            count, future = self._queue[0]
            if future.done():  # its waiter gave up (timeout or cancel) and will leave
                self._queue.popleft()
                continue
            if self.running + count > self.settings.max_running:
                return
            self._queue.popleft()
            self.running += count
            future.set_result(None)

    def _refuse(self, reason: str, why: str) -> ModelOverloaded | ModelUnavailable:
        metrics.labelled(metrics.REJECTED, self.model, reason).inc()
        message = f"The model '{self.model}' is overloaded: {why}. Please retry later."
        headers = {"Retry-After": str(self.settings.retry_after_s)}
        if self.settings.reject_status == 503:
            return ModelUnavailable(message, headers=headers)
        return ModelOverloaded(message, headers=headers)
