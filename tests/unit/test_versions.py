"""Model versions (backends.versions, the models file, the registry): SemVer requests, the newest
stable by default, pre-releases only when named, listing, headers, splits and fallbacks by version."""

from __future__ import annotations

from pathlib import Path

import pytest
from starlette.testclient import TestClient

from gateway.app import create_app
from gateway.backends.modelfile import ConfigError
from gateway.backends.versions import Catalog, VersionNotFound
from tests.fakes import FakeEngine, chat_body, fake_settings

MODELS = """
models:
  - name: smol
    version: 1.3.0
  - name: smol
    version: 1.4.2
    aliases: [smol-stable]
    fallback: [smol@1.3]
  - name: smol
    version: 1.10.0-beta.1
  - name: smol
    version: 2.0.0-rc.1
  - name: canary
    kind: split
    versions: {smol@1.4: 3, smol@2.0.0-rc.1: 1}
    sticky: true
"""


@pytest.fixture
def catalog() -> Catalog:
    found = Catalog()
    for version in ("1.3.0", "1.4.2", "1.4.10", "1.10.0-beta.1", "2.0.0-rc.1", "0.9.0"):
        found.add("smol", version)
    return found


@pytest.mark.parametrize(
    ("requested", "chosen"),
    [
        ("smol", "smol@1.4.10"),  # newest stable: 1.4.10 > 1.4.2 by SemVer, not by text
        ("smol@1", "smol@1.4.10"),  # 1.10.0-beta.1 is newer but a pre-release
        ("smol@1.4", "smol@1.4.10"),
        ("smol@1.3", "smol@1.3.0"),
        ("smol@0", "smol@0.9.0"),
        ("smol@1.4.2", "smol@1.4.2"),
        ("smol@2.0.0-rc.1", "smol@2.0.0-rc.1"),  # a pre-release, asked for exactly
        ("smol@1.10.0-beta.1", "smol@1.10.0-beta.1"),
        ("smol@1.4.2+build.7", "smol@1.4.2"),  # build metadata does not count (SemVer)
        ("other", None),  # not a versioned model: the registry decides
    ],
)
def test_lookup(catalog: Catalog, requested: str, chosen: str | None) -> None:
    assert catalog.lookup(requested) == chosen


@pytest.mark.parametrize(
    ("requested", "says"),
    [
        ("smol@2", "does not exist"),  # only a pre-release of 2: never chosen by a range
        ("smol@1.5", "does not exist"),
        ("smol@1.4.3", "does not exist"),
        ("smol@2.0.0", "does not exist"),
        ("smol@latest", "is not a version"),
        ("smol@1.x", "is not a version"),
    ],
)
def test_lookup_refuses_with_the_versions_that_exist(catalog: Catalog, requested: str, says: str) -> None:
    with pytest.raises(VersionNotFound, match=says) as caught:
        catalog.lookup(requested)
    assert "0.9.0, 1.3.0, 1.4.2, 1.4.10, 1.10.0-beta.1, 2.0.0-rc.1" in str(caught.value)


def test_only_pre_releases_are_never_a_default() -> None:
    catalog = Catalog()
    catalog.add("next", "3.0.0-alpha.1")
    with pytest.raises(VersionNotFound, match="no stable version"):
        catalog.lookup("next")
    assert catalog.lookup("next@3.0.0-alpha.1") == "next@3.0.0-alpha.1"


def app_of(tmp_path: Path, engines: dict[str, FakeEngine]):
    path = tmp_path / "models.yaml"
    path.write_text(MODELS)
    return create_app(fake_settings(models_file=path), engine_starter=lambda es: engines[es.served_model_name])


@pytest.fixture
def engines() -> dict[str, FakeEngine]:
    ids = ("smol@1.3.0", "smol@1.4.2", "smol@1.10.0-beta.1", "smol@2.0.0-rc.1")
    return {id_: FakeEngine(id_) for id_ in ids}


def test_requests_by_version_say_which_version_answered(tmp_path: Path, engines: dict[str, FakeEngine]) -> None:
    with TestClient(app_of(tmp_path, engines)) as client:
        for asked, served in [("smol", "smol@1.4.2"), ("smol@1", "smol@1.4.2"), ("smol@1.3", "smol@1.3.0"),
                              ("smol@2.0.0-rc.1", "smol@2.0.0-rc.1"), ("smol-stable", "smol@1.4.2")]:
            answer = client.post("/v1/chat/completions", json=chat_body(asked))
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-model-version"] == served
            assert answer.headers["x-served-model"] == served
            assert answer.json()["model"] == served
        assert len(engines["smol@1.4.2"].requests) == 3
        assert len(engines["smol@1.10.0-beta.1"].requests) == 0
        native = client.post("/generate", json={"model": "smol@1.3", "prompt": "hi", "max_tokens": 2})
        assert native.headers["x-model-version"] == "smol@1.3.0"
        metrics = client.get("/metrics").text
        assert 'gateway_requests_total{model="smol@1.4.2",route="/v1/chat/completions",status="200"} 3.0' in metrics


def test_unknown_or_unsatisfiable_version_is_404_naming_the_versions(tmp_path: Path, engines: dict[str, FakeEngine]) -> None:
    with TestClient(app_of(tmp_path, engines)) as client:
        for asked in ("smol@3", "smol@2", "smol@1.4.9", "smol@newest"):
            answer = client.post("/v1/chat/completions", json=chat_body(asked))
            error = answer.json()["error"]
            assert answer.status_code == 404
            assert error["code"] == "model_not_found"
            assert error["param"] == "model"
            assert "1.3.0, 1.4.2, 1.10.0-beta.1, 2.0.0-rc.1" in error["message"]
        assert client.post("/tokenize", json={"model": "smol@9", "prompt": "a"}).status_code == 404
        assert client.post("/v1/chat/completions", json=chat_body("ghost@1")).json()["error"]["code"] == "model_not_found"


def test_models_lists_every_version(tmp_path: Path, engines: dict[str, FakeEngine]) -> None:
    with TestClient(app_of(tmp_path, engines)) as client:
        cards = {card["id"]: card for card in client.get("/v1/models").json()["data"]}
    assert set(cards) == {"smol@1.3.0", "smol@1.4.2", "smol@1.10.0-beta.1", "smol@2.0.0-rc.1", "smol",
                          "smol-stable", "canary"}
    assert cards["smol@2.0.0-rc.1"]["version"] == "2.0.0-rc.1"
    assert cards["smol"]["root"] == "smol@1.4.2"  # what `smol` alone answers with
    assert cards["smol-stable"]["root"] == "smol@1.4.2"


def test_splits_and_fallbacks_name_versions(tmp_path: Path, engines: dict[str, FakeEngine]) -> None:
    engines["smol@1.4.2"].dead = True
    with TestClient(app_of(tmp_path, engines)) as client:
        answer = client.post("/v1/chat/completions", json=chat_body("smol@1.4"))
        assert answer.status_code == 200
        assert answer.headers["x-model-version"] == "smol@1.4.2"
        assert answer.headers["x-served-model"] == "smol@1.3.0"
        chosen = {client.post("/v1/chat/completions", json=chat_body("canary", user=f"u{i}")).headers["x-model-version"]
                  for i in range(30)}
    assert chosen == {"smol@1.4.2", "smol@2.0.0-rc.1"}  # 1.4 resolved to 1.4.2 at start


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("models: [{name: a, version: 1.4}]", "not a semantic version"),
        ("models: [{name: a, version: latest}]", "not a semantic version"),
        ("models: [{name: a, version: 1.0.0}, {name: a, version: 1.0.0}]", "version 1.0.0 twice"),
        ("models: [{name: a, version: 1.0.0}, {name: a}]", "declared twice"),
        ("models: [{name: a}, {name: b, version: 1.0.0, aliases: [a]}]", "declared twice"),
        ("models: [{name: a@1, version: 1.0.0}]", "has an '@'"),
        ("models: [{name: a, aliases: [a@2]}]", "has an '@'"),
        ("models: [{name: a, version: 1.0.0, aliases: [a]}]", "declared twice"),
        ("models: [{name: a, version: 1.0.0}, {name: s, kind: split, version: 1.0.0, versions: {a: 1}}]",
         "cannot have a version"),
        ("models: [{name: a, version: 1.0.0}, {name: b, fallback: [a@2]}]", "a has versions 1.0.0"),
        ("models: [{name: a, version: 2.0.0-rc.1}, {name: b, fallback: [a]}]", "no stable version"),
    ],
)
def test_bad_versions_are_refused_at_start(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "models.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=problem):
        create_app(fake_settings(models_file=path), engine_starter=lambda es: FakeEngine(es.served_model_name))
