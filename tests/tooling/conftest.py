"""Fixtures shared by the tests of the project's tooling (k8s/, the monitoring rules, benchmarks/)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from gateway.app import create_app
from tests.fakes import FakeEngine, fake_settings


@pytest.fixture
def client() -> Iterator[TestClient]:
    """The gateway app on the fake engine (tests/fakes.py), as tests/unit's `client` builds it."""
    engine = FakeEngine()
    app = create_app(fake_settings(max_body_bytes=10_000), engine_starter=lambda es: engine)
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No GATEWAY_* variable of the machine leaks into Settings."""
    for key in list(os.environ):
        if key.startswith("GATEWAY_"):
            monkeypatch.delenv(key)
    return monkeypatch
