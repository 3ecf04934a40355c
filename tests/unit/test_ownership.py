"""Which stored objects are theirs: every action on a stored response names its owner first
(`ResponseStore.of`). Another tenant's id answers exactly as an unknown id (404, the same body),
by every way in, and touches nothing: no read, no cancel, no delete, no engine request aborted."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from gateway.errors import NotFound
from gateway.protocol.response_objects import Response
from gateway.stores.cache import MemoryCache
from gateway.stores.responses import ResponseStore, StoredResponse
from tests.fakes import FakeEngine, app_with
from tests.waits import until_sync

MODEL = "fake-model"
UNKNOWN = "resp_0123456789abcdef0123456789abcdef"
KEYS = """\
keys:
  t: {key: sk-owner}
  other: {key: sk-other}
  "t:x": {key: sk-colon}
"""


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def attempts(response_id: str) -> list[tuple[str, str, dict[str, Any] | None]]:
    """Every way a request can name a stored response."""
    follow = {"model": MODEL, "input": "and?", "previous_response_id": response_id}
    return [
        ("GET", f"/v1/responses/{response_id}", None),
        ("GET", f"/v1/responses/{response_id}?stream=true", None),
        ("GET", f"/v1/responses/{response_id}/input_items", None),
        ("GET", f"/v1/responses/{response_id}/input_items?order=desc&limit=1", None),
        ("POST", f"/v1/responses/{response_id}/cancel", None),
        ("DELETE", f"/v1/responses/{response_id}", None),
        ("POST", "/v1/responses", follow),
        ("POST", "/v1/responses", {**follow, "stream": True}),
        ("POST", "/v1/responses", {**follow, "background": True}),
    ]


def answer(client: TestClient, key: str, method: str, path: str, body: dict[str, Any] | None) -> tuple[int, Any]:
    response = client.request(method, path, json=body, headers=auth(key))
    return response.status_code, response.json()


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    path = tmp_path / "keys.yaml"
    path.write_text(textwrap.dedent(KEYS))
    return path


def test_another_tenants_ids_answer_as_unknown_ids_and_touch_nothing(keys: Path) -> None:
    engine = FakeEngine(delay=0.02)
    with TestClient(app_with(engine, keys_file=keys)) as client:
        done = client.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 16},
                           headers=auth("sk-owner")).json()
        running = client.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 25,
                                                      "background": True}, headers=auth("sk-owner")).json()
        requests_before = len(engine.requests)
        for theirs in (done["id"], running["id"]):
            for (method, path, body), (_, unknown_path, unknown_body) in zip(
                attempts(theirs), attempts(UNKNOWN), strict=True
            ):
                status, refused = answer(client, "sk-other", method, path, body)
                expected = answer(client, "sk-other", method, unknown_path, unknown_body)
                assert status == 404, (method, path, refused)
                assert (status, refused) == (expected[0], _renamed(expected[1], UNKNOWN, theirs)), (method, path)
        assert len(engine.requests) == requests_before  # no follow-up reached the engine
        assert engine.aborted == []  # the running one was not cancelled
        status_now = until_sync(lambda: (now := client.get(f"/v1/responses/{running['id']}", headers=auth("sk-owner"))
                                         .json()["status"]) not in ("queued", "in_progress") and now, what="the run over")
        assert status_now == "incomplete"  # ran to its max_output_tokens
        kept = client.get(f"/v1/responses/{done['id']}", headers=auth("sk-owner")).json()
        assert kept == done  # unchanged, not deleted
        assert client.get(f"/v1/responses/{done['id']}/input_items", headers=auth("sk-owner")).status_code == 200


def _renamed(body: Any, old: str, new: str) -> Any:
    """The unknown id's answer with the other id in its message: the same body otherwise."""
    error = dict(body["error"])
    error["message"] = error["message"].replace(old, new)
    return {"error": error}


def test_an_id_cannot_reach_into_a_tenant_whose_name_extends_the_askers(keys: Path) -> None:
    """Tenant `t` asking for `x:<id>` must not find tenant `t:x`'s `<id>` (the store keys by
    `<owner>:<id>`): an id is only ever an id."""
    with TestClient(app_with(FakeEngine(), keys_file=keys)) as client:
        theirs = client.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 16},
                             headers=auth("sk-colon")).json()["id"]
        for method, path, body in attempts(f"x:{theirs}"):
            status, refused = answer(client, "sk-owner", method, path, body)
            assert status == 404, (method, path, refused)
        assert client.get(f"/v1/responses/{theirs}", headers=auth("sk-colon")).status_code == 200


async def test_the_store_is_reached_only_through_an_owner() -> None:
    store = ResponseStore(MemoryCache(100, 1 << 20, 60))
    mine, theirs = store.of("a"), store.of("b")
    fresh = TestClient(app_with(FakeEngine()))  # only for a real Response object, made the API's way
    with fresh as client:
        made = client.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 16}).json()
    await mine.put(StoredResponse(response=Response.model_validate(made), input_items=[]))
    assert (await mine.get(made["id"])).response.id == made["id"]
    for action in (theirs.get, theirs.delete, theirs.cancel, store.of("a:x").get):
        with pytest.raises(NotFound):
            await action(made["id"])
    assert (await mine.get(made["id"])).response.id == made["id"]
    assert not [name for name in vars(ResponseStore) if name in ("get", "put", "delete", "running", "track", "cancel")]
