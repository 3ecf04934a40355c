from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from starlette.testclient import TestClient

from gateway.app import create_app
from gateway.settings import Settings
from tests.fakes import FakeEngine


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def settings() -> Settings:
    return Settings(max_body_bytes=10_000, warmup=False)


@pytest.fixture
def client(engine: FakeEngine, settings: Settings) -> Iterator[TestClient]:
    app = create_app(settings, engine_factory=lambda s: {engine.info.name: engine})
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


@pytest.fixture
def sdk(client: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url=str(client.base_url) + "/v1", api_key="unused", http_client=client)
