"""The gateway on the test double of the engine (`tests.fakes.FakeEngine`, the one echo engine of
the tests and the benchmarks): what the gateway itself costs, with no model (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from tests.fakes import FakeEngine

NAME = "echo"


def echo_engine(name: str = NAME, token_delay: float = 0.0) -> FakeEngine:
    """The fake engine with room for any prompt a benchmark sends."""
    return FakeEngine(name, max_model_len=1 << 16, delay=token_delay)


def create_echo_app(settings: Any = None, engine: FakeEngine | None = None) -> Any:
    """The real gateway app (`gateway.app.create_app`) serving the echo engine under its name."""
    from gateway.app import create_app
    from gateway.settings import Settings

    engine = engine or echo_engine()
    settings = settings or Settings(warmup=False)
    update = {"engine": settings.engine.model_copy(update={"served_model_name": engine.info.name})}
    return create_app(settings.model_copy(update=update), engine_starter=lambda engine_settings: engine)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="The gateway on the echo engine (no model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--name", default=NAME, help="served model name")
    p.add_argument("--token-delay", type=float, default=0.0, help="seconds between output tokens")
    p.add_argument("--lag-probe", action="store_true", help="GET /_bench/lag: the event loop's lag (benchmarks.lag_probe)")
    args = p.parse_args(argv)
    import uvicorn

    from gateway.server.http import server_config
    from gateway.settings import Settings
    from gateway.telemetry.logs import configure

    settings = Settings(warmup=False, host=args.host, port=args.port)  # other settings from GATEWAY_*
    configure(settings.log_level, settings.log_format)
    app = create_echo_app(settings, echo_engine(args.name, args.token_delay))
    if args.lag_probe:
        from benchmarks.lag_probe import LagProbe

        app = LagProbe(app)
    uvicorn.Server(server_config(app, settings)).run()  # served as `python -m gateway serve` serves
    return 0


if __name__ == "__main__":
    sys.exit(main())
