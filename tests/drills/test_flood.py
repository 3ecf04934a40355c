"""A drill (`make chaos`; it depends on the machine's speed, so it is not in `make test`): a flood is
answered (#26 item 5): 200 requests at once against a gateway on the real engine, with the default
admission settings. Each gets its answer's first byte within the
admission wait time plus a second (the client's timeout says so: a client timeout fails the test):
a 200, or a 429/503 with Retry-After. /health answers throughout, between the flood's requests.
The test prints its figures (time to headers, /health latency; `-s` shows them): they are
written up in docs/tenants-and-guards.md, not asserted. What it guards without timing: a full
queue refuses at once with 429 + Retry-After (tests/unit/test_admission.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from gateway.settings import AdmissionSettings
from tests.integration.conftest import gateway_process

pytestmark = pytest.mark.drill
FLOOD = 200
WAIT_S = AdmissionSettings().wait_timeout_s  # the default the gateway runs with
BODY = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Tell me about the sea."}],
        "max_tokens": 16, "stream": True}


async def one(client: httpx.AsyncClient, base: str) -> tuple[int, str | None, float]:
    """(status, Retry-After, seconds to the headers) of one streamed chat, read to its end."""
    started = time.monotonic()
    async with client.stream("POST", f"{base}/v1/chat/completions", json=BODY) as response:
        headers_s = time.monotonic() - started
        async for _ in response.aiter_bytes():
            pass
    return response.status_code, response.headers.get("retry-after"), headers_s


async def flood(base: str) -> tuple[list[tuple[int, str | None, float]], list[float]]:
    """The flood's outcomes, and the /health latencies seen while it ran."""
    # the first byte must come within WAIT_S + 1 s; the rest of a stream may take longer
    timeout = httpx.Timeout(connect=WAIT_S + 1, read=WAIT_S + 1, write=10, pool=WAIT_S + 1)
    limits = httpx.Limits(max_connections=FLOOD + 10, max_keepalive_connections=FLOOD + 10)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        done = asyncio.Event()
        health: list[float] = []

        async def probe() -> None:
            while not done.is_set():
                started = time.monotonic()
                assert (await client.get(f"{base}/health")).status_code == 200
                health.append(time.monotonic() - started)
                await asyncio.sleep(0.1)

        prober = asyncio.create_task(probe())
        try:
            outcomes = await asyncio.gather(*(one(client, base) for _ in range(FLOOD)))
        finally:
            done.set()
            await prober
    return outcomes, health


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    env = {"GATEWAY_LOG_FORMAT": "json", "GATEWAY_ENGINE__ENFORCE_EAGER": "true"}
    with gateway_process(tmp_path_factory.mktemp("flood"), env) as (base, _):
        yield base


async def test_a_flood_of_200_at_once_is_answered_within_the_wait(server: str) -> None:
    outcomes, health = await flood(server)
    statuses = {status for status, _, _ in outcomes}
    assert statuses <= {200, 429, 503}, statuses
    assert 200 in statuses
    assert all(retry_after for status, retry_after, _ in outcomes if status != 200)
    assert health  # /health answered while the flood ran
    slowest = max(seconds for _, _, seconds in outcomes)
    print(f"flood of {FLOOD}: {sorted(statuses)}; headers max {slowest:.1f} s; "
          f"/health p50 {sorted(health)[len(health) // 2] * 1000:.0f} ms, max {max(health) * 1000:.0f} ms")
