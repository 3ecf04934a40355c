"""A real engine dying under a gateway: its engine core process is killed (as the OOM killer or a
crashed kernel would), in the middle of a stream. The stream must go on on the model's fallback
(`rescue`, the session's gateway: the same model) with nothing repeated or missing; the gateway
must notice, fail its liveness check so the orchestrator restarts it, send the dead model's
requests to its fallback, and still stop cleanly."""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Callable

import httpx
import psutil
import pytest

from tests.integration.conftest import LORA_BASE, Shared
from tests.waits import until_sync

pytestmark = [pytest.mark.integration, pytest.mark.gateway_only("fallbacks and engine liveness are the gateway's own")]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
KEY = "sk-all"
MODEL = LORA_BASE


@pytest.fixture(scope="module")
def doomed(lora_gateway: Callable[[], Shared]) -> tuple[str, subprocess.Popen]:
    """The LoRA gateway (tests/integration/conftest.py, after test_adapters and test_guards): an engine of its own,
    and the session's gateway as its model's fallback (`rescue`). Its engine dies here."""
    return lora_gateway()[:2]


def chat(base: str, stream: bool = False, model: str = MODEL) -> httpx.Response:
    body = {"model": model, "messages": QUESTION, "max_tokens": 8, "temperature": 0, "stream": stream}
    headers = {"Authorization": f"Bearer {KEY}", "Cache-Control": "no-cache"}  # (the same question each time)
    return httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=120)


LONG = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}],
        "max_tokens": 96, "temperature": 0, "ignore_eos": True}


def joined_stream(base: str, gateway: subprocess.Popen) -> tuple[str, list[dict]]:
    """A long stream whose engine core is killed once its first pieces have arrived: its text and chunks."""
    chunks: list[dict] = []
    body = {**LONG, "stream": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {KEY}", "Cache-Control": "no-cache"}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, headers=headers, timeout=120) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunks.append(json.loads(line[6:]))
            if len(chunks) == 4:  # mid-stream: the role, then some text
                engine_core(gateway).send_signal(signal.SIGKILL)
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices")), chunks


def engine_core(gateway: subprocess.Popen) -> psutil.Process:
    children = psutil.Process(gateway.pid).children()
    cores = [c for c in children if "EngineCore" in " ".join([c.name(), *c.cmdline()])]
    assert len(cores) == 1, [(c.pid, c.name(), c.cmdline()) for c in children]
    return cores[0]


def test_a_killed_engine_fails_liveness_and_its_requests_fall_back(doomed) -> None:
    base, gateway = doomed
    alive = chat(base)
    assert alive.status_code == 200
    assert alive.headers["x-served-model"] == MODEL
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}
    headers = {"Authorization": f"Bearer {KEY}", "Cache-Control": "no-cache"}
    whole = httpx.post(f"{base}/v1/chat/completions", json=LONG, headers=headers, timeout=120).json()
    uninterrupted = whole["choices"][0]["message"]["content"]

    text, chunks = joined_stream(base, gateway)  # the engine core dies after its first pieces
    assert all("error" not in chunk for chunk in chunks), chunks[-1]
    # the same model at temperature 0 on both sides of the seam: the same text (docs/models.md#mid-stream-failover:
    # the caveat: a partial re-tokenized at the seam may split into other tokens than it was made of)
    assert text == uninterrupted
    assert [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices") and c["choices"][0].get("finish_reason")] == ["length"]
    assert sum("role" in c["choices"][0]["delta"] for c in chunks if c.get("choices")) == 1
    assert chunks[-1]["usage"]["completion_tokens"] == 96
    assert chunks[-1]["usage"]["prompt_tokens"] > whole["usage"]["prompt_tokens"]  # both parts' prompts
    assert f'gateway_stream_failovers_total{{fallback="rescue",model="{MODEL}"}} 1.0' in httpx.get(f"{base}/metrics").text
    health = until_sync(lambda: (now := httpx.get(f"{base}/health")).status_code != 200 and now, 60, "liveness failed",
                        step_s=0.2)
    assert health.status_code == 503
    assert health.json()["status"] == "dead"
    assert health.json()["models"][MODEL].startswith("dead: ")
    ready = httpx.get(f"{base}/ready", timeout=30)
    assert ready.status_code == 503
    assert ready.json()["models"][MODEL].startswith("unavailable")
    assert ready.json()["models"]["rescue"] == "ready"

    rescued = chat(base)
    assert rescued.status_code == 200
    assert rescued.headers["x-served-model"] == "rescue"
    assert "Paris" in rescued.json()["choices"][0]["message"]["content"]
    streamed = chat(base, stream=True)
    assert streamed.status_code == 200
    assert streamed.headers["x-served-model"] == "rescue"
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert all("error" not in json.loads(e) for e in events[:-1])
    alone = chat(base, model="lora-a")  # an adapter on the dead engine, with no fallback: refused at once
    assert alone.status_code == 503
    assert alone.json()["error"]["message"].startswith("The model 'lora-a' is unavailable: its engine is not running")
    assert int(alone.headers["retry-after"]) >= 1
    metrics = httpx.get(f"{base}/metrics").text
    assert f'gateway_fallbacks_total{{fallback="rescue",model="{MODEL}"}}' in metrics
    assert f'gateway_rejected_total{{model="{MODEL}",reason="engine_unhealthy"}}' in metrics


def test_a_gateway_with_a_dead_engine_still_stops_cleanly(doomed) -> None:
    _, gateway = doomed
    gateway.send_signal(signal.SIGTERM)
    assert gateway.wait(timeout=60) in (0, -signal.SIGTERM)
