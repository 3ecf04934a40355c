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


def _plain_tracebacks() -> None:
    """structlog's default renderer, which the tests' log lines go through unless a test sets up logging, prints an
    exception with rich: every frame's source highlighted, and its locals: seconds a logged server error on this
    machine (most of a test that answers a 500). The same renderer with a plain traceback. Tests read log lines with
    structlog.testing.capture_logs or in the production set-up (gateway.telemetry.logs.configure), never rich's
    rendering; a failing test still shows the traceback."""
    processors = list(structlog.get_config()["processors"])
    if isinstance(processors[-1], structlog.dev.ConsoleRenderer):
        processors[-1] = structlog.dev.ConsoleRenderer(exception_formatter=structlog.dev.plain_traceback)
        structlog.configure(processors=processors)


_plain_tracebacks()  # once a process: `_logging_as_it_was` puts it back after each test


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
