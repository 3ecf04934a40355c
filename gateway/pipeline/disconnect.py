"""Noticing that a client went away, so that its engine request is aborted at once.

The work runs in the request's own task, inside a `Watch`: a watcher task waits for the client's
going (a `Gone`: the api layer makes one of the server's receive channel, `api.requests.gone_of`)
and, if it comes first, the watch's `asyncio.timeout` is made due at once: the request's task is
cancelled (which closes the engine's output iterator and so aborts the engine request) and the
cancellation comes out of the watch as `ClientDisconnected` (499), while a cancellation from
elsewhere (a shutdown) stays one. The watcher starts `WATCH_AFTER_S` after the work (a loop
timer): an answer ready sooner (a short completion, a cache hit) pays no task and no wakeup for it,
and a client that leaves before is noticed that much later. A resumable stream's watch has a grace: its client's
going ends the work only that much later (`left` says it went), so that a client that reconnects reads the rest; the
grace ends at `grace_until` at the latest (the request's deadline), and `on_left` is told when it begins, with `stop`,
which ends it at once (its model's capacity is wanted: `backends.admission.Permit.orphan`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import TypeVar

from gateway.errors import ClientDisconnected
from gateway.pipeline.context import Gone
from gateway.telemetry.record import current_record

T = TypeVar("T")
WATCH_AFTER_S = 0.1


class Watch:
    """`async with Watch(gone):` the work, cancelled when the client disconnects (watched from
    `after_s` on) or when `expire()` is called, `grace_s` later; then the block raises `ClientDisconnected`. At
    `deadline` (the event loop's clock) it is cancelled too, and raises `TimeoutError`."""

    def __init__(
        self, gone: Gone, after_s: float = WATCH_AFTER_S, deadline: float | None = None, grace_s: float = 0.0,
        grace_until: float | None = None, on_left: Callable[[Callable[[], None]], None] | None = None,
    ) -> None:
        self.gone = gone
        self.after_s = after_s
        self.grace_s = grace_s
        self.grace_until = grace_until
        self.on_left = on_left
        self._timeout = asyncio.timeout_at(deadline)
        self._left = False  # the client went (or `expire()` said so), rather than the deadline passing
        self._open = False
        self._starting: asyncio.TimerHandle | None = None
        self.watcher: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Watch:
        await self._timeout.__aenter__()
        self._open = True
        # the watcher runs in this request's context (a loop timer's callback keeps it): body.py
        # notes the disconnect in the request's record there
        self._starting = asyncio.get_running_loop().call_later(self.after_s, self._start)
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        traceback: TracebackType | None) -> None:
        self._open = False
        if self._starting is not None:
            self._starting.cancel()
        if self.watcher is not None:
            self.watcher.cancel()
        try:
            await self._timeout.__aexit__(kind, error, traceback)
        except TimeoutError:
            if not self._left:
                raise  # the deadline passed
            current_record().disconnected = True
            raise ClientDisconnected() from None

    def _start(self) -> None:
        self._starting = None
        self.watcher = asyncio.get_running_loop().create_task(self.gone())
        self.watcher.add_done_callback(self._done)

    def _done(self, watcher: asyncio.Future[None]) -> None:
        if not self._open or watcher.cancelled():
            return
        watcher.exception()  # retrieved: a failing receive counts as the client gone
        self.expire()

    @property
    def left(self) -> bool:
        """The client went (or `expire()` said so): within its grace, the work goes on for nobody."""
        return self._left

    def expire(self) -> None:
        """End the work as if the client had gone (a stream whose client stopped reading), after the grace."""
        if self._open and not self._left and not self._timeout.expired():
            self._left = True
            ends = asyncio.get_running_loop().time() + self.grace_s
            if self.grace_until is not None:
                ends = min(ends, self.grace_until)
            self._timeout.reschedule(min(ends, self._timeout.when() or ends))
            if self.on_left is not None and self.grace_s:
                self.on_left(self.stop)

    def stop(self) -> None:
        """End a grace now: the work its client left goes (a no-op once the work is over)."""
        if self._open and self._left and not self._timeout.expired():
            self._timeout.reschedule(asyncio.get_running_loop().time())


async def unless_gone(gone: Gone | None, work: Awaitable[T], deadline: float | None = None) -> T:
    """Await `work`; if the client goes first, cancel it (aborting its engine request) and raise
    `ClientDisconnected`; if `deadline` passes first, the same, raising `TimeoutError`. `gone`
    None: nobody to watch."""
    if gone is None:
        async with asyncio.timeout_at(deadline):  # (None: no bound)
            return await work
    async with Watch(gone, deadline=deadline):
        return await work
