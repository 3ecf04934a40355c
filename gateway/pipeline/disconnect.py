"""Noticing that a client went away, so that its engine request is aborted at once.

The work runs in the request's own task; a watcher task waits for the client's going (a `Gone`:
the api layer makes one of the server's receive channel, `api.requests.gone_of`) and,
if it comes first, cancels the request's task (which closes the engine's output iterator and so
aborts the engine request), and the cancellation comes out as `ClientDisconnected` (499). The
watcher starts `WATCH_AFTER_S` after the work: an answer ready sooner (a short completion, a cache
hit) pays no task and no wakeup for it, and a client that leaves before is noticed that much later.
The start is a deadline of the loop's one timer facility (`pipeline.timers`), not a loop timer
set and cancelled per request.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable
from typing import TypeVar

from gateway.errors import ClientDisconnected
from gateway.pipeline.context import Gone
from gateway.pipeline.timers import Timer, timers
from gateway.telemetry.record import current_record

T = TypeVar("T")
WATCH_AFTER_S = 0.1


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
        # the watcher runs in this request's context (its record: body.py notes the disconnect there)
        self._context = contextvars.copy_context()
        self._timer: Timer | None = timers().later(after_s, self._start)

    def _start(self) -> None:
        self._timer = None
        self._watcher = self.task.get_loop().create_task(self.gone(), context=self._context)
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
