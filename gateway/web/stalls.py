"""Streams whose client stopped reading: a send that waits past `stream_write_timeout_s` drops the connection, so the
stream's permit and engine request are not held for ever. One periodic sweep serves all streams."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable

import structlog

log = structlog.get_logger(__name__)
SWEEP_S = 1.0
ABORT = "gateway.abort"  # the scope's extension: drop the connection (gateway.server.http)


class Sends:
    """One stream's sends: `since` is when the pending send began (0 between sends), so there is no deadline set and
    cancelled per event."""

    __slots__ = ("abort", "since", "stalled")

    def __init__(self, abort: Callable[[], None]) -> None:
        self.abort = abort  # the connection dropped, or else the stream's disconnect watch expired
        self.since = 0.0  # loop time when the send in progress began; 0: none in progress
        self.stalled = False


class Sweep:
    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        self.loop = loop
        self.timeout_s = timeout_s
        self.every = min(SWEEP_S, timeout_s / 4)
        self.streams: dict[Sends, None] = {}
        self.timer: asyncio.TimerHandle | None = None

    def add(self, sends: Sends) -> None:
        self.streams[sends] = None
        if self.timer is None:
            self.timer = self._later()

    def _later(self) -> asyncio.TimerHandle:
        # in an empty context: not that of the stream whose send set it (its log fields)
        return self.loop.call_later(self.every, self._sweep, context=contextvars.Context())

    def discard(self, sends: Sends) -> None:
        self.streams.pop(sends, None)

    def _sweep(self) -> None:
        self.timer = None
        now = self.loop.time()
        for sends in [s for s in self.streams if s.since and now - s.since >= self.timeout_s and not s.stalled]:
            log.warning("stream_stalled", waited_s=round(now - sends.since, 1), timeout_s=self.timeout_s)
            sends.stalled = True
            sends.abort()
        if self.streams:
            self.timer = self._later()


_sweep: Sweep | None = None  # the running loop's (one loop at a time: the server's)


def watch(timeout_s: float, abort: Callable[[], None]) -> tuple[Sends, Sweep]:
    global _sweep
    loop = asyncio.get_running_loop()
    if _sweep is None or _sweep.loop is not loop or _sweep.timeout_s != timeout_s:
        _sweep = Sweep(loop, timeout_s)  # another loop or setting (a test's); the old sweep ends with its streams
    sends = Sends(abort)
    _sweep.add(sends)
    return sends, _sweep
