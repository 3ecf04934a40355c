"""The event loop's lag, measured inside a server: a pure ASGI wrapper (`LagProbe`) whose
background task sleeps `interval_s` again and again and records how late each wake-up comes;
`GET /_bench/lag` answers what it saw since the last call (samples, p50, p99, max in ms) and
starts afresh. Used by `benchmarks.echo_engine --lag-probe` (benchmarks.growth): the gateway's
own app is untouched, the probe only sits in front of it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from benchmarks.loadgen.results import percentile

PATH = "/_bench/lag"


class LagProbe:
    def __init__(self, app: ASGIApp, interval_s: float = 0.005) -> None:
        self.app = app
        self.interval_s = interval_s
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _watch(self) -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            self.lags.append(max(0.0, time.perf_counter() - before - self.interval_s))
            if len(self.lags) > 1_000_000:  # bounded, whoever forgets to read it
                del self.lags[:500_000]

    def report(self) -> dict[str, Any]:
        """What the loop's lag was since the last report, in milliseconds; then start afresh."""
        lags, self.lags = self.lags, []
        ms = [x * 1000 for x in lags]
        return {"samples": len(ms), "interval_ms": self.interval_s * 1000, "p50_ms": percentile(ms, 50) if ms else None,
                "p99_ms": percentile(ms, 99) if ms else None, "max_ms": max(ms) if ms else None}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch())
        if scope["type"] == "http" and scope["path"] == PATH:
            body = orjson.dumps(self.report())
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)
