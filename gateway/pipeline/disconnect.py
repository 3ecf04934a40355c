"""Noticing that a client went away, so that its engine request is aborted at once.

The work runs in the request's own task; a watcher task waits for the client's going (a `Gone`:
the api layer makes one of the server's receive channel, `api.requests.gone_of`) and,
if it comes first, cancels the request's task (which closes the engine's output iterator and so
aborts the engine request), and the cancellation comes out as `ClientDisconnected` (499). The
watcher starts `WATCH_AFTER_S` after the work: an answer ready sooner (a short completion, a cache
hit) pays no task and no wakeup for it, and a client that leaves before is noticed that much later.
Watches waiting for their start share one timer per event loop (`_Pending`), at the first one's
due time, instead of a timer set and cancelled per request.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable
from typing import TypeVar

from gateway.errors import ClientDisconnected
from gateway.pipeline.context import Gone
from gateway.telemetry.record import current_record

T = TypeVar("T")
WATCH_AFTER_S = 0.1


class _Pending:
    """The watches of one event loop that wait WATCH_AFTER_S for their start, in the order they
    are due (they all wait as long): one timer for all, at the first one's due time, which starts
    those due and sets itself again for the next. A watch stopped before (most answers come
    sooner) only leaves the queue."""

    __slots__ = ("loop", "watches", "timer")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.watches: dict[Watch, float] = {}  # each watch's due time, in the loop's clock
        self.timer: asyncio.TimerHandle | None = None

    def add(self, watch: Watch, after_s: float) -> None:
        due = self.loop.time() + after_s
        self.watches[watch] = due
        if self.timer is None:
            self.timer = self.loop.call_at(due, self._sweep)

    def discard(self, watch: Watch) -> None:
        self.watches.pop(watch, None)

    def _sweep(self) -> None:
        self.timer = None
        watches, now = self.watches, self.loop.time()
        while watches:
            watch, due = next(iter(watches.items()))
            if due > now:
                self.timer = self.loop.call_at(due, self._sweep)
                return
            del watches[watch]
            watch._start()


_pending: _Pending | None = None  # the running loop's (one loop at a time: the server's)


def _pending_for(loop: asyncio.AbstractEventLoop) -> _Pending:
    global _pending
    if _pending is None or _pending.loop is not loop:
        # another loop (a test's): a queue of its own; the previous one's timer still sweeps its watches
        _pending = _Pending(loop)
    return _pending


class Watch:
    """Cancels the current task when the client disconnects (watching from `after_s` on); `fired`
    says it did. `stop()` it when the work is over."""

    def __init__(self, gone: Gone, after_s: float = WATCH_AFTER_S) -> None:
        task = asyncio.current_task()
        assert task is not None, "a Watch watches the current task"
        self.task = task
        self.gone = gone
        self.fired = False
        self._acknowledged = False
        self._stopped = False
        self._watcher: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        loop = asyncio.get_running_loop()
        # the watcher runs in this request's context (its record: body.py notes the disconnect there),
        # as a callback of its own timer would
        self._context: contextvars.Context | None = None
        if after_s == WATCH_AFTER_S:  # the usual wait: in the loop's shared queue
            self._context = contextvars.copy_context()
            self._pending: _Pending | None = _pending_for(loop)
            self._pending.add(self, after_s)
        else:  # another wait would not keep the queue in due order: a timer of its own
            self._pending = None
            self._timer = loop.call_later(after_s, self._start)

    def _start(self) -> None:
        self._timer = None
        self._pending = None
        watching = self.gone()
        if self._context is None:  # in its own timer's callback: the request's context already
            self._watcher = asyncio.ensure_future(watching)
        else:
            self._watcher = self.task.get_loop().create_task(watching, context=self._context)
        self._watcher.add_done_callback(self._done)

    def _done(self, watcher: asyncio.Future[None]) -> None:
        if self._stopped or watcher.cancelled():
            return
        watcher.exception()  # retrieved: a failing receive counts as the client gone
        self.fired = True
        self.task.cancel()

    def disconnected(self) -> bool:
        """Whether a `CancelledError` the task caught was this watch's (then it is taken back)."""
        if not self.fired or self._acknowledged:
            return False
        self._acknowledged = True
        return self.task.uncancel() == 0

    def stop(self) -> None:
        self._stopped = True
        if self._pending is not None:
            self._pending.discard(self)
        if self._timer is not None:
            self._timer.cancel()
        if self._watcher is not None:
            self._watcher.cancel()
        if self.fired and not self._acknowledged:  # the work ended anyway: no stray cancellation left
            self._acknowledged = True
            self.task.uncancel()


async def unless_gone(gone: Gone | None, work: Awaitable[T]) -> T:
    """Await `work`; if the client goes first, cancel it (aborting its engine request) and raise.
    `gone` None: nobody to watch."""
    if gone is None:
        return await work
    watch = Watch(gone)
    try:
        return await work
    except asyncio.CancelledError:
        if not watch.disconnected():
            raise  # a cancellation from elsewhere (shutdown): not ours to turn into a 499
        current_record().disconnected = True
        raise ClientDisconnected() from None
    finally:
        watch.stop()
