"""Admission control: per model, a bound on engine requests running and on engine requests waiting.

A request takes as many permits as the engine runs requests for it (every choice of every prompt)
before its response starts, and holds them for the life of its answer; one that asks for more than
`max_running` can never run (400). Beyond that it waits, at most `wait_timeout_s`, and is refused with
429 (Retry-After) or 503 when the queue is full or the wait is over: errors the dispatcher may answer
with a fallback. Within a class the waiting are admitted in the order `fairness.order` says
(`tenancy.fairness`: the least served key's first, or arrival order); the request next in that order
is not overtaken when it does not fit yet (a large one holds up the rest, so it never starves).
A full class makes room for a key by refusing the newest waiters of the key that holds the most of it
(while it would still hold more): one key's flood does not shut the others out of the queue.

Priority classes (`tenancy.priority`) are admitted high, normal, low, each filling only its share of
`max_waiting` (`queue_share`), so low requests are refused first as the queue fills. With
`key_share`, one key holds at most that share of `max_running` while other keys wait (with nobody
else waiting it may use the whole model): a cap beneath the order.

How many run at once is the model's measured limit (`backends.capacity`: a gradient rule on the pace
of the engine's answers), `max_running` at most. A request carries a deadline (the client's timeout
headers, `web.requests.timeout_of`, else `deadline_s`): one whose deadline has passed never starts;
one whose expected wait (the requests the order admits before it, at the measured rate; a stream's
to its first token) would pass it, or
`wait_timeout_s`, is refused at once; a waiter leaves the queue when it passes. Every refusal's
Retry-After is the measured time to drain the queue, counted by reason in `gateway_rejected_total`.
A resumable stream whose client left keeps its permits only while nobody waits (`Permit.orphan`): a waiter's arrival
ends such orphaned generations, the oldest first, so that no capacity goes to an answer nobody may read.
A request for a model whose engine cannot serve is refused at once with 503 (`unhealthy`).
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine.types import Engine
from gateway.backends.capacity import Capacity
from gateway.errors import BackendUnavailable, InvalidRequest, ModelOverloaded, ModelUnavailable
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
    until: float = math.inf  # when it leaves the queue (its deadline, or the wait's bound)
    stream: bool = False  # answered at its first token: its expected wait runs to it


class Permit:
    def __init__(self, admission: Admission, count: int, key: str = "", served: Served | None = None,
                 gap_s: float | None = None) -> None:
        """`gap_s`: a stream's, the longest its client waits for a next token (`Capacity.finished`); None: a whole answer."""
        self.admission = admission
        self.gap_s = gap_s
        self._held = True  # until `release`
        self.count = count
        self.key = key
        self.served = served or Served()
        self.taken = admission.capacity.clock()  # (again when a waiter is admitted: its hold starts then)

    def refuse(self, reason: str, why: str) -> ModelOverloaded | ModelUnavailable:
        """A refusal of the request that holds it, as its model's admission refuses."""
        return self.admission.refuse(reason, why, self.count)

    def started(self) -> None:
        """A stream's first token: the measured capacity learns its time to it (`Capacity.started`)."""
        if self._held and self.gap_s is not None:
            self.admission.started(self.taken, self.gap_s)

    def orphan(self, stop: Callable[[], None]) -> None:
        """Its stream's client left: the generation goes on only for a reconnect (`web.sse`, within its grace).
        `stop` it at once when others wait for this model, else as soon as one comes."""
        if self.admission.waiting:
            stop()
        elif self._held:
            self.admission.orphans[self] = stop

    def release(self, tokens: int | None = None) -> None:
        """Given back; `tokens`: the output tokens of the answer it held for (None: no answer), which
        the model's measured capacity learns from."""
        self.admission.orphans.pop(self, None)
        if self._held:
            self._held = False
            self.admission.give_back(self.count, self.key, self.taken, tokens, self.served, self.gap_s)


class Admission:
    def __init__(self, model: str, settings: AdmissionSettings, engine: Engine | None = None) -> None:
        """`engine`: the embedded engine whose own report (its time per request, its batch) the measured
        capacity reads (`backends.capacity`); None: a remote model, measured by its permits alone."""
        self.model = model
        self.settings = settings
        self.running = 0  # engine requests admitted
        self.waiting = 0  # engine requests waiting
        self._queues: dict[Priority, deque[_Waiter]] = {klass: deque() for klass in _ORDER}
        self._held: dict[str, int] = {}  # engine requests admitted, per key
        self._queued: dict[str, int] = {}  # requests waiting, per key
        self.fairness = fairness.order(settings.fairness)  # who of a class goes first
        self.orphans: dict[Permit, Callable[[], None]] = {}  # streams nobody reads, kept for a reconnect: in order
        if engine is None:
            self.capacity = Capacity(settings.max_running, settings.adaptive)
        else:
            self.capacity = Capacity(settings.max_running, settings.adaptive, engine_s=lambda: engine.load().request_s,
                                     batch=engine.load().batch, first_token_s=lambda: engine.load().first_token_s)

    def admit_now(self, count: int = 1, key: str = "", served: Served | None = None,
                  deadline: float | None = None, gap_s: float | None = None) -> Permit | None:
        """The permits when `acquire` would take them at once (room, nobody ahead), without a
        coroutine to await; None otherwise (then `acquire` waits, refuses or says it never can).
        `served`: what the request is served (its prompt, its output as it comes), for the order;
        `deadline` (the event loop's clock) passed: refused, the work is not started; `gap_s`: a
        stream's, the longest its client waits between tokens (None: a whole answer)."""
        if deadline is not None and deadline <= asyncio.get_running_loop().time():
            raise self.refuse("deadline_passed", "the request's deadline passed before it could start", count)
        if self._fits(count) and not self._anyone_waiting() and count <= self.settings.max_running:
            permit = Permit(self, count, key, served, gap_s)
            self._take(count, key, permit.served)
            return permit
        return None

    def _fits(self, count: int) -> bool:
        """Room under the measured limit (a request larger than the limit runs alone)."""
        return self.running + count <= self.capacity.limit or self.running == 0

    async def acquire(self, count: int = 1, priority: Priority = "normal", key: str = "",
                      served: Served | None = None, deadline: float | None = None, gap_s: float | None = None) -> Permit:
        if count > self.settings.max_running:
            raise InvalidRequest(
                f"This request would run {count} engine requests at once (each choice of each prompt), "
                f"more than the model '{self.model}' ever admits ({self.settings.max_running}): "
                "lower n, best_of or the number of prompts",
                param="n",
            )
        permit = self.admit_now(count, key, served, deadline, gap_s)  # room, nobody ahead: taken at once, without suspending
        if permit is None:
            permit = Permit(self, count, key, served, gap_s)
            await self._wait(permit, priority, deadline)
            permit.taken = self.capacity.clock()  # its hold starts now, not when it began to wait
        return permit

    def _anyone_waiting(self) -> bool:
        queues = self._queues
        return bool(queues["high"] or queues["normal"] or queues["low"])

    async def _wait(self, permit: Permit, priority: Priority = "normal", deadline: float | None = None) -> None:
        count, key = permit.count, permit.key
        bound = self.settings.max_waiting * self.settings.queue_share.get(priority, 1.0)
        if self.waiting + count > bound and not self._make_room(priority, key, count, bound):
            raise self.refuse("queue_full", "too many requests are waiting for this model", count)
        now = asyncio.get_running_loop().time()
        bounded = now + self.settings.wait_timeout_s
        until = bounded if deadline is None else min(deadline, bounded)
        late, stream = until < bounded, permit.gap_s is not None  # the client's deadline comes before the wait's bound
        expected = self.capacity.expected_wait(self.waiting + count, stream)  # all of the queue ahead: the longest it can be
        if expected is not None and now + expected > until:  # then its place in the order (a pass over the queue)
            ahead = self._above(priority) + self.fairness.ahead(self._queues[priority], key) + count
            expected = self.capacity.expected_wait(ahead, stream)
        if expected is not None and now + expected > until:
            why = "its deadline" if late else "the wait allowed"
            raise self.refuse("expected_wait", f"the expected wait, {expected:.1f} s, is longer than {why}", count)
        waiter = _Waiter(count, key, asyncio.get_running_loop().create_future(), permit.served, until, stream)
        self._queues[priority].append(waiter)
        if key not in self._queued:  # (re)joins: no credit banked while away
            self.fairness.joined(key, self._queued, self._held)
        self._queued[key] = self._queued.get(key, 0) + 1
        self._waiting(count)
        self._wake()  # it may be next in the order (or those ahead passed over): then it runs at once
        self._give_way(waiter)
        try:
            async with asyncio.timeout_at(until):
                await waiter.future
        except TimeoutError:
            if not self._granted(waiter):
                self._leave(priority, waiter)
                if late:
                    raise self.refuse("deadline_passed", "the request's deadline passed while it waited", count) from None
                raise self.refuse("queue_timeout", "the request waited too long for this model", count) from None
            # admitted at the deadline: the permits are ours, keep them
        except BaseException:
            if self._granted(waiter):  # admitted, then cancelled (the client left) before it ran
                self.give_back(count, key, served=permit.served)
            else:
                self._leave(priority, waiter)
            raise

    def _give_way(self, waiter: _Waiter) -> None:
        """For a waiter not admitted at once: orphaned generations (`Permit.orphan`), the oldest first, stopped
        until they free its permits."""
        count = 0 if waiter.future.done() else waiter.count
        while count > 0 and self.orphans:
            permit = next(iter(self.orphans))
            count -= permit.count
            self.orphans.pop(permit)()

    @staticmethod
    def _granted(waiter: _Waiter) -> bool:
        return waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None

    def _waiting(self, change: int) -> None:
        self.waiting += change
        metrics.labelled(metrics.WAITING, self.model).set(self.waiting)

    def _take(self, count: int, key: str, served: Served) -> None:
        self.running += count
        self._held[key] = self._held.get(key, 0) + count
        self.fairness.admitted(key, served, self._queued)

    def _dequeued(self, queue: deque[_Waiter], waiter: _Waiter) -> bool:
        try:
            queue.remove(waiter)
        except ValueError:
            return False  # already taken off (granted, or passed by `_wake` once it gave up)
        self._waiting(-waiter.count)
        left = self._queued[waiter.key] - 1
        if left:
            self._queued[waiter.key] = left
        else:
            del self._queued[waiter.key]
        return True

    def _make_room(self, priority: Priority, key: str, count: int, bound: float) -> bool:
        """Room in a full class for `count` of `key`: the newest waiters of the key holding the most of it give
        up their places (refused, queue_full) while that key would still hold more than `key`; False (nobody
        refused) when that leaves no room: a flood does not shut the other keys out of the queue."""
        queue, held = [waiter for waiter in self._queues[priority] if not waiter.future.done()], dict[str, int]()
        for waiter in queue:  # (one refused already is leaving: not a place to take)
            held[waiter.key] = held.get(waiter.key, 0) + waiter.count
        own, freed, leaving = held.pop(key, 0) + count, 0, list[_Waiter]()
        for waiter in reversed(queue):
            if self.waiting - freed + count <= bound:
                break
            most = max(held.values(), default=0)
            if waiter.key != key and held.get(waiter.key) == most and most - waiter.count >= own:
                held[waiter.key] -= waiter.count
                freed += waiter.count
                leaving.append(waiter)
        if self.waiting - freed + count > bound:
            return False
        for waiter in leaving:
            self._dequeued(self._queues[priority], waiter)
            waiter.future.set_exception(self.refuse("queue_full", "the queue is full and this key holds the most of it", waiter.count))
        return True

    def _leave(self, priority: Priority, waiter: _Waiter) -> None:
        self._dequeued(self._queues[priority], waiter)
        self._wake()  # it may have held up smaller requests behind it

    def _refuse_late(self) -> None:
        """Waiters whose expected wait, measured anew, passes when they would leave: refused now, not
        then (a flood met before anything was measured learns it while it waits)."""
        now = asyncio.get_running_loop().time()
        for klass in _ORDER:
            above, queue = self._above(klass), self._queues[klass]
            for waiter, ahead in zip(queue, self.fairness.each_ahead(queue), strict=True):
                expected = self.capacity.expected_wait(above + ahead + waiter.count, waiter.stream)
                if waiter.future.done() or expected is None or now + expected <= waiter.until:
                    continue
                why = f"the expected wait, {expected:.1f} s, is longer than it may wait"
                waiter.future.set_exception(self.refuse("expected_wait", why, waiter.count))  # it leaves (`_wait`)

    def _above(self, priority: Priority) -> int:
        """Engine requests waiting in the classes admitted before this one."""
        above = 0
        for klass in _ORDER:
            if klass == priority:
                return above
            above += sum(waiter.count for waiter in self._queues[klass])
        return above

    def give_back(self, count: int, key: str = "", taken: float | None = None, tokens: int | None = None,
                  served: Served | None = None, gap_s: float | None = None) -> None:
        """Permits a `Permit` held since `taken`, returned (`Permit.release`), with the output tokens
        of its answer (None: none) and a stream's gap bound for the measured capacity, and what it
        was served for the order."""
        if taken is not None and self.capacity.finished(self.capacity.clock() - taken, tokens, self.running, gap_s):
            self._moved()
        self.running -= count
        left = self._held.get(key, 0) - count
        if left > 0:
            self._held[key] = left
        else:
            self._held.pop(key, None)
        if served is not None:
            self.fairness.finished(key, served)
        self._wake()

    def started(self, taken: float, gap_s: float) -> None:
        """A stream's first token, its permit held since `taken` (`Permit.started`): a raised limit admits more now."""
        if self.capacity.started(self.capacity.clock() - taken, self.running, gap_s):
            self._moved()
            self._wake()

    def _moved(self) -> None:
        """The limit moved (a window closed): its gauge, and the waiters its expected wait now refuses."""
        metrics.labelled(metrics.ADMISSION_LIMIT, self.model).set(self.capacity.limit)
        self._refuse_late()

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
            if not self._fits(waiter.count):
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

    def refuse(self, reason: str, why: str, count: int = 1) -> ModelOverloaded | ModelUnavailable:
        """A refusal counted by `reason`, its Retry-After the measured time to drain the queue."""
        metrics.labelled(metrics.REJECTED, self.model, reason).inc()
        message = f"The model '{self.model}' is overloaded: {why}. Please retry later."
        headers = {"Retry-After": str(self.capacity.retry_after(self.waiting + count, self.settings.retry_after_s))}
        if self.settings.reject_status == 503:
            return ModelUnavailable(message, headers=headers)
        return ModelOverloaded(message, headers=headers)

    def unhealthy(self, name: str) -> BackendUnavailable:
        """The refusal of a request for `name` (this admission's model, or an adapter sharing it) while
        its engine cannot serve (`Backend.healthy`): 503 at once, counted as `engine_unhealthy`,
        Retry-After the least (no measure says when another replica, or this one restarted, will
        answer); a fallback may answer it."""
        metrics.labelled(metrics.REJECTED, self.model, "engine_unhealthy").inc()
        message = f"The model '{name}' is unavailable: its engine is not running. Please retry later."
        return BackendUnavailable(message, headers={"Retry-After": str(self.capacity.retry_after(0, self.settings.retry_after_s))})
