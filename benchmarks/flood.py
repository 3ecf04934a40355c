"""A flood (#39 item 1), on the real engine: `--flood` chat requests at once (whole answers, then
streams), each sending its deadline as the openai SDK sends its timeout (`X-Stainless-Read-Timeout`),
against a gateway with fixed admission bounds (`admission.adaptive: false`, `max_running` 256) and
one with the measured limit (the default), one after the other. Per run: how many were answered
(200), refused (429/503, each with Retry-After) and timed out at the client (the deadline plus
`--margin-s`), the admitted throughput (output tokens of the 200s per second of the flood), the
slowest first byte, and /health's latency meanwhile. `tests/drills/test_flood.py` asserts on the
same flood (`flood`).

    .venv/bin/python -m benchmarks.flood --flood 200
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from benchmarks.procs import Proc, log, md_table, run_command

MODEL = "smollm2-135m-instruct"
MODES = {"fixed": "false", "adaptive": "true"}  # -> GATEWAY_ADMISSION__ADAPTIVE


@dataclass
class Outcome:
    status: int | None  # None: the client timed out
    retry_after: str | None = None
    first_byte_s: float = 0.0
    tokens: int = 0  # output tokens of a 200
    reason: str = ""  # a refusal's, by its message: expected_wait, deadline_passed, other


@dataclass
class Flood:
    outcomes: list[Outcome]
    seconds: float
    health_s: list[float] = field(default_factory=list)

    @property
    def timeouts(self) -> int:
        return sum(outcome.status is None for outcome in self.outcomes)

    def count(self, *statuses: int) -> int:
        return sum(outcome.status in statuses for outcome in self.outcomes)

    @property
    def throughput(self) -> float:
        """Output tokens per second of the answers admitted (200)."""
        return sum(outcome.tokens for outcome in self.outcomes) / self.seconds

    def summary(self) -> dict[str, Any]:
        health = sorted(self.health_s) or [0.0]
        return {"answered": self.count(200), "refused": self.count(429, 503), "timeouts": self.timeouts,
                "others": len(self.outcomes) - self.count(200, 429, 503) - self.timeouts,
                "refused_without_retry_after": sum(o.status in (429, 503) and not o.retry_after for o in self.outcomes),
                "tokens_per_s": self.throughput, "seconds": self.seconds,
                "first_byte_max_s": max((o.first_byte_s for o in self.outcomes if o.status is not None), default=0.0),
                "refused_by_reason": {reason: sum(o.reason == reason for o in self.outcomes)
                                      for reason in sorted({o.reason for o in self.outcomes if o.reason})},
                "health_p50_ms": health[len(health) // 2] * 1000, "health_max_ms": health[-1] * 1000}


def _tokens(body: bytes, stream: bool) -> int:
    """The answer's output tokens, by its usage (a stream's last chunk: it asked for it)."""
    if not stream:
        return int(orjson.loads(body)["usage"]["completion_tokens"])
    for line in reversed(body.split(b"\n")):
        if line.startswith(b"data: {") and b'"usage"' in line:
            usage = orjson.loads(line[6:]).get("usage")
            if usage:
                return int(usage["completion_tokens"])
    return 0


async def one(client: httpx.AsyncClient, base: str, n: int, stream: bool, deadline_s: float, max_tokens: int) -> Outcome:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "stream": stream,
                            "messages": [{"role": "user", "content": f"Tell me about the sea, number {n}."}]}
    if stream:
        body["stream_options"] = {"include_usage": True}
    started = time.monotonic()
    try:
        async with client.stream("POST", f"{base}/v1/chat/completions", json=body,
                                 headers={"X-Stainless-Read-Timeout": str(float(deadline_s))}) as response:
            first_byte_s = time.monotonic() - started
            data = await response.aread()
    except httpx.TimeoutException:
        return Outcome(None, first_byte_s=time.monotonic() - started)
    tokens = _tokens(data, stream) if response.status_code == 200 else 0
    reason = _reason(data) if response.status_code in (429, 503) else ""
    return Outcome(response.status_code, response.headers.get("retry-after"), first_byte_s, tokens, reason)


def _reason(body: bytes) -> str:
    """A refusal's reason, by admission's message (`gateway_rejected_total`'s reasons, as the client sees them)."""
    message = body.decode(errors="replace")
    for reason, says in (("expected_wait", "expected wait"), ("deadline_passed", "deadline passed")):
        if says in message:
            return reason
    return "other"


async def flood(base: str, count: int, stream: bool, deadline_s: float, margin_s: float, max_tokens: int = 16) -> Flood:
    """`count` chat requests at once, each with its deadline; the client waits for each byte at most
    the deadline plus `margin_s` (the network's, the loop's); /health probed meanwhile."""
    wait = deadline_s + margin_s
    timeout = httpx.Timeout(connect=wait, read=wait, write=wait, pool=wait)
    limits = httpx.Limits(max_connections=count + 10, max_keepalive_connections=count + 10)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        done = threading.Event()
        health: list[float] = []

        def probe() -> None:
            # in a thread of its own, on a connection of its own each time, as the kubelet probes: on this loop
            # (busy with the flood's answers) a probe's request could leave its new connection later than the
            # gateway's idle timeout, which then rightly closes it: the client's delay, not an unanswered /health
            with httpx.Client(timeout=timeout, limits=httpx.Limits(max_keepalive_connections=0)) as own:
                while not done.is_set():
                    started = time.monotonic()
                    answer = own.get(f"{base}/health")
                    assert answer.status_code == 200, answer.status_code
                    health.append(time.monotonic() - started)
                    done.wait(0.1)

        prober = asyncio.create_task(asyncio.to_thread(probe))
        started = time.monotonic()
        try:
            outcomes = await asyncio.gather(*(one(client, base, n, stream, deadline_s, max_tokens) for n in range(count)))
        finally:
            done.set()
            await prober
        return Flood(list(outcomes), time.monotonic() - started, health)


async def work(args: argparse.Namespace, document: dict[str, Any]) -> None:
    folder = Path(document["logs"])
    runs = document["runs"] = []
    for mode, adaptive in MODES.items():
        env = {"GATEWAY_ADMISSION__ADAPTIVE": adaptive, "GATEWAY_CACHE__BACKEND": "off", "GATEWAY_LOG_LEVEL": "warning",
               "GATEWAY_ENGINE__ENFORCE_EAGER": "true"}
        gateway = await Proc.on_free_port(f"gateway-{mode}", [sys.executable, "-m", "gateway", "serve"], env,
                                          folder).launch(900)
        try:
            base = gateway.base_url.removesuffix("/v1")
            await flood(base, 1, False, 60, 5)  # warm-up
            for stream in (answers == "streams" for answers in args.order.split(",")):
                result = await flood(base, args.flood, stream, args.deadline_s, args.margin_s, args.max_tokens)
                summary = {"mode": mode, "stream": stream, **result.summary()}
                log(f"{mode} {'streams' if stream else 'whole'}: {summary}")
                runs.append(summary)
        finally:
            gateway.stop()


def render(document: dict[str, Any]) -> str:
    runs = document.get("runs", [])
    lines = md_table(
        "admission | answers | 200 | 429/503 (all with Retry-After) | client timeouts | admitted tokens/s | first byte max "
        "| /health p50, max",
        ([r["mode"], "streams" if r["stream"] else "whole", r["answered"],
          f"{r['refused']} ({'yes' if not r['refused_without_retry_after'] else 'no'})", r["timeouts"],
          f"{r['tokens_per_s']:.0f}", f"{r['first_byte_max_s']:.1f} s",
          f"{r['health_p50_ms']:.0f} ms, {r['health_max_ms']:.0f} ms"] for r in runs),
    )
    for stream in (False, True):
        fixed = [r for r in runs if r["mode"] == "fixed" and r["stream"] == stream]
        adaptive = [r for r in runs if r["mode"] == "adaptive" and r["stream"] == stream]
        if fixed and adaptive and fixed[0]["tokens_per_s"]:
            ratio = adaptive[0]["tokens_per_s"] / fixed[0]["tokens_per_s"]
            lines.append(f"\n{'streams' if stream else 'whole'}: admitted throughput, adaptive / fixed: {ratio:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flood", type=int, default=200, help="requests at once")
    parser.add_argument("--deadline-s", type=float, default=30, help="each request's deadline (its timeout header)")
    parser.add_argument("--margin-s", type=float, default=5, help="the client's wait beyond the deadline")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--order", default="whole,streams", choices=["whole,streams", "streams,whole", "streams", "whole"],
                        help="the floods on each gateway, in this order (the first meets it cold)")
    argv = sys.argv[1:] if argv is None else argv
    return run_command("flood", argv, parser.parse_args(argv), work, render)[0]


if __name__ == "__main__":
    sys.exit(main())
