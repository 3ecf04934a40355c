"""The gateway on the test double of the engine (`tests.fakes.FakeEngine`, the one echo engine of
the tests and the benchmarks): what the gateway itself costs, with no model; with `--lag-probe`,
`LagProbe` in front of it: `GET /_bench/lag` answers the event loop's lag since the last call."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any, cast

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from benchmarks.loadgen.results import Stats
from tests.fakes import FakeEngine

NAME = "echo"
PATH = "/_bench/lag"


def echo_engine(name: str = NAME, token_delay: float = 0.0) -> FakeEngine:
    """The fake engine with room for any prompt a benchmark sends."""
    return FakeEngine(name, max_model_len=1 << 16, delay=token_delay)


def create_echo_app(settings: Any = None, engine: FakeEngine | None = None) -> Any:
    """The real gateway app (`gateway.app.create_app`) serving the echo engine under its name."""
    from engine.types import Engine
    from gateway.app import create_app
    from gateway.settings import Settings

    engine = engine or echo_engine()
    settings = settings or Settings(warmup=False)
    update = {"engine": settings.engine.model_copy(update={"served_model_name": engine.info.name})}
    return create_app(settings.model_copy(update=update), engine_starter=lambda engine_settings: cast("Engine", engine))


class LagProbe:
    """A pure ASGI wrapper whose background task sleeps `interval_s` again and again and records how
    late each wake-up comes; the gateway's own app is untouched (benchmarks.growth's streams part)."""

    def __init__(self, app: ASGIApp, interval_s: float = 0.005) -> None:
        self.app, self.interval_s = app, interval_s
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
        """The loop's lag since the last report, in milliseconds; then start afresh."""
        lags, self.lags = Stats.of([x * 1000 for x in self.lags]), []
        return {"samples": lags.n, "interval_ms": self.interval_s * 1000, "p50_ms": lags.p50, "p99_ms": lags.p99, "max_ms": lags.max}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch())
        if scope["type"] != "http" or scope["path"] != PATH:
            return await self.app(scope, receive, send)
        body = orjson.dumps(self.report())
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="The gateway on the echo engine (no model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--name", default=NAME, help="served model name")
    p.add_argument("--token-delay", type=float, default=0.0, help="seconds between output tokens")
    p.add_argument("--lag-probe", action="store_true", help=f"GET {PATH}: the event loop's lag")
    args = p.parse_args(argv)
    import uvicorn

    from gateway.server.http import server_config
    from gateway.server.tls import ServerTLS
    from gateway.settings import Settings
    from gateway.telemetry.logs import configure

    settings = Settings(warmup=False, host=args.host, port=args.port)  # other settings from GATEWAY_*
    configure(settings.log_level, settings.log_format)
    app = create_echo_app(settings, echo_engine(args.name, args.token_delay))
    tls = ServerTLS(settings.tls).uvicorn_options() if settings.tls.enabled else None
    uvicorn.Server(server_config(LagProbe(app) if args.lag_probe else app, settings, tls)).run()  # as `gateway serve` serves
    return 0


if __name__ == "__main__":
    sys.exit(main())
