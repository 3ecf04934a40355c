"""Fixtures for every test folder: the app on the fake engine (tests/fakes.py) and the openai SDK on it."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from starlette.testclient import TestClient

from gateway.app import create_app
from gateway.settings import Settings
from tests.fakes import FakeEngine, fake_settings


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def settings() -> Settings:
    return fake_settings(max_body_bytes=10_000)


@pytest.fixture
def client(engine: FakeEngine, settings: Settings) -> Iterator[TestClient]:
    app = create_app(settings, engine_starter=lambda es: engine)
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


@pytest.fixture
def sdk(client: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url=str(client.base_url) + "/v1", api_key="unused", http_client=client)
