"""The drills of `benchmarks.chaos` (failure drills on the real engine), each against a running
gateway: one request's outcome, the processes a drill starts or kills (Redis, gateways, echo
upstreams, the engine core), and the six drills. `benchmarks.chaos` runs them in two phases and
writes their figures."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from benchmarks.procs import Proc, free_port

RUNNING, WAITING = 4, 4
QUESTION = [{"role": "user", "content": "Tell me about the sea."}]
PROMPTS = ["What is the capital of France?", "Name a colour.", "Say hello.", "Count to three.", "Name a fruit."]


def say(message: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# One request


@dataclass
class Outcome:
    status: int = 0
    events: list[str] = field(default_factory=list)  # SSE data payloads, [DONE] included
    headers: dict[str, str] = field(default_factory=dict)
    failure: str | None = None

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1] == "[DONE]"

    @property
    def errors(self) -> list[dict[str, Any]]:
        return [json.loads(e)["error"] for e in self.events if e.startswith('{"error"')]

    def completion_tokens(self) -> int | None:
        for event in reversed(self.events):
            if event.startswith("{") and (usage := json.loads(event).get("usage")):
                return int(usage["completion_tokens"])
        return None


async def stream(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                 stop_after: int | None = None, started: asyncio.Event | None = None) -> Outcome:
    """POST a stream; `stop_after` events, leave (the client disconnects); `started` is set at
    the first event."""
    outcome = Outcome()
    try:
        async with client.stream("POST", url, json={**body, "stream": True}) as response:
            outcome.status, outcome.headers = response.status_code, dict(response.headers)
            if response.status_code != 200:
                outcome.events.append((await response.aread()).decode())
                return outcome
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    outcome.events.append(line[len("data: "):])
                    if started is not None:
                        started.set()
                    if stop_after is not None and len(outcome.events) >= stop_after:
                        return outcome  # leaving the block closes the connection mid-stream
    except httpx.HTTPError as exc:
        outcome.failure = f"{type(exc).__name__}: {exc}"
    return outcome


async def post(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Outcome:
    try:
        response = await client.post(url, json=body)
    except httpx.HTTPError as exc:
        return Outcome(failure=f"{type(exc).__name__}: {exc}")
    return Outcome(response.status_code, [response.text], dict(response.headers))


async def gauge(client: httpx.AsyncClient, base: str, name: str) -> float:
    text = (await client.get(f"{base}/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


async def until(check: Callable[[], Awaitable[bool]], timeout_s: float, step_s: float = 0.2) -> float | None:
    """Seconds until `check()` held (None: it never did within the timeout)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if await check():
            return round(time.monotonic() - started, 2)
        await asyncio.sleep(step_s)
    return None


# ----------------------------------------------------------------------------------------------
# Processes


class Redis:
    def __init__(self, folder: Path) -> None:
        self.folder, self.port = folder, free_port()
        self.proc: Proc | None = None

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server is not installed: run `make system-deps`")
        command = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.proc = Proc("redis", command, {}, self.folder / "redis.log")
        self.proc.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        assert self.proc is not None and self.proc.process is not None
        self.proc.process.kill()
        self.proc.process.wait(timeout=10)
        self.proc.stop()


def gateway(name: str, folder: Path, models: str, env: dict[str, str]) -> Proc:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.yaml").write_text(models)
    port = free_port()
    base_env = {"GATEWAY_MODELS_FILE": str(folder / f"{name}.yaml"), "GATEWAY_WARMUP": "false",
                "GATEWAY_LOG_FORMAT": "json", "GATEWAY_DRAIN_TIMEOUT_S": "120"}
    command = [sys.executable, "-m", "gateway", "serve", "--host", "127.0.0.1", "--port", str(port)]
    return Proc(name, command, {**base_env, **env}, folder / f"{name}.log", port)


def echo_upstream(name: str, folder: Path, token_delay: float) -> Proc:
    port = free_port()
    command = [sys.executable, "-m", "benchmarks.echo_engine", "--port", str(port), "--token-delay", str(token_delay)]
    return Proc(name, command, {"GATEWAY_LOG_LEVEL": "warning"}, folder / f"{name}.log", port)


def engine_core(proc: Proc) -> psutil.Process:
    assert proc.process is not None
    cores = [c for c in psutil.Process(proc.process.pid).children(recursive=True)
             if "EngineCore" in " ".join([c.name(), *c.cmdline()])]
    if len(cores) != 1:
        raise RuntimeError(f"expected one engine core under {proc.name}, found {len(cores)}")
    return cores[0]


# ----------------------------------------------------------------------------------------------
# Phase A


async def flood(client: httpx.AsyncClient, base: str) -> dict[str, Any]:
    count = 10 * (RUNNING + WAITING)
    body = {"model": "smol", "messages": QUESTION, "max_tokens": 32, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    peak = 0.0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, await gauge(client, base, "vllm:num_requests_running"))
            await asyncio.sleep(0.1)

    watcher = asyncio.create_task(watch())
    outcomes = await asyncio.gather(*(stream(client, f"{base}/v1/chat/completions", body) for _ in range(count)))
    watcher.cancel()
    admitted = [o for o in outcomes if o.status == 200]
    refused = [o for o in outcomes if o.status == 429]
    complete = [o for o in admitted if o.done and not o.errors and o.completion_tokens() == 32]
    cleanly_refused = [o for o in refused if json.loads(o.events[0])["error"]["code"] == "model_overloaded"
                       and "retry-after" in o.headers and not o.headers["content-type"].startswith("text/event-stream")]
    return {"sent": count, "admitted": len(admitted), "admitted_complete": len(complete), "refused_429": len(refused),
            "refused_before_first_byte": len(cleanly_refused), "other": count - len(admitted) - len(refused),
            "peak_engine_running": peak, "bound": {"running": RUNNING, "waiting": WAITING}}


async def disconnects(client: httpx.AsyncClient, base: str, total: int = 100) -> dict[str, Any]:
    body = {"model": "smol", "messages": QUESTION, "max_tokens": 1000, "ignore_eos": True}
    before = await gauge(client, base, "gateway_client_disconnects_total")
    left = 0
    statuses: list[int] = []
    while left < total:
        wave = min(RUNNING + WAITING, total - left)
        outcomes = await asyncio.gather(*(stream(client, f"{base}/v1/chat/completions", body, stop_after=2)
                                          for _ in range(wave)))
        statuses += [o.status for o in outcomes]
        left += wave
    running = lambda: gauge(client, base, "vllm:num_requests_running")  # noqa: E731
    in_flight = lambda: gauge(client, base, "gateway_requests_in_flight")  # noqa: E731

    async def idle() -> bool:
        return await running() == 0 and await in_flight() == 0

    took = await until(idle, 60)
    return {"disconnected_mid_stream": statuses.count(200), "other_statuses": [s for s in statuses if s != 200],
            "engine_running_after": await running(), "gateway_in_flight_after": await in_flight(),
            "seconds_to_idle": took,
            "disconnects_counted": await gauge(client, base, "gateway_client_disconnects_total") - before}


async def redis_outage(client: httpx.AsyncClient, base: str, redis: Redis, seconds: float = 30) -> dict[str, Any]:
    phases: dict[str, dict[str, int]] = {p: {"ok": 0, "failed": 0, "hits": 0} for p in ("before", "down", "after")}
    phase = "before"
    stop = time.monotonic() + seconds
    errors_before = await gauge(client, base, "gateway_cache_errors_total")
    failures: list[str] = []

    async def worker(i: int) -> None:
        n = i
        while time.monotonic() < stop:
            body = {"model": "smol", "messages": [{"role": "user", "content": PROMPTS[n % len(PROMPTS)]}],
                    "max_tokens": 8, "temperature": 0}
            n += 1
            outcome = await post(client, f"{base}/v1/chat/completions", body)
            current = phases[phase]
            if outcome.status == 200:
                current["ok"] += 1
                current["hits"] += outcome.headers.get("x-cache") == "HIT"
            else:
                current["failed"] += 1
                failures.append(outcome.failure or f"{outcome.status}: {outcome.events[0][:200]}")

    async def chaos() -> None:
        nonlocal phase
        await asyncio.sleep(seconds * 0.3)
        redis.kill()
        phase = "down"
        say("redis killed")
        await asyncio.sleep(seconds * 0.35)
        redis.start()
        phase = "after"
        say("redis restarted")

    await asyncio.gather(chaos(), *(worker(i) for i in range(4)))
    return {"phases": phases, "failed": sum(p["failed"] for p in phases.values()), "failures": failures[:5],
            "cache_errors_counted": await gauge(client, base, "gateway_cache_errors_total") - errors_before}


async def sigterm(client: httpx.AsyncClient, proc: Proc) -> dict[str, Any]:
    base = f"http://127.0.0.1:{proc.port}"
    body = {"model": "smol", "messages": QUESTION, "max_tokens": 64, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    events = [asyncio.Event() for _ in range(RUNNING)]
    tasks = [asyncio.create_task(stream(client, f"{base}/v1/chat/completions", body, started=e)) for e in events]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 120)
    assert proc.process is not None
    proc.process.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    await asyncio.sleep(0.5)
    ready = await client.get(f"{base}/ready")
    refused = await post(client, f"{base}/v1/chat/completions", {**body, "stream": False})
    outcomes = await asyncio.gather(*tasks)
    code = await asyncio.to_thread(proc.process.wait, 180)
    complete = [o for o in outcomes if o.done and not o.errors and o.completion_tokens() == 64]
    return {"in_progress_at_sigterm": len(outcomes), "completed": len(complete), "lost": len(outcomes) - len(complete),
            "ready_while_draining": ready.status_code, "new_request_while_draining": refused.status,
            "exit_code": code, "seconds_to_exit": round(time.monotonic() - sent, 1)}


# ----------------------------------------------------------------------------------------------
# Phase B


async def upstream_killed(client: httpx.AsyncClient, base: str, upstream: Proc) -> dict[str, Any]:
    body = {"model": "remote", "messages": QUESTION, "max_tokens": 400}
    events = [asyncio.Event() for _ in range(4)]
    tasks = [asyncio.create_task(stream(client, f"{base}/v1/chat/completions", body, started=e)) for e in events]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)
    await asyncio.sleep(0.5)
    assert upstream.process is not None
    upstream.process.kill()
    outcomes = await asyncio.gather(*tasks)
    clean = [o for o in outcomes if o.status == 200 and o.done and len(o.errors) == 1
             and o.errors[0]["code"] == "service_unavailable" and o.failure is None]
    after = await asyncio.gather(*(post(client, f"{base}/v1/chat/completions", {**body, "max_tokens": 8}) for _ in range(3)),
                                 *(stream(client, f"{base}/v1/chat/completions", {**body, "max_tokens": 8}) for _ in range(3)))
    served = [o.headers.get("x-served-model") for o in after if o.status == 200 and not o.errors]
    ready = (await client.get(f"{base}/ready")).json()
    return {"streams_cut": len(outcomes), "ended_with_one_error_event_and_done": len(clean),
            "error_message": outcomes[0].errors[0]["message"] if outcomes[0].errors else None,
            "new_requests": len(after), "served_by_fallback": served.count("smol"),
            "ready_says": ready["models"]["remote"]}


async def engine_killed(client: httpx.AsyncClient, base: str, proc: Proc) -> dict[str, Any]:
    body = {"model": "smol", "messages": QUESTION, "max_tokens": 8}
    alive = await post(client, f"{base}/v1/chat/completions", body)
    engine_core(proc).kill()

    async def dead() -> bool:
        return (await client.get(f"{base}/health")).status_code == 503

    took = await until(dead, 60)
    after = await asyncio.gather(*(post(client, f"{base}/v1/chat/completions", body) for _ in range(5)),
                                 *(stream(client, f"{base}/v1/chat/completions", body) for _ in range(5)))
    served = [o.headers.get("x-served-model") for o in after if o.status == 200 and not o.errors]
    health = await client.get(f"{base}/health")
    return {"served_before_by": alive.headers.get("x-served-model"), "seconds_to_liveness_503": took,
            "health_after": health.status_code, "requests_after": len(after), "served_by_fallback": served.count("backup")}
