"""Anthropic's Message Batches attacked as a careless client and a second tenant would (through the
official `anthropic` SDK where it can): each request's model and text pass what /v1/messages passes,
per request, in Anthropic's shape; nothing is run that the create body did not say; error messages
echo no huge input; another tenant's ids, and the other API's, are unknown ids everywhere; a
batch deleted meanwhile is a 404, never a 500."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest
from starlette.testclient import TestClient

from tests.fakes import FakeEngine, app_with
from tests.unit.test_batches import KEYS, settings
from tests.unit.test_message_batches import BATCHES, create, headers, params, retrieve, wait

JSON = {"content-type": "application/json"}


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    with TestClient(app_with(FakeEngine(), api_keys=KEYS, **settings(tmp_path))) as test_client:
        yield test_client


def claude(client: TestClient, key: str = "sk-owner") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=str(client.base_url), api_key=key, http_client=client, max_retries=0)


def results_of(client: TestClient, batch_id: str, key: str = "sk-owner") -> dict[str, Any]:
    done = wait(client, batch_id) if key == "sk-owner" else None
    assert done is None or done.processing_status == "ended"
    lines = claude(client, key).messages.batches.results(batch_id)
    return {line.custom_id: line.result for line in lines}


# --- what runs is what the create body said ---------------------------------------------------------


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_a_number_json_has_not_is_refused_not_run_as_null(client: TestClient, number: str) -> None:
    """Python's JSON reader takes NaN and Infinity (and 1e400 as infinity), JSON Lines cannot keep
    them (written as null): the request would run with a parameter it did not ask for (a
    temperature of NaN, which /v1/messages refuses, run as the default)."""
    asked = '{"model": "fake-model", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}], "temperature": %s}'
    assert client.post("/v1/messages", content=asked % number, headers={**headers(), **JSON}).status_code == 400
    body = '{"requests": [{"custom_id": "a", "params": {}}, {"custom_id": "b", "params": %s}]}' % (asked % number)
    response = client.post(BATCHES, content=body, headers={**headers(), **JSON})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert "requests.1.params" in response.json()["error"]["message"]
    assert client.get(BATCHES, headers=headers()).json()["data"] == []


# --- a batch deleted meanwhile: a 404, never a 500 ---------------------------------------------------


@pytest.mark.parametrize(("method", "path"), [("GET", ""), ("POST", "/cancel"), ("GET", "/results"), ("DELETE", "")])
def test_a_batch_deleted_between_lookup_and_read_is_a_404(client: TestClient, monkeypatch: pytest.MonkeyPatch,
                                                         method: str, path: str) -> None:
    """Two clients (or a retried DELETE) on one batch: the other deletes it after this request
    found it and before it read it."""
    import shutil

    from gateway.stores.batches import BatchDir

    batch = create(client, [{"custom_id": "a", "params": params()}])
    wait(client, batch.id)
    read = BatchDir.read

    def deleted_first(self: BatchDir) -> Any:
        shutil.rmtree(self.path, ignore_errors=True)
        return read(self)

    monkeypatch.setattr(BatchDir, "read", deleted_first)
    response = client.request(method, f"{BATCHES}/{batch.id}{path}", headers=headers())
    assert response.status_code == 404, response.text
    assert response.json()["error"] == {"type": "not_found_error", "message": f"No batch found with id '{batch.id}'."}


def test_results_already_streaming_survive_a_delete(client: TestClient, tmp_path: Path) -> None:
    """The results' files are opened before the answer starts: a delete then does not cut the JSONL
    short after a 200 (the server's error, mid-stream)."""
    import shutil

    from gateway.serving import message_batches as mb
    from gateway.stores.batches import BatchDir

    batch = create(client, [{"custom_id": f"r{i}", "params": params()} for i in range(3)] +
                   [{"custom_id": "bad", "params": params(model="nope")}])
    wait(client, batch.id)
    (home,) = (tmp_path / "batches").glob(f"*/{batch.id}")
    found = BatchDir(home)
    lines = mb.results(found, found.read())
    shutil.rmtree(found.path)
    assert sorted(json.loads(line)["custom_id"] for line in lines) == ["bad", "r0", "r1", "r2"]


# --- cancel: twice while it runs, and after it ended ---------------------------------------------------


def test_cancel_twice_keeps_its_first_time_and_a_cancel_after_the_end_speaks_anthropics_words(tmp_path: Path) -> None:
    engine = FakeEngine(delay=0.05)
    with TestClient(app_with(engine, api_keys=KEYS, **settings(tmp_path, max_in_flight=1))) as client:
        claude_sdk = claude(client)
        batch = create(client, [{"custom_id": f"r{i}", "params": params()} for i in range(20)])
        first = claude_sdk.messages.batches.cancel(batch.id)
        again = claude_sdk.messages.batches.cancel(batch.id)
        assert first.cancel_initiated_at is not None
        assert again.cancel_initiated_at == first.cancel_initiated_at
        done = wait(client, batch.id)
        assert done.cancel_initiated_at == first.cancel_initiated_at
        assert done.request_counts.canceled > 0
        with pytest.raises(anthropic.BadRequestError) as refused:
            claude_sdk.messages.batches.cancel(batch.id)
        message = refused.value.body["error"]["message"]  # type: ignore[index]
        assert "has already ended" in message
        assert "cancelled" not in message  # OpenAI's status words
        assert retrieve(client, batch.id) == done


# --- error messages: no huge echo of what was sent ---------------------------------------------------

HUGE = "Z" * 200_000
BOUND = 2_000  # characters of an error object: the message and param that quote the input are bounded


def test_error_messages_do_not_echo_huge_inputs(client: TestClient) -> None:
    """A name, key or id of any length is quoted in part: an error (and a batch's result line) stays
    small whatever was sent, and still says which input it is about."""
    asked = {"requests": [{"custom_id": "a", "params": params()}], HUGE: 1}
    refusals = [
        client.post(BATCHES, json=asked, headers=headers()),
        client.get(f"{BATCHES}?before_id={HUGE[:20_000]}", headers=headers()),
        client.get(f"{BATCHES}/msgbatch_{HUGE[:20_000]}", headers=headers()),
        client.post("/v1/messages", json=params(**{HUGE: 1}), headers=headers()),
        client.post("/v1/chat/completions", json={"model": HUGE, "messages": [{"role": "user", "content": "hi"}]},
                    headers={"authorization": "Bearer sk-owner"}),
    ]
    for response in refusals:
        assert 400 <= response.status_code < 500, response.text[:200]
        assert len(response.content) < BOUND, response.text[:200]
        assert "ZZZZ" in response.text
    batch = create(client, [{"custom_id": "model", "params": params(model=HUGE)},
                            {"custom_id": "key", "params": params(**{HUGE: 1})},
                            {"custom_id": "tag", "params": params(tool_choice={"type": HUGE})}])
    found = results_of(client, batch.id)
    for custom_id, result in found.items():
        assert result.type == "errored", custom_id
        assert len(result.error.error.message) < BOUND, custom_id
        assert "ZZZZ" in result.error.error.message
    assert "does not exist" in found["model"].error.error.message  # the end of the message is kept
