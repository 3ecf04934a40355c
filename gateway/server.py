"""The HTTP server: uvicorn, with SIGTERM meaning a graceful drain.

On SIGTERM the server does not stop listening at once: readiness turns 503 (so the load balancer
takes the pod out), new requests get 503 (`middleware.lifecycle`), requests and streams in progress
finish for up to `drain_timeout_s`, and only then does uvicorn shut down and the lifespan stop the
engines. A second signal exits at once.
"""

from __future__ import annotations

import signal
import time
from types import FrameType

import structlog
import uvicorn

from gateway.middleware.lifecycle import Lifecycle

log = structlog.get_logger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        self.drain_timeout_s = drain_timeout_s
        self._drain_requested = False
        self._deadline = 0.0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self._drain_requested and not self.should_exit:
            self._captured_signals.append(sig)
            self._drain_requested = True  # acted on in on_tick, outside the signal handler
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self._drain_requested and not self.lifecycle.draining:
            self.lifecycle.start_drain()
            self._deadline = time.monotonic() + self.drain_timeout_s
            log.info("draining", in_flight=self.lifecycle.active, timeout_s=self.drain_timeout_s)
        if self.lifecycle.draining and not self.should_exit:
            if self.lifecycle.active == 0 or time.monotonic() >= self._deadline:
                log.info("drained", left_in_flight=self.lifecycle.active)
                self.should_exit = True
        return await super().on_tick(counter)
