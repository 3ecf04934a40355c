"""`--workers 2` on the real engine: two gateway processes on one port, one engine core shared by
both (`gateway.server.workers`, `engine.shared`). Both answer, correctly, under concurrency; either's
/metrics counts every worker's requests; SIGTERM stops everything with status 0."""

from __future__ import annotations

import concurrent.futures
import re
from collections.abc import Callable

import httpx
import psutil
import pytest

from tests.integration.conftest import MODEL, Shared

pytestmark = [pytest.mark.integration, pytest.mark.gateway_only("the gateway's own worker processes")]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CONCURRENT = 20
KEY = {"Authorization": "Bearer sk-integration"}
CHAT_COUNT = re.compile(r'^gateway_requests_total\{model="' + MODEL + r'",route="/v1/chat/completions",status="200"\} (\S+)$', re.M)


@pytest.fixture(scope="module")
def workers(two_workers: Callable[[], Shared]) -> Shared:
    """The two-worker gateway (tests/integration/conftest.py: API keys, the Redis cache), which
    test_backends also uses as a replica; stopped here."""
    return two_workers()


def chat(base: str) -> httpx.Response:
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 12, "temperature": 0}
    return httpx.post(f"{base}/v1/chat/completions", json=body, headers=KEY, timeout=300)


def engine_cores(parent: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(parent).children(recursive=True) if "EngineCore" in " ".join([p.name(), *p.cmdline()])]


def test_two_workers_share_one_engine_core_and_stop_cleanly(workers) -> None:
    base, process, log_path = workers
    assert len(engine_cores(process.pid)) == 1

    with concurrent.futures.ThreadPoolExecutor(CONCURRENT) as pool:
        answers = list(pool.map(lambda _: chat(base), range(CONCURRENT)))
    for answer in answers:  # every answer whole and right, whichever worker sent it
        assert answer.status_code == 200, answer.text
        assert "Paris" in answer.json()["choices"][0]["message"]["content"]
    seen = {answer.headers["x-gateway-worker"] for answer in answers}
    while seen != {"0", "1"} and len(answers) < 100:  # the kernel spreads connections; not necessarily evenly
        answers.append(chat(base))
        assert answers[-1].status_code == 200
        seen.add(answers[-1].headers["x-gateway-worker"])
    assert seen == {"0", "1"}

    scraped: dict[str, float] = {}
    for _ in range(100):  # a scrape from each worker counts every worker's requests
        metrics = httpx.get(f"{base}/metrics", timeout=30)
        found = CHAT_COUNT.search(metrics.text)
        assert found is not None, metrics.text[:3000]
        scraped[metrics.headers["x-gateway-worker"]] = float(found[1])
        if len(scraped) == 2:
            break
    assert scraped == {"0": len(answers), "1": len(answers)}

    family = psutil.Process(process.pid).children(recursive=True)
    described = {p.pid: " ".join([p.name(), *p.cmdline()])[:120] for p in family}
    process.terminate()
    assert process.wait(timeout=120) == 0, log_path.read_text()[-3000:]
    _, left = psutil.wait_procs(family, timeout=15)  # (multiprocessing's resource tracker ends just after us)
    assert [described[p.pid] for p in left] == []
