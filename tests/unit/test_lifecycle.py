from __future__ import annotations

import asyncio
import signal

import uvicorn
from starlette.testclient import TestClient

from gateway.app import create_app
from gateway.pipeline.lifecycle import Lifecycle
from gateway.server.http import DrainingServer
from tests.fakes import FakeEngine, fake_settings

HELLO = [{"role": "user", "content": "hi"}]


def make(engine: FakeEngine, lifecycle: Lifecycle):
    return create_app(fake_settings(), engine_starter=lambda es: engine, lifecycle=lifecycle)


def test_ready_per_model_and_draining() -> None:
    engine, lifecycle = FakeEngine(), Lifecycle()
    with TestClient(make(engine, lifecycle)) as client:
        ok = client.get("/ready")
        assert ok.status_code == 200
        assert ok.json() == {"status": "ready", "models": {"fake-model": "ready"}}
        engine.dead = True
        dead = client.get("/ready")
        assert dead.status_code == 503
        assert dead.json()["models"]["fake-model"].startswith("unavailable")
        engine.dead = False
        lifecycle.start_drain()
        assert client.get("/ready").json()["status"] == "draining"
        refused = client.post("/v1/chat/completions", json={"model": "fake-model", "messages": HELLO})
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "service_unavailable"
        assert client.get("/health").status_code == 200


def test_health_fails_when_an_embedded_engine_is_dead() -> None:
    """Liveness: a dead engine does not come back, so the orchestrator should restart the gateway."""
    engine, lifecycle = FakeEngine(), Lifecycle()
    with TestClient(make(engine, lifecycle)) as client:
        assert client.get("/health").json() == {"status": "ok"}
        engine.dead = True
        dead = client.get("/health")
        assert dead.status_code == 503
        assert dead.json()["status"] == "dead"
        assert dead.json()["models"]["fake-model"].startswith("dead: ")
        engine.dead = False
        assert client.get("/health").status_code == 200


def test_sigterm_drains_until_requests_finish() -> None:
    lifecycle = Lifecycle()
    server = DrainingServer(uvicorn.Config(app=None), lifecycle, drain_timeout_s=30)
    lifecycle.active = 2
    server.handle_exit(signal.SIGTERM, None)
    assert not server.should_exit
    asyncio.run(server.on_tick(1))
    assert lifecycle.draining
    assert not server.should_exit
    lifecycle.active = 0
    asyncio.run(server.on_tick(2))
    assert server.should_exit


def test_drain_gives_up_at_the_timeout() -> None:
    lifecycle = Lifecycle()
    server = DrainingServer(uvicorn.Config(app=None), lifecycle, drain_timeout_s=0)
    lifecycle.active = 1
    server.handle_exit(signal.SIGTERM, None)
    asyncio.run(server.on_tick(1))
    assert server.should_exit
