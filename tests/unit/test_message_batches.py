"""Anthropic's Message Batches (/v1/messages/batches) on the fake engine: every answer checked against
the anthropic SDK's own types; each request answered as /v1/messages answers it, in the batch lane;
ownership (another key's batch is a 404 as an unknown one); malformed bodies; cancel; delete;
expiry; pagination; and the two Batches APIs kept apart."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic.types.messages as sdk
import pytest
from anthropic.types import Message
from starlette.testclient import TestClient

from gateway.apis.batches.batches_input import MESSAGES
from gateway.protocol.batch_objects import Batch, Owner, RequestCounts, StoredBatch
from gateway.stores.batches import MESSAGE_BATCH, new_id
from tests.fakes import FakeEngine, HeldAfter, app_with
from tests.stores import disk_batches
from tests.unit.test_batches import KEYS, chat_line, jsonl, settings
from tests.waits import until_sync

BATCHES = "/v1/messages/batches"


def params(content: str = "hi", **extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "max_tokens": 3, "messages": [{"role": "user", "content": content}], **extra}


def headers(key: str = "sk-owner") -> dict[str, str]:
    return {"x-api-key": key, "anthropic-version": "2023-06-01"}


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def client(tmp_path: Path, engine: FakeEngine) -> Iterator[TestClient]:
    with TestClient(app_with(engine, api_keys=KEYS, **settings(tmp_path))) as test_client:
        yield test_client


def create(client: TestClient, requests: list[dict[str, Any]], key: str = "sk-owner") -> sdk.MessageBatch:
    response = client.post(BATCHES, json={"requests": requests}, headers=headers(key))
    assert response.status_code == 200, response.text
    return sdk.MessageBatch.model_validate(response.json())


def retrieve(client: TestClient, batch_id: str, key: str = "sk-owner") -> sdk.MessageBatch:
    response = client.get(f"{BATCHES}/{batch_id}", headers=headers(key))
    assert response.status_code == 200, response.text
    return sdk.MessageBatch.model_validate(response.json())


def wait(client: TestClient, batch_id: str, timeout: float = 90) -> sdk.MessageBatch:
    return until_sync(lambda: (found := retrieve(client, batch_id)).processing_status == "ended" and found, timeout,
                      f"batch {batch_id} ended")


def results(client: TestClient, batch: sdk.MessageBatch) -> dict[str, sdk.MessageBatchIndividualResponse]:
    assert batch.results_url is not None
    response = client.get(batch.results_url, headers=headers())
    assert response.status_code == 200, response.text
    lines = [sdk.MessageBatchIndividualResponse.model_validate_json(line) for line in response.text.splitlines()]
    found = {line.custom_id: line for line in lines}
    assert len(found) == len(lines), "a custom_id answered twice"
    return found


def test_a_batch_answers_each_request_as_the_messages_route_would(client: TestClient, engine: FakeEngine) -> None:
    requests = [{"custom_id": "a", "params": params("one")}, {"custom_id": "b-2", "params": params("two two")},
                {"custom_id": "missing", "params": params(model="no-such-model")},
                {"custom_id": "streamed", "params": params(stream=True)},
                {"custom_id": "bad_params", "params": {"model": "fake-model", "messages": []}}]
    batch = create(client, requests)
    assert batch.id.startswith("msgbatch_")
    assert (batch.type, batch.processing_status, batch.results_url, batch.ended_at) == (
        "message_batch", "in_progress", None, None)
    assert batch.request_counts.processing == 5
    assert (batch.expires_at - batch.created_at).total_seconds() == 86400
    done = wait(client, batch.id)
    assert done.request_counts.model_dump() == {"processing": 0, "succeeded": 2, "errored": 3, "canceled": 0,
                                                "expired": 0}
    assert done.ended_at is not None
    assert done.results_url == f"{BATCHES}/{batch.id}/results"
    found = results(client, done)
    assert set(found) == {"a", "b-2", "missing", "streamed", "bad_params"}
    interactive = client.post("/v1/messages", json=params("two two"), headers=headers())
    answer = found["b-2"].result
    assert isinstance(answer, sdk.MessageBatchSucceededResult)
    assert isinstance(answer.message, Message)
    expected = Message.model_validate(interactive.json())
    assert answer.message.content == expected.content
    assert answer.message.usage == expected.usage
    assert answer.message.id != expected.id
    errors = {c: found[c].result for c in ("missing", "streamed", "bad_params")}
    assert all(isinstance(e, sdk.MessageBatchErroredResult) for e in errors.values())
    kinds = {c: e.error.error.type for c, e in errors.items() if isinstance(e, sdk.MessageBatchErroredResult)}
    assert kinds == {"missing": "not_found_error", "streamed": "invalid_request_error",
                     "bad_params": "invalid_request_error"}
    streamed = errors["streamed"]
    assert isinstance(streamed, sdk.MessageBatchErroredResult)
    assert "stream" in streamed.error.error.message
    # the requests ran in the batch lane; the interactive one did not
    assert len([r for r in engine.requests if r.priority == 2]) == 2
    assert engine.requests[-1].priority == 0


@pytest.mark.parametrize(("body", "param"), [
    ({"requests": []}, "requests"),
    ({}, "requests"),
    ({"requests": [{"custom_id": "has space", "params": params()}]}, "custom_id"),
    ({"requests": [{"custom_id": "x" * 65, "params": params()}]}, "custom_id"),
    ({"requests": [{"custom_id": "", "params": params()}]}, "custom_id"),
    ({"requests": [{"custom_id": "a", "params": params()}, {"custom_id": "a", "params": params()}]}, "unique"),
    ({"requests": [{"custom_id": "a"}]}, "params"),
    ({"requests": [{"custom_id": "a", "params": "text"}]}, "params"),
    ({"requests": [{"custom_id": "a", "params": params(), "extra": 1}]}, "extra"),
    ({"requests": [{"custom_id": "a", "params": params(n=2**70)}]}, "out of range"),
])
def test_a_malformed_create_is_a_400_in_anthropics_shape(client: TestClient, body: dict[str, Any], param: str) -> None:
    response = client.post(BATCHES, json=body, headers=headers())
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error"
    assert param in error["error"]["message"]
    assert client.get(BATCHES, headers=headers()).json()["data"] == []


def test_too_many_requests_is_a_400(tmp_path: Path) -> None:
    with TestClient(app_with(FakeEngine(), files={"dir": tmp_path / "files", "max_lines": 2},
                             batches={"dir": tmp_path / "batches"})) as client:
        response = client.post(BATCHES, json={"requests": [{"custom_id": f"r{i}", "params": params()}
                                                           for i in range(3)]})
    assert response.status_code == 400
    assert "at most 2" in response.json()["error"]["message"]


def test_another_keys_batch_is_not_found_as_an_unknown_one(client: TestClient) -> None:
    batch = create(client, [{"custom_id": "a", "params": params()}])
    unknown = "msgbatch_" + "0" * 32
    for batch_id in (batch.id, unknown, "msgbatch_../../x", "batch_" + batch.id.removeprefix("msgbatch_")):
        for method, path in (("GET", ""), ("POST", "/cancel"), ("GET", "/results"), ("DELETE", "")):
            response = client.request(method, f"{BATCHES}/{batch_id}{path}", headers=headers("sk-other"))
            assert response.status_code == 404, (method, path, response.text)
            assert response.json()["error"]["type"] == "not_found_error"
            if batch_id == unknown:
                assert response.json() == client.request(method, f"{BATCHES}/{batch.id}{path}",
                                                         headers=headers("sk-other")).json() | {
                    "error": {"type": "not_found_error", "message": f"No batch found with id '{unknown}'."}}
    assert client.get(BATCHES, headers=headers("sk-other")).json()["data"] == []
    assert wait(client, batch.id).request_counts.succeeded == 1


def test_the_two_batches_apis_do_not_see_each_others_batches(client: TestClient) -> None:
    batch = create(client, [{"custom_id": "a", "params": params()}])
    wait(client, batch.id)
    owner = {"authorization": "Bearer sk-owner"}
    assert client.get("/v1/batches", headers=owner).json()["data"] == []
    assert client.get(f"/v1/batches/{batch.id}", headers=owner).status_code == 404
    assert client.get("/v1/files", headers=owner).json()["data"] == []  # no input or results file among the key's
    made = client.post("/v1/files", files={"file": ("in.jsonl", jsonl(chat_line("a")))}, data={"purpose": "batch"},
                       headers=owner).json()
    openai_batch = client.post("/v1/batches", json={"input_file_id": made["id"], "endpoint": "/v1/chat/completions",
                                                    "completion_window": "24h"}, headers=owner).json()
    assert [b["id"] for b in client.get(BATCHES, headers=headers()).json()["data"]] == [batch.id]
    assert client.get(f"{BATCHES}/{openai_batch['id']}", headers=headers()).status_code == 404


def test_a_messages_line_in_an_uploaded_file_is_refused(client: TestClient) -> None:
    line = {"custom_id": "a", "method": "POST", "url": MESSAGES, "body": params()}
    response = client.post("/v1/files", files={"file": ("in.jsonl", jsonl(line))}, data={"purpose": "batch"},
                           headers={"authorization": "Bearer sk-owner"})
    assert response.status_code == 400
    assert "url" in response.json()["error"]["message"]


def test_list_pages_with_after_id_and_before_id(client: TestClient) -> None:
    ids = [create(client, [{"custom_id": "a", "params": params()}]).id for _ in range(5)][::-1]  # newest first

    def page(query: str) -> dict[str, Any]:
        response = client.get(f"{BATCHES}?{query}", headers=headers())
        assert response.status_code == 200, response.text
        return dict(response.json())

    first = page("limit=2")
    assert [b["id"] for b in first["data"]] == ids[:2]
    assert (first["has_more"], first["first_id"], first["last_id"]) == (True, ids[0], ids[1])
    for item in first["data"]:
        sdk.MessageBatch.model_validate(item)
    assert [b["id"] for b in page(f"limit=2&after_id={ids[1]}")["data"]] == ids[2:4]
    last = page(f"limit=2&after_id={ids[3]}")
    assert ([b["id"] for b in last["data"]], last["has_more"]) == (ids[4:], False)
    before = page(f"limit=2&before_id={ids[3]}")
    assert ([b["id"] for b in before["data"]], before["has_more"]) == (ids[1:3], True)
    assert page(f"limit=5&before_id={ids[1]}")["has_more"] is False
    assert [b["id"] for b in page("")["data"]] == ids
    for query in ("limit=0", "limit=1001", "after_id=msgbatch_nope", f"after_id={ids[0]}&before_id={ids[1]}"):
        response = client.get(f"{BATCHES}?{query}", headers=headers())
        assert response.status_code == 400, query
        assert response.json()["type"] == "error"


def test_cancel_ends_the_batch_and_the_unrun_requests_are_canceled(tmp_path: Path) -> None:
    engine = HeldAfter(2)  # two answered, two held in flight until the cancel
    with TestClient(app_with(engine, **settings(tmp_path, max_in_flight=2))) as client:
        requests = [{"custom_id": f"r{i}", "params": params(max_tokens=8)} for i in range(20)]
        batch = create(client, requests)
        until_sync(lambda: retrieve(client, batch.id).request_counts.succeeded >= 2, what="2 requests done")
        until_sync(lambda: engine.started == 4, what="two requests held in flight")
        assert client.get(f"{BATCHES}/{batch.id}/results").status_code == 400  # not ended yet
        assert client.delete(f"{BATCHES}/{batch.id}").status_code == 400  # nor can it be deleted
        response = client.post(f"{BATCHES}/{batch.id}/cancel")
        assert response.status_code == 200, response.text
        canceling = sdk.MessageBatch.model_validate(response.json())
        assert canceling.processing_status in ("canceling", "ended")
        assert canceling.cancel_initiated_at is not None
        done = wait(client, batch.id)
        counts = done.request_counts
        assert counts.succeeded == 2
        assert counts.canceled == 20 - counts.succeeded - counts.errored > 0
        assert counts.processing == counts.expired == 0
        found = results(client, done)
        assert set(found) == {f"r{i}" for i in range(20)}
        assert sum(isinstance(r.result, sdk.MessageBatchCanceledResult) for r in found.values()) == counts.canceled
        assert engine.aborted
        deleted = client.delete(f"{BATCHES}/{batch.id}")
        assert deleted.status_code == 200
        assert sdk.DeletedMessageBatch.model_validate(deleted.json()).id == batch.id
        assert client.get(f"{BATCHES}/{batch.id}").status_code == 404
        assert client.get(BATCHES).json()["data"] == []


def test_an_expired_batch_ends_with_expired_results(tmp_path: Path) -> None:
    store, now = disk_batches(tmp_path / "batches"), int(time.time())
    batch_id = new_id(MESSAGE_BATCH)
    batch = Batch(id=batch_id, endpoint=MESSAGES, input_file_id=batch_id, status="validating", created_at=now - 86400,
                  expires_at=now - 1, request_counts=RequestCounts(total=2))
    stored = StoredBatch(batch=batch, owner=Owner(key_id="anonymous", tenant="anonymous"), output_expires_after_s=3600)
    lines = b"".join(json.dumps({"custom_id": c, "method": "POST", "url": MESSAGES, "body": params()}).encode() + b"\n"
                     for c in ("a", "b"))
    asyncio.run(store.of("anonymous", MESSAGE_BATCH).create(stored, lines))
    with TestClient(app_with(FakeEngine(), **settings(tmp_path))) as client:
        done = wait(client, batch_id)
        found = results(client, done)
    assert done.request_counts.model_dump() == {"processing": 0, "succeeded": 0, "errored": 0, "canceled": 0,
                                                "expired": 2}
    assert all(isinstance(r.result, sdk.MessageBatchExpiredResult) for r in found.values())
