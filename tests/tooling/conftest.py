"""Fixtures shared by the tests of the project's tooling (k8s/, the monitoring rules, benchmarks/)."""

from __future__ import annotations

import os

import pytest


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No GATEWAY_* variable of the machine leaks into Settings."""
    for key in list(os.environ):
        if key.startswith("GATEWAY_"):
            monkeypatch.delenv(key)
    return monkeypatch
