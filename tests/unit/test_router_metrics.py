"""The router's page (GET /metrics/router, gateway.telemetry.router): what an endpoint picker reads of a
pod, one sample per series, parsed with prometheus_client's text parser as a scraper would parse it.

The engines' numbers come through `Engine.load()` (the fake engine's `scheduler`); the requests the
gateway holds in admission queues are counted as waiting, as the engines' own queues are.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from engine.config import EngineSettings
from engine.types import EngineLoad
from gateway.app import create_app
from gateway.telemetry import router
from tests.fakes import FakeEngine, HeldEngine, app_with, chat_body, fake_settings
from tests.waits import until

PICKER_READS = {  # llm-d-router v0.10.0, core-metrics-extractor's built-in "vllm" engine config
    "vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info", "vllm:lora_requests_info",
}


def parse(text: str) -> dict[str, tuple[dict[str, str], float]]:
    """Each family's one sample (labels, value); fails on a family with more or fewer than one."""
    found: dict[str, tuple[dict[str, str], float]] = {}
    for family in text_string_to_metric_families(text):
        assert family.name not in found, f"{family.name} twice"
        assert len(family.samples) == 1, f"{family.name}: {family.samples}"
        assert family.type == "gauge", family.name
        sample = family.samples[0]
        assert sample.name == family.name
        found[family.name] = (sample.labels, sample.value)
    return found


def value(page: dict[str, tuple[dict[str, str], float]], name: str) -> float:
    return page[name][1]


def test_the_page_holds_exactly_the_series_the_picker_reads_one_sample_each() -> None:
    engine = FakeEngine()
    engine.scheduler = EngineLoad(waiting=3, kv_cache_usage=0.42, block_size=16, num_blocks=2048)
    with TestClient(app_with(engine)) as client:
        response = client.get("/metrics/router")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    page = parse(response.text)
    assert set(page) == PICKER_READS
    assert set(router.SERIES) == PICKER_READS
    assert value(page, "vllm:num_requests_waiting") == 3
    assert value(page, "vllm:num_requests_running") == 0
    assert value(page, "vllm:kv_cache_usage_perc") == 0.42
    assert page["vllm:cache_config_info"][0] == {"block_size": "16", "num_gpu_blocks": "2048"}
    labels, stamp = page["vllm:lora_requests_info"]
    assert labels == {"max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert abs(stamp - time.time()) < 60  # vLLM's value: the time of the update


async def test_requests_waiting_for_admission_are_counted_as_waiting() -> None:
    """One request runs (the engine's), two wait in the gateway's admission queue, one in the
    engine's queue: the picker sees 3 waiting and 1 running."""
    engine = HeldEngine()
    engine.scheduler = EngineLoad(waiting=1, block_size=16, num_blocks=64)
    app = app_with(engine, admission={"max_running": 1, "max_waiting": 5, "wait_timeout_s": 30})
    async with app.router.lifespan_context(app) as state:
        async def with_state(scope: Any, receive: Any, send: Any) -> None:
            scope["state"] = dict(state)
            await app(scope, receive, send)

        transport = httpx.ASGITransport(app=with_state)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            idle = parse((await client.get("/metrics/router")).text)
            posts = [asyncio.create_task(client.post("/v1/chat/completions", json=chat_body(max_tokens=4)))
                     for _ in range(3)]
            admission = state["gateway"].models.backends["fake-model"].admission
            await until(lambda: engine.held and admission.waiting == 2, what="1 running, 2 waiting")
            busy = parse((await client.get("/metrics/router")).text)
            engine.go.set()
            responses = await asyncio.gather(*posts)
            after = parse((await client.get("/metrics/router")).text)
    assert [r.status_code for r in responses] == [200, 200, 200]
    assert value(idle, "vllm:num_requests_waiting") == 1
    assert value(busy, "vllm:num_requests_waiting") == 1 + 2
    assert value(busy, "vllm:num_requests_running") == 1
    assert value(after, "vllm:num_requests_waiting") == 1
    assert value(after, "vllm:num_requests_running") == 0


MODELS = """
models:
  - name: chat
  - name: code
"""


def test_several_engines_make_one_series_each(tmp_path: Path) -> None:
    """Two embedded models: queues and batches added up, the fullest KV cache, the blocks added up
    with the smaller block size, the adapters' union and slots added up."""
    engines = {"chat": FakeEngine("chat"), "code": FakeEngine("code")}
    engines["chat"].scheduler = EngineLoad(
        waiting=2, kv_cache_usage=0.9, block_size=16, num_blocks=100, max_lora=2,
        running_lora_adapters=("sql",), waiting_lora_adapters=("sql", "fr"),
    )
    engines["code"].scheduler = EngineLoad(
        waiting=5, kv_cache_usage=0.1, block_size=32, num_blocks=50, max_lora=1, running_lora_adapters=("py",),
    )
    models = tmp_path / "models.yaml"
    models.write_text(MODELS)

    def start(settings: EngineSettings) -> FakeEngine:
        return engines[settings.served_model_name]

    with TestClient(create_app(fake_settings(models_file=models), engine_starter=start)) as client:
        page = parse(client.get("/metrics/router").text)
    assert value(page, "vllm:num_requests_waiting") == 7
    assert value(page, "vllm:kv_cache_usage_perc") == 0.9  # the max, not the mean (0.5)
    assert page["vllm:cache_config_info"][0] == {"block_size": "16", "num_gpu_blocks": "150"}
    assert page["vllm:lora_requests_info"][0] == {
        "max_lora": "3", "running_lora_adapters": "py,sql", "waiting_lora_adapters": "fr,sql",
    }


def test_label_values_are_escaped() -> None:
    load = EngineLoad(running_lora_adapters=('we"ird\\name',))
    page = parse(router.page([load], 0).decode())
    assert page["vllm:lora_requests_info"][0]["running_lora_adapters"] == 'we"ird\\name'


def test_no_engine_still_answers_every_series() -> None:
    """A gateway of remote models only: its admission queues, zeros for the rest."""
    page = parse(router.page([], 4, now=1.0).decode())
    assert set(page) == PICKER_READS
    assert value(page, "vllm:num_requests_waiting") == 4
    assert value(page, "vllm:kv_cache_usage_perc") == 0.0
