"""Failure drills on the real engine (`make chaos`, i.e. `pytest -m drill`; deselected from the
default run: several minutes). Each drill asserts what the gateway must do when clients, Redis, a
remote upstream or the engine misbehave, and leaves its figures in
benchmarks/results/drills-<time>.json (RELIABILITY.md has the last ones written up).

Phase A, a gateway with the Redis cache and small admission bounds (RUNNING + WAITING): a flood at
10x the bounds, 100 mid-stream disconnects, Redis killed and restarted, SIGTERM under load.
Phase B, a gateway whose `remote` model (an echo gateway, slow tokens) falls back to the engine and
whose engine falls back to `backup` (another echo gateway): the upstream killed mid-stream (its
streams go on on the engine: mid-stream failover), the engine core killed.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.redis_server import RedisServer

pytestmark = pytest.mark.drill
REPO = Path(__file__).resolve().parents[2]
RUNNING, WAITING = 4, 4
DISCONNECTS = 100  # streams the disconnect drill cuts mid-answer
REDIS_DRILL_S = 30.0  # seconds of the Redis outage drill (before, down, after)
QUESTION = [{"role": "user", "content": "Tell me about the sea."}]
PROMPTS = ["What is the capital of France?", "Name a colour.", "Say hello.", "Count to three.", "Name a fruit."]
FIGURES: dict[str, Any] = {}
MODELS_A = f"""
models:
  - name: smol
    engine: {{enforce_eager: true}}
    admission: {{max_running: {RUNNING}, max_waiting: {WAITING}, wait_timeout_s: 300, retry_after_s: 1}}
"""
MODELS_B = """
models:
  - name: smol
    engine: {{enforce_eager: true}}
    fallback: [backup]
  - name: remote
    kind: remote
    url: {remote}/v1
    upstream_model: echo
    fallback: [smol]
  - name: backup
    kind: remote
    url: {backup}/v1
    upstream_model: echo
"""


class Server:
    """A server process (`python -m ...`) on port 0, in a session of its own; its port is read from its log."""

    def __init__(self, name: str, folder: Path, args: list[str], env: dict[str, str]) -> None:
        self.log = folder / f"{name}.log"
        env = {**os.environ, "GATEWAY_LOG_LEVEL": "info", "GATEWAY_LOG_FORMAT": "json", **env}
        with self.log.open("wb") as out:
            self.process = subprocess.Popen([sys.executable, "-m", *args, "--host", "127.0.0.1", "--port", "0"],
                                            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        self.base = self._wait_ready(600)

    def _wait_ready(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"{self.log} exited:\n{self.log.read_text()[-3000:]}"
            if found := re.search(r"running on (http://127\.0\.0\.1:\d+)", self.log.read_text(errors="replace")):
                return found.group(1)
            time.sleep(0.5)
        raise AssertionError(f"{self.log}: no port within {timeout_s} s")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def gateway(name: str, folder: Path, models: str, env: dict[str, str]) -> Server:
    (folder / f"{name}.yaml").write_text(models)
    return Server(name, folder, ["gateway", "serve"], {
        "GATEWAY_MODELS_FILE": str(folder / f"{name}.yaml"), "GATEWAY_WARMUP": "false", "GATEWAY_DRAIN_TIMEOUT_S": "120", **env})


@pytest.fixture(scope="module")
def folder() -> Iterator[Path]:
    path = REPO / "benchmarks" / "results" / f"drills-{time.strftime('%Y%m%d-%H%M%S')}"
    path.mkdir(parents=True, exist_ok=True)
    yield path
    (path / "drills.json").write_text(json.dumps(FIGURES, indent=2, default=str))


@pytest.fixture(scope="module")
def phase_a(folder: Path) -> Iterator[tuple[Server, RedisServer]]:
    redis = RedisServer(folder).start()
    server = gateway("gateway-a", folder, MODELS_A, {
        "GATEWAY_CACHE__BACKEND": "redis", "GATEWAY_CACHE__REDIS_URL": redis.url, "GATEWAY_CACHE__REDIS_TIMEOUT_S": "0.3"})
    yield server, redis
    server.stop()
    redis.stop()


@pytest.fixture(scope="module")
def phase_b(folder: Path) -> Iterator[tuple[Server, Server]]:
    remote = Server("echo-remote", folder, ["benchmarks.echo_engine", "--token-delay", "0.05"], {"GATEWAY_CACHE__BACKEND": "off"})
    backup = Server("echo-backup", folder, ["benchmarks.echo_engine"], {"GATEWAY_CACHE__BACKEND": "off"})
    server = gateway("gateway-b", folder, MODELS_B.format(remote=remote.base, backup=backup.base), {"GATEWAY_CACHE__BACKEND": "off"})
    yield server, remote
    for proc in (server, remote, backup):
        proc.stop()


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

    def complete(self, tokens: int) -> bool:
        return self.done and not self.errors and self.completion_tokens() == tokens


async def stream(client: httpx.AsyncClient, url: str, body: dict[str, Any], stop_after: int | None = None,
                 started: asyncio.Event | None = None, started_after: int = 1) -> Outcome:
    """POST a stream; leave after `stop_after` events (a disconnect); `started` is set at event `started_after`."""
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
                    if started is not None and len(outcome.events) >= started_after:
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


async def until(check: Callable[[], Awaitable[bool]], timeout_s: float) -> float | None:
    """Seconds until `check()` held (None: not within the timeout)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if await check():
            return round(time.monotonic() - started, 2)
        await asyncio.sleep(0.2)
    return None


def chat(base: str) -> str:
    return f"{base}/v1/chat/completions"


# ---------------------------------------------------------------------------------------------- phase A


async def test_a_flood_at_10x_the_bounds_is_refused_before_the_first_byte(phase_a) -> None:
    base = phase_a[0].base
    body = {"model": "smol", "messages": QUESTION, "max_tokens": 32, "ignore_eos": True, "stream_options": {"include_usage": True}}
    peak = 0.0
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=200)) as client:
        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, await gauge(client, base, "vllm:num_requests_running"))
                await asyncio.sleep(0.1)

        watcher = asyncio.create_task(watch())
        outcomes = await asyncio.gather(*(stream(client, chat(base), body) for _ in range(10 * (RUNNING + WAITING))))
        watcher.cancel()
    admitted = [o for o in outcomes if o.status == 200]
    refused = [o for o in outcomes if o.status == 429]
    clean = [o for o in refused if json.loads(o.events[0])["error"]["code"] == "model_overloaded"
             and "retry-after" in o.headers and not o.headers["content-type"].startswith("text/event-stream")]
    FIGURES["flood"] = {"sent": len(outcomes), "admitted": len(admitted), "refused_429": len(refused),
                        "refused_before_first_byte": len(clean), "peak_engine_running": peak}
    assert admitted
    assert all(o.complete(32) for o in admitted)
    assert len(admitted) + len(refused) == len(outcomes)
    assert len(clean) == len(refused) > 0
    assert peak <= RUNNING


async def test_mid_stream_disconnects_leave_nothing_running(phase_a) -> None:
    total = DISCONNECTS
    base = phase_a[0].base
    body = {"model": "smol", "messages": QUESTION, "max_tokens": 1000, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=600) as client:
        before = await gauge(client, base, "gateway_client_disconnects_total")
        statuses: list[int] = []
        while len(statuses) < total:  # in waves the bounds admit
            wave = min(RUNNING + WAITING, total - len(statuses))
            statuses += [o.status for o in await asyncio.gather(*(stream(client, chat(base), body, stop_after=2) for _ in range(wave)))]

        async def idle() -> bool:
            return await gauge(client, base, "vllm:num_requests_running") == 0 and \
                await gauge(client, base, "gateway_requests_in_flight") == 0

        took = await until(idle, 60)
        counted = await gauge(client, base, "gateway_client_disconnects_total") - before
    FIGURES["disconnects"] = {"disconnected_mid_stream": statuses.count(200), "seconds_to_idle": took, "disconnects_counted": counted}
    left = statuses.count(200)  # a wave can come before the last one's slots are free: a clean 429 then
    assert left >= total // 2
    assert set(statuses) <= {200, 429}
    assert took is not None, "the engine or the gateway still had requests running a minute later"
    assert counted >= left


async def test_redis_killed_and_restarted_costs_hits_not_requests(phase_a) -> None:
    seconds = REDIS_DRILL_S
    base, redis = phase_a[0].base, phase_a[1]
    phases = {p: {"ok": 0, "failed": 0, "hits": 0} for p in ("before", "down", "after")}
    phase, stop, failures = "before", time.monotonic() + seconds, []
    async with httpx.AsyncClient(timeout=600) as client:
        errors_before = await gauge(client, base, "gateway_cache_errors_total")

        async def worker(n: int) -> None:
            while time.monotonic() < stop:
                body = {"model": "smol", "messages": [{"role": "user", "content": PROMPTS[n % len(PROMPTS)]}],
                        "max_tokens": 8, "temperature": 0}
                n += 1
                outcome, current = await post(client, chat(base), body), phases[phase]
                current["ok" if outcome.status == 200 else "failed"] += 1
                current["hits"] += outcome.status == 200 and outcome.headers.get("x-cache") == "HIT"
                if outcome.status != 200:
                    failures.append(outcome.failure or f"{outcome.status}: {outcome.events[0][:200]}")

        async def outage() -> None:
            nonlocal phase
            await asyncio.sleep(seconds * 0.3)
            assert redis.process is not None
            redis.process.kill()
            redis.process.wait(10)
            phase = "down"
            await asyncio.sleep(seconds * 0.35)
            redis.start()  # on the same port
            phase = "after"

        await asyncio.gather(outage(), *(worker(i) for i in range(4)))
        errors = await gauge(client, base, "gateway_cache_errors_total") - errors_before
    FIGURES["redis_outage"] = {"phases": phases, "failures": failures[:5], "cache_errors_counted": errors}
    assert not failures
    assert phases["before"]["hits"] > 0
    assert phases["after"]["hits"] > 0
    assert errors > 0


async def test_sigterm_drains_streams_in_progress(phase_a) -> None:
    server = phase_a[0]
    body = {"model": "smol", "messages": QUESTION, "max_tokens": 64, "ignore_eos": True, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(timeout=600) as client:
        events = [asyncio.Event() for _ in range(RUNNING)]
        tasks = [asyncio.create_task(stream(client, chat(server.base), body, started=e)) for e in events]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 120)
        server.process.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        await asyncio.sleep(0.5)
        ready = (await client.get(f"{server.base}/ready")).status_code
        refused = await post(client, chat(server.base), {**body, "stream": False})
        outcomes = await asyncio.gather(*tasks)
        code = await asyncio.to_thread(server.process.wait, 180)
    FIGURES["sigterm"] = {"in_progress": len(outcomes), "completed": sum(o.complete(64) for o in outcomes),
                          "ready_while_draining": ready, "new_request_while_draining": refused.status,
                          "exit_code": code, "seconds_to_exit": round(time.monotonic() - sent, 1)}
    assert all(o.complete(64) for o in outcomes)
    assert ready == 503
    assert refused.status == 503
    assert code in (0, -signal.SIGTERM)  # uvicorn re-raises the SIGTERM once it has shut down


# ---------------------------------------------------------------------------------------------- phase B


def _text(outcome: Outcome) -> tuple[str, int, int]:
    """A chat stream's text, its role deltas and its finishes."""
    chunks = [json.loads(e) for e in outcome.events if e.startswith("{") and not e.startswith('{"error"')]
    deltas = [c["choices"][0] for c in chunks if c.get("choices")]
    text = "".join(d["delta"].get("content") or "" for d in deltas)
    return text, sum("role" in d["delta"] for d in deltas), sum(bool(d.get("finish_reason")) for d in deltas)


async def test_a_remote_upstream_killed_mid_stream(phase_b) -> None:
    """The upstream killed mid-stream: each stream goes on on its fallback (`smol`, the engine), which
    continues the text already sent (another model: the text after the seam is its own), and ends
    once, with no error event; afterwards the fallback answers before the first byte."""
    base, upstream = phase_b[0].base, phase_b[1]
    body = {"model": "remote", "messages": QUESTION, "max_tokens": 400, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(timeout=600) as client:
        before = await gauge(client, base, "gateway_stream_failovers_total")
        events = [asyncio.Event() for _ in range(4)]
        # each stream well under way (ten events in) when the upstream dies
        tasks = [asyncio.create_task(stream(client, chat(base), body, started=e, started_after=10)) for e in events]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)
        os.killpg(upstream.process.pid, signal.SIGKILL)
        outcomes = await asyncio.gather(*tasks)
        short = {**body, "max_tokens": 8}
        after = await asyncio.gather(*(post(client, chat(base), {**short, "stream_options": None}) for _ in range(3)),
                                     *(stream(client, chat(base), short) for _ in range(3)))
        ready = (await client.get(f"{base}/ready")).json()
        switched = await gauge(client, base, "gateway_stream_failovers_total") - before
    texts = [_text(o) for o in outcomes]
    clean = [o for o, (text, roles, finishes) in zip(outcomes, texts, strict=True)
             if o.status == 200 and o.done and o.failure is None and not o.errors and roles == 1 and finishes == 1
             and text.startswith("the quick")]  # the echo upstream's words first, then the engine's
    served = [o.headers.get("x-served-model") for o in after if o.status == 200 and not o.errors]
    FIGURES["upstream_killed"] = {"streams_cut": len(outcomes), "completed_on_the_fallback": len(clean),
                                  "switches_counted": switched, "served_by_fallback": served.count("smol"),
                                  "ready_says": ready["models"]["remote"]}
    assert len(clean) == len(outcomes), [(o.status, o.errors, o.failure, t[1:]) for o, t in zip(outcomes, texts, strict=True)]
    assert switched == len(outcomes)
    assert served == ["smol"] * len(after)


async def test_the_engine_core_killed(phase_b) -> None:
    server = phase_b[0]
    body = {"model": "smol", "messages": QUESTION, "max_tokens": 8}
    async with httpx.AsyncClient(timeout=600) as client:
        alive = await post(client, chat(server.base), body)
        cores = [c for c in psutil.Process(server.process.pid).children(recursive=True)
                 if "EngineCore" in " ".join([c.name(), *c.cmdline()])]
        assert len(cores) == 1
        assert alive.headers.get("x-served-model") == "smol"
        cores[0].kill()

        async def dead() -> bool:
            return (await client.get(f"{server.base}/health")).status_code == 503

        took = await until(dead, 60)
        after = await asyncio.gather(*(post(client, chat(server.base), body) for _ in range(5)),
                                     *(stream(client, chat(server.base), body) for _ in range(5)))
    served = [o.headers.get("x-served-model") for o in after if o.status == 200 and not o.errors]
    FIGURES["engine_killed"] = {"seconds_to_liveness_503": took, "served_by_fallback": served.count("backup")}
    assert took is not None, "liveness did not turn 503"
    assert served == ["backup"] * len(after)
