"""The HTTP server: uvicorn, with SIGTERM meaning a graceful drain.

On SIGTERM the server does not stop listening at once: readiness turns 503 (so the load balancer
takes the pod out), new requests get 503 (`middleware.lifecycle`), requests and streams in progress
finish for up to `drain_timeout_s`, and only then does uvicorn shut down and the lifespan stop the
engines. A second signal exits at once.

What can be read again without a restart (the TLS certificate, `gateway.tls`; the keys file,
`gateway.tenants`) is given as
`reloadables`: SIGHUP reloads them (SIGHUP keeps its default, exit, when there are none), and the
main loop lets each poll its files every tick.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Generator, Sequence
from types import FrameType
from typing import Protocol

import structlog
import uvicorn

from gateway.middleware.lifecycle import Lifecycle

log = structlog.get_logger(__name__)


class Reloadable(Protocol):
    def reload(self, reason: str) -> bool: ...

    def poll(self) -> None: ...


class DrainingServer(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        lifecycle: Lifecycle,
        drain_timeout_s: float,
        reloadables: Sequence[Reloadable] = (),
    ) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        self.drain_timeout_s = drain_timeout_s
        self.reloadables = tuple(reloadables)
        self._drain_requested = False
        self._reload_requested = False
        self._deadline = 0.0

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        with super().capture_signals():
            if not self.reloadables or threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = signal.signal(signal.SIGHUP, self.handle_hangup)
            try:
                yield
            finally:
                signal.signal(signal.SIGHUP, previous)

    def handle_hangup(self, sig: int, frame: FrameType | None) -> None:
        self._reload_requested = True  # acted on in on_tick, outside the signal handler

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self._drain_requested and not self.should_exit:
            self._captured_signals.append(sig)
            self._drain_requested = True  # acted on in on_tick, outside the signal handler
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        self._reload()
        if self._drain_requested and not self.lifecycle.draining:
            self.lifecycle.start_drain()
            self._deadline = time.monotonic() + self.drain_timeout_s
            log.info("draining", in_flight=self.lifecycle.active, timeout_s=self.drain_timeout_s)
        if self.lifecycle.draining and not self.should_exit:
            if self.lifecycle.active == 0 or time.monotonic() >= self._deadline:
                log.info("drained", left_in_flight=self.lifecycle.active)
                self.should_exit = True
        return await super().on_tick(counter)

    def _reload(self) -> None:
        if self._reload_requested:
            self._reload_requested = False
            for reloadable in self.reloadables:
                reloadable.reload("SIGHUP")
        for reloadable in self.reloadables:
            reloadable.poll()
