"""The gateway app's own CPU per request, in process: hand-made ASGI messages, no sockets, no client.
The gateway on the echo engine as the race's echo part deploys it (or `--bare`), `--without` parts,
or `--traced`: spans exported over OTLP/HTTP to a sink in a child process (whose CPU is not counted)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import subprocess
import sys
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

KEY = "sk-app-cost"
NAME = "smol"
SCENARIOS = ("non-stream", "stream", "cache-hit", "models", "router-page", "metrics")
# the GET scenarios: the model list, the router's page (an endpoint picker scrapes it every 100 ms), /metrics
GETS = {"models": "/v1/models", "router-page": "/metrics/router", "metrics": "/metrics"}
PARTS = ("log", "metrics", "keys", "cache", "tokenizer")


# an OTLP/HTTP endpoint that takes every batch and answers 200, on the port it bound (port 0), printed
SINK = """
import http.server, sys
class Sink(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def log_message(self, *args):
        pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Sink)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


@contextlib.contextmanager
def otlp_sink() -> Iterator[str]:
    """The sink's traces endpoint, for as long as the block runs."""
    sink = subprocess.Popen([sys.executable, "-c", SINK], stdout=subprocess.PIPE, text=True)
    try:
        assert sink.stdout is not None
        yield f"http://127.0.0.1:{int(sink.stdout.readline())}/v1/traces"
    finally:
        sink.terminate()
        sink.wait(10)


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


NO_METRIC = types.SimpleNamespace(**dict.fromkeys(("inc", "dec", "observe", "set", "add", "flush"), _nothing))


def switch_off(without: set[str]) -> None:
    """Parts that settings cannot turn off, replaced in process (this benchmark's process only)."""
    from gateway.telemetry import logs, metrics
    from tests import fakes

    if "log" in without:
        logs._access = types.SimpleNamespace(info=_nothing)
    if "metrics" in without:
        metrics.labelled = lambda metric, *values: NO_METRIC  # type: ignore[assignment]
        metrics.Observations = lambda child: NO_METRIC  # type: ignore[assignment,misc,return-value]
    if "tokenizer" in without:
        fakes.FakeTokenizer.encode = lambda self, text, add_special_tokens=True: [100] * 128  # type: ignore[method-assign]


def make_app(bare: bool, without: set[str]) -> Any:
    os.environ.update(GATEWAY_WARMUP="false", GATEWAY_LOG_LEVEL="info", GATEWAY_LOG_FORMAT="json",
                      GATEWAY_API_KEYS="[]" if "keys" in without else json.dumps([KEY]),
                      GATEWAY_CACHE__BACKEND="off" if "cache" in without else "memory")
    from benchmarks.echo_engine import create_echo_app, echo_engine
    from benchmarks.instant_endpoint import create_bare_app
    from gateway.settings import Settings
    from gateway.telemetry.logs import configure

    if bare:
        return create_bare_app(NAME)
    settings = Settings(warmup=False)
    configure(settings.log_level, settings.log_format)
    handler = logging.getLogger().handlers[0]
    assert isinstance(handler, logging.StreamHandler)
    handler.setStream(open(os.devnull, "w"))  # noqa: SIM115 - formatted, then dropped
    switch_off(without)
    return create_echo_app(settings, echo_engine(NAME))


def bodies(scenario: str, count: int, seed: int = 1) -> list[bytes]:
    from benchmarks.loadgen.prompts import WORDS

    rng = random.Random(seed)
    return [json.dumps({"model": NAME, "prompt": " ".join(WORDS[:128] if scenario == "cache-hit" else rng.choices(WORDS, k=128)),
                        "max_tokens": 64 if scenario == "stream" else 1, "temperature": 0, "ignore_eos": True,
                        "stream": scenario == "stream"}).encode() for _ in range(count)]


def caller(app: Any, scenario: str, state: dict[str, Any]) -> Callable[[bytes], Any]:
    method, path = ("GET", GETS[scenario]) if scenario in GETS else ("POST", "/v1/completions")

    async def call(body: bytes) -> None:
        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 5555), "scheme": "http", "method": method,
            "root_path": "", "path": path, "raw_path": path.encode(), "query_string": b"", "state": dict(state),
            "headers": [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
                        (b"authorization", f"Bearer {KEY}".encode()), (b"content-length", str(len(body)).encode())],
        }
        done = asyncio.Event()
        read = False
        statuses: list[int] = []

        async def receive() -> dict[str, Any]:
            nonlocal read
            if not read:
                read = True
                return {"type": "http.request", "body": body, "more_body": False}
            await done.wait()  # as a server does: nothing more until the client leaves
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                statuses.append(message["status"])
            elif not message.get("more_body"):
                done.set()

        await app(scope, receive, send)
        if statuses != [200]:
            raise RuntimeError(f"the app answered {statuses}, not 200")

    return call


async def measure(app: Any, scenario: str, requests: int, concurrency: int) -> dict[str, float]:
    async with app.router.lifespan_context(app) as state:
        call = caller(app, scenario, state or {})
        for body in bodies(scenario, 200, seed=2):  # warm-up (and the cache-hit's one answer stored)
            await call(body)
        queue = iter(bodies(scenario, requests))

        async def worker() -> None:
            for body in queue:
                await call(body)

        started, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    return {"req_s": requests / elapsed, "cpu_us_per_request": cpu / requests * 1e6}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="The gateway app's own CPU per request, in process")
    p.add_argument("--scenario", choices=SCENARIOS, default="non-stream")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--bare", action="store_true", help="the bare Starlette app instead of the gateway")
    p.add_argument("--without", nargs="*", choices=PARTS, default=[], help="parts of the gateway switched off")
    p.add_argument("--traced", type=float, nargs="?", const=1.0, metavar="RATIO",
                   help="tracing on, exported over OTLP/HTTP to a sink, this share of requests sampled (default 1)")
    args = p.parse_args(argv)
    import uvloop

    with contextlib.ExitStack() as stack:
        if args.traced is not None:
            os.environ["GATEWAY_TRACING__OTLP_ENDPOINT"] = stack.enter_context(otlp_sink())
            os.environ["GATEWAY_TRACING__SAMPLE_RATIO"] = str(args.traced)
        app = make_app(args.bare, set(args.without))
        result = uvloop.run(measure(app, args.scenario, args.requests, args.concurrency))
    what = "bare" if args.bare else "gateway" + (f" without {', '.join(args.without)}" if args.without else "")
    what += f", traced (ratio {args.traced})" if args.traced is not None else ""
    print(f"{what}, {args.scenario}, concurrency {args.concurrency}: {result['req_s']:.0f} req/s, "
          f"{result['cpu_us_per_request']:.1f} us CPU per request")
    return 0


if __name__ == "__main__":
    sys.exit(main())
