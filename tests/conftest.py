"""Fixtures for every test folder: the app on the fake engine (tests/fakes.py) and the openai SDK on it."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import openai
import pytest
import structlog
from starlette.testclient import TestClient

from gateway.app import create_app
from gateway.settings import Settings
from gateway.telemetry import logs
from tests.fakes import FakeEngine, fake_settings

pytest_plugins = ["tests.blob_backends"]  # `blobs`: the batch lane's store on each backend


@pytest.fixture(autouse=True)
def _logging_as_it_was() -> Iterator[None]:
    """A test that runs `gateway serve` in process (logs.configure) leaves the logging as it found
    it: later tests capture log lines with structlog.testing.capture_logs."""
    access, config = logs._access, structlog.get_config()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    logs._access = access
    structlog.configure(**config)
    root.handlers[:] = handlers
    root.setLevel(level)


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
