"""Several models (backends.registry, backends.modelfile): aliases, A/B splits, fallbacks, the models file."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from starlette.testclient import TestClient

from gateway.app import create_app
from gateway.backends.modelfile import ConfigError
from tests.fakes import FakeEngine, HeldEngine, chat_body, fake_settings
from tests.waits import until


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "models.yaml"
    path.write_text(text)
    return path


MODELS = """
models:
  - name: primary
    aliases: [default]
    fallback: [backup]
    admission: {max_running: 1, max_waiting: 0}
  - name: backup
  - name: chat
    kind: split
    versions: {primary: 1, backup: 1}
    sticky: true
"""


def multi_app(tmp_path: Path, engines: dict[str, FakeEngine]):
    return create_app(fake_settings(models_file=write(tmp_path, MODELS)),
                      engine_starter=lambda es: engines[es.served_model_name])


def test_models_aliases_and_listing(tmp_path: Path) -> None:
    engines = {"primary": FakeEngine("primary"), "backup": FakeEngine("backup")}
    with TestClient(multi_app(tmp_path, engines)) as client:
        ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
        assert set(ids) == {"primary", "backup", "chat", "default"}
        answer = client.post("/v1/chat/completions", json=chat_body("default"))
        assert answer.json()["model"] == "primary"
        assert answer.headers["x-served-model"] == "primary"
        assert len(engines["primary"].requests) == 1


def test_fallback_when_the_engine_is_dead(tmp_path: Path) -> None:
    engines = {"primary": FakeEngine("primary"), "backup": FakeEngine("backup")}
    engines["primary"].dead = True
    with TestClient(multi_app(tmp_path, engines)) as client:
        answer = client.post("/v1/chat/completions", json=chat_body("primary", stream=True))
        assert answer.status_code == 200
        assert answer.headers["x-served-model"] == "backup"
        assert answer.headers["x-model-version"] == "primary"
        assert '"model":"backup"' in answer.text
        metrics = client.get("/metrics").text
        assert 'gateway_fallbacks_total{fallback="backup",model="primary"} 1.0' in metrics


async def test_fallback_when_overloaded(tmp_path: Path) -> None:
    engines = {"primary": HeldEngine("primary"), "backup": FakeEngine("backup")}
    app = multi_app(tmp_path, engines)
    async with app.router.lifespan_context(app) as state:
        async def with_state(scope, receive, send):
            scope["state"] = dict(state)
            await app(scope, receive, send)

        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=with_state), base_url="http://test") as client:
            posts = [asyncio.create_task(client.post("/v1/chat/completions", json=chat_body("primary"))) for _ in range(3)]
            await until(lambda: len(engines["backup"].finished) == 2, what="two fell back while the primary is full")
            engines["primary"].go.set()
            answers = await asyncio.gather(*posts)
    served = sorted(a.headers["x-served-model"] for a in answers)
    assert all(a.status_code == 200 for a in answers)
    assert served == ["backup", "backup", "primary"]


def test_split_is_sticky_per_user_and_spreads(tmp_path: Path) -> None:
    engines = {"primary": FakeEngine("primary"), "backup": FakeEngine("backup")}
    with TestClient(multi_app(tmp_path, engines)) as client:
        versions = {client.post("/v1/chat/completions", json=chat_body("chat", user="alice")).headers["x-model-version"] for _ in range(5)}
        assert len(versions) == 1
        spread = {client.post("/v1/chat/completions", json=chat_body("chat", user=f"user-{i}")).headers["x-model-version"] for i in range(20)}
        assert spread == {"primary", "backup"}
        metrics = client.get("/metrics").text
        assert 'model="backup",route="/v1/chat/completions",status="200"' in metrics


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("models: [{name: a}, {name: a}]", "declared twice"),
        ("models: [{name: a, aliases: [b]}, {name: b}]", "declared twice"),
        ("models: [{name: a, fallback: [nope]}]", "not declared"),
        ("models: [{name: a, fallback: [b]}, {name: b, fallback: [a]}]", "loops"),
        ("models: [{name: r, kind: remote}]", "needs a url"),
        ("models: [{name: s, kind: split}]", "needs versions"),
        ("models: [{name: s, kind: split, versions: {a: -1}}, {name: a}]", "not positive"),
        ("models: [{name: a, colour: red}]", "colour"),
        ("models: [{name: a, engine: {max_model_len: many}}]", "bad engine settings"),
        ("models: {{", "not valid"),
        ("models: []", "not valid"),
    ],
)
def test_bad_models_file_is_refused_with_a_clear_message(tmp_path: Path, text: str, problem: str) -> None:
    def start() -> None:
        app = create_app(fake_settings(models_file=write(tmp_path, text)), engine_starter=lambda es: FakeEngine(es.served_model_name))
        with TestClient(app):
            pass

    with pytest.raises(ConfigError, match=problem):
        start()


def test_models_file_in_toml(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text('[[models]]\nname = "primary"\naliases = ["p"]\n')
    app = create_app(fake_settings(models_file=path), engine_starter=lambda es: FakeEngine(es.served_model_name))
    with TestClient(app) as client:
        assert client.post("/v1/chat/completions", json=chat_body("p")).status_code == 200


def test_missing_models_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        create_app(fake_settings(models_file=tmp_path / "none.yaml"))
