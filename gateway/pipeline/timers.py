"""The one timer facility: deadlines on the running event loop, many of them behind one loop timer.

A request sets deadlines all the time (its disconnect watch's start, each body read's cut, the
stall sweep) and nearly all are cancelled long before they are due; a loop timer each
(`loop.call_at`) would be made and cancelled per request. `Timers` keeps them in a heap by due
time with one loop timer at the earliest; cancelling only marks a deadline (it leaves the heap
when it comes to the top, or in a compaction once most of the heap is cancelled). Due callbacks
run in an empty context (not the context of whichever request set the loop timer): a callback
that needs its request's context keeps it itself (`disconnect.Watch`).
"""

from __future__ import annotations

import asyncio
import contextvars
import heapq
from collections.abc import Callable

import structlog

log = structlog.get_logger(__name__)
COMPACT_AT = 64  # cancelled deadlines in the heap before a compaction may pay


class Timer:
    __slots__ = ("_timers", "callback", "cancelled", "when")

    def __init__(self, when: float, callback: Callable[[], None], timers: Timers) -> None:
        self.when = when
        self.callback = callback
        self.cancelled = False
        self._timers = timers

    def __lt__(self, other: Timer) -> bool:
        return self.when < other.when

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self._timers._cancelled(self)


class Timers:
    """One event loop's deadlines (`timers()` gives the running loop's)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._heap: list[Timer] = []
        self._dead = 0  # cancelled deadlines still in the heap
        self._handle: asyncio.TimerHandle | None = None
        self._handle_at = 0.0

    def __len__(self) -> int:
        """Deadlines set and neither due nor cancelled yet."""
        return len(self._heap) - self._dead

    def at(self, when: float, callback: Callable[[], None]) -> Timer:
        """`callback()` at `when` (the loop's clock) unless the returned timer is cancelled first."""
        timer = Timer(when, callback, self)
        heapq.heappush(self._heap, timer)
        if self._handle is None or when < self._handle_at:
            self._arm(when)
        return timer

    def later(self, delay_s: float, callback: Callable[[], None]) -> Timer:
        return self.at(self.loop.time() + delay_s, callback)

    def _arm(self, when: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._handle_at = when
        self._handle = self.loop.call_at(when, self._fire, context=contextvars.Context())

    def _cancelled(self, timer: Timer) -> None:
        self._dead += 1
        if self._dead >= COMPACT_AT and self._dead * 2 > len(self._heap):
            self._heap = [t for t in self._heap if not t.cancelled]
            heapq.heapify(self._heap)
            self._dead = 0

    def _fire(self) -> None:
        self._handle = None
        now = self.loop.time()
        while self._heap and (self._heap[0].cancelled or self._heap[0].when <= now):  # a callback may compact it
            timer = heapq.heappop(self._heap)
            if timer.cancelled:
                self._dead -= 1
                continue
            timer.cancelled = True  # done: a later cancel() changes nothing
            try:
                timer.callback()
            except Exception:
                log.exception("timer_callback_failed")
        if self._heap:
            self._arm(self._heap[0].when)


_current: Timers | None = None  # the running loop's (one loop at a time: the server's)


def timers() -> Timers:
    """The running loop's timers (made for a new loop: a test's, or a restarted server's)."""
    global _current
    loop = asyncio.get_running_loop()
    if _current is None or _current.loop is not loop:
        _current = Timers(loop)  # the previous loop's timers still fire in that loop, if it runs
    return _current
