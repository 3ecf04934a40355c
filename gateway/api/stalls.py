"""Streams whose client stopped reading: a send that waits past `stream_write_timeout_s` drops the connection, so the
stream's permit and engine request are not held for ever. One periodic sweep serves all streams."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from gateway.pipeline.timers import Timer, timers

log = structlog.get_logger(__name__)
SWEEP_S = 1.0
ABORT = "gateway.abort"  # the scope's extension: drop the connection (gateway.server.http)


class Sends:
    """One stream's sends: `since` is when the pending send began (0 between sends), so there is no deadline set and
    cancelled per event."""

    __slots__ = ("abort", "since", "stalled", "task")

    def __init__(self, task: asyncio.Task[object], abort: Callable[[], None] | None) -> None:
        self.task = task
        self.abort = abort
        self.since = 0.0  # loop time when the send in progress began; 0: none in progress
        self.stalled = False

    def stall(self) -> None:
        self.stalled = True
        if self.abort is not None:
            self.abort()  # the disconnect watch takes it from here
        else:
            self.task.cancel()


class Sweep:
    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        self.loop = loop
        self.timeout_s = timeout_s
        self.every = min(SWEEP_S, timeout_s / 4)
        self.streams: dict[Sends, None] = {}
        self.timer: Timer | None = None

    def add(self, sends: Sends) -> None:
        self.streams[sends] = None
        if self.timer is None:
            self.timer = timers().later(self.every, self._sweep)

    def discard(self, sends: Sends) -> None:
        self.streams.pop(sends, None)

    def _sweep(self) -> None:
        self.timer = None
        now = self.loop.time()
        for sends in [s for s in self.streams if s.since and now - s.since >= self.timeout_s and not s.stalled]:
            log.warning("stream_stalled", waited_s=round(now - sends.since, 1), timeout_s=self.timeout_s)
            sends.stall()
        if self.streams:
            self.timer = timers().later(self.every, self._sweep)


_sweep: Sweep | None = None  # the running loop's (one loop at a time: the server's)


def watch(timeout_s: float, task: asyncio.Task[object], abort: Callable[[], None] | None) -> tuple[Sends, Sweep]:
    global _sweep
    loop = asyncio.get_running_loop()
    if _sweep is None or _sweep.loop is not loop or _sweep.timeout_s != timeout_s:
        _sweep = Sweep(loop, timeout_s)  # another loop or setting (a test's); the old sweep ends with its streams
    sends = Sends(task, abort)
    _sweep.add(sends)
    return sends, _sweep
