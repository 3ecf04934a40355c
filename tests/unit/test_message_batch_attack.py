"""Anthropic's Message Batches attacked as a careless client and a second tenant would (through the
official `anthropic` SDK where it can): each request's model and text pass what /v1/messages passes,
per request, in Anthropic's shape; nothing is run that the create body did not say; error messages
echo no huge input; another tenant's ids, and the other API's, are unknown ids everywhere; a
batch deleted meanwhile is a 404, never a 500."""

from __future__ import annotations

import asyncio
import json
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import anthropic.types.messages as sdk
import pytest
from starlette.testclient import TestClient

from gateway.app import create_app
from gateway.stores.batchdb import SqliteRecords
from gateway.stores.batches import input_name
from tests.fakes import FakeEngine, app_with, fake_settings
from tests.stores import disk_batches, record
from tests.unit.test_batches import KEYS, settings
from tests.unit.test_message_batches import BATCHES, create, headers, params, retrieve, wait
from tests.unit.test_reach import MODELS, REFERENCES, _engines
from tests.unit.test_tenants import keys_file
from tests.waits import until_sync

JSON = {"content-type": "application/json"}


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    with TestClient(app_with(FakeEngine(), api_keys=KEYS, **settings(tmp_path))) as test_client:
        yield test_client


def claude(client: TestClient, key: str = "sk-owner") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=str(client.base_url), api_key=key, http_client=client, max_retries=0)


def ended(client: TestClient, batch_id: str, key: str = "sk-owner", timeout: float = 90) -> sdk.MessageBatch:
    return until_sync(lambda: (found := retrieve(client, batch_id, key)).processing_status == "ended" and found,
                      timeout, f"batch {batch_id} ended")


def results_of(client: TestClient, batch_id: str, key: str = "sk-owner") -> dict[str, Any]:
    """The batch's results once it has ended, read by the SDK (`client.messages.batches.results`)."""
    ended(client, batch_id, key)
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



# --- which models: every way a request names one, per request, in Anthropic's shape -------------------


def test_a_requests_model_reaches_only_what_the_key_may_use(tmp_path: Path) -> None:
    """The narrow key of test_reach: each reference one request of one batch, errored exactly as
    /v1/messages refuses it (a denied model is the same not_found_error as one that does not exist),
    and no engine the key may not use runs."""
    engines = _engines()
    (tmp_path / "models.yaml").write_text(MODELS)
    keys = keys_file(tmp_path, "keys:\n  narrow: {key: sk-narrow, models: [small, assistant@1, vec]}\n")
    app = create_app(fake_settings(models_file=tmp_path / "models.yaml", keys_file=keys, **settings(tmp_path)),
                     engine_starter=lambda es: engines[es.served_model_name])
    with TestClient(app) as client:
        requests = [{"custom_id": f"r{n}", "params": params(model=reference)} for n, (reference, _) in enumerate(REFERENCES)]
        batch = create(client, [*requests, {"custom_id": "vec", "params": params(model="vec")}], key="sk-narrow")
        found = results_of(client, batch.id, "sk-narrow")
        interactive = {reference: client.post("/v1/messages", json=params(model=reference), headers=headers("sk-narrow"))
                       for reference, reaches in REFERENCES if reaches is None}
    for n, (reference, reaches) in enumerate(REFERENCES):
        result = found[f"r{n}"]
        if reaches is None:
            assert isinstance(result, sdk.MessageBatchErroredResult), reference
            assert result.error.model_dump(exclude={"request_id"}) == interactive[reference].json(), reference
            assert result.error.error.type == "not_found_error"
        else:
            assert isinstance(result, sdk.MessageBatchSucceededResult), reference
            assert result.message.model == reaches, reference
    embedding = found["vec"]
    assert isinstance(embedding, sdk.MessageBatchErroredResult)
    assert embedding.error.error.type == "invalid_request_error"
    assert not engines["big"].requests
    assert not engines["assistant@2.0.0"].requests
    assert not engines["vec"].requests


# --- guards: every field of params, disguised ------------------------------------------------------

GUARDS = """
profiles:
  strict:
    input:
      deny: ["(?i)project hydra"]
    output:
      deny: [{pattern: "(?i)confidential", action: redact, name: secret}]
"""
DISGUISES = {"plain": "Project Hydra", "zero-width": "project\u200b hydra", "fullwidth": "project \uff48\uff59\uff44\uff52\uff41",
             "cyrillic a": "project hydr\u0430", "soft hyphen": "pro\u00adject hydra", "nbsp": "project\u00a0hydra"}


def _placed(text: str) -> dict[str, dict[str, Any]]:
    """The ways into a Messages request's prompt, each carrying `text`."""
    tool = {"name": "t", "input_schema": {"type": "object"}}
    return {
        "message": params(text),
        "block": params([{"type": "text", "text": text}]),
        "system": params("hello", system=text),
        "system block": params("hello", system=[{"type": "text", "text": text}]),
        "tool description": params("hello", tools=[{**tool, "description": text}]),
        "tool schema": params("hello", tools=[{"name": "t", "input_schema": {
            "type": "object", "properties": {"x": {"type": "string", "description": text}}}}]),
        "tool result": {**params("x"), "tools": [tool], "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "t", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": text}]}]},
    }


def test_a_requests_text_passes_the_keys_guards_in_every_field(tmp_path: Path) -> None:
    (tmp_path / "guards.yaml").write_text(textwrap.dedent(GUARDS))
    keys = keys_file(tmp_path, "keys:\n  guarded: {key: sk-g, guards: strict}\n")
    engine = FakeEngine()
    engine.reply = ["the", " confidential", " plan"]
    app = app_with(engine, keys_file=keys, guards_file=tmp_path / "guards.yaml", **settings(tmp_path))
    asked = {f"{way}:{name}".replace(" ", "_").replace(":", "-"): body
             for name, text in DISGUISES.items() for way, body in _placed(text).items()}
    with TestClient(app) as client:
        statuses = {custom_id: client.post("/v1/messages", json=body, headers=headers("sk-g")).status_code
                    for custom_id, body in asked.items()}
        batch = create(client, [{"custom_id": c, "params": body} for c, body in asked.items()] +
                       [{"custom_id": "answered", "params": params("hello")}], key="sk-g")
        found = results_of(client, batch.id, "sk-g")
    assert set(statuses.values()) == {400}
    for custom_id in asked:
        result = found[custom_id]
        assert isinstance(result, sdk.MessageBatchErroredResult), custom_id
        assert result.error.error.type == "invalid_request_error"
    answered = found["answered"]
    assert isinstance(answered, sdk.MessageBatchSucceededResult)
    assert "confidential" not in json.dumps(answered.message.model_dump())


# --- logs: no prompt, output, key or huge echo -------------------------------------------------------


def test_a_message_batch_logs_no_prompt_output_or_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import logging

    from gateway.telemetry.logs import configure

    configure("debug", "json")
    try:
        engine = FakeEngine()
        engine.reply = ["SECRET-OUTPUT-0815"]
        with TestClient(app_with(engine, api_keys=["sk-LEAK-4711"], **settings(tmp_path))) as client:
            prompt = "PRIVATE-PROMPT-1234"
            batch = create(client, [
                {"custom_id": "ok", "params": params(prompt, system=prompt)},
                {"custom_id": "model", "params": params(prompt, model=prompt)},
                {"custom_id": "bad", "params": params(prompt, max_tokens=-1, metadata={prompt: prompt})},
                {"custom_id": "streamed", "params": params(prompt, stream=True)},
            ], key="sk-LEAK-4711")
            done = ended(client, batch.id, "sk-LEAK-4711")
            assert done.request_counts.succeeded == 1
            refused = client.post(BATCHES, json={"requests": [{"custom_id": prompt + "!", "params": params(prompt)}]},
                                  headers=headers("sk-LEAK-4711"))
            assert refused.status_code == 400
    finally:
        logging.getLogger().handlers.clear()
    captured = capsys.readouterr()
    logged = captured.out + captured.err
    assert "batch_completed" in logged
    for secret in ("PRIVATE-PROMPT", "SECRET-OUTPUT", "sk-LEAK-4711"):
        assert secret not in logged


# --- who is asking: tenants, the other API, keys removed ----------------------------------------------


def test_another_tenants_ids_are_unknown_ids_on_every_way_in(client: TestClient) -> None:
    mine = create(client, [{"custom_id": "a", "params": params()}])
    theirs = create(client, [{"custom_id": "a", "params": params()}], key="sk-other")
    wait(client, mine.id)
    unknown = "msgbatch_" + "0" * 32
    for cursor in ("after_id", "before_id"):
        foreign = client.get(f"{BATCHES}?{cursor}={theirs.id}", headers=headers())
        nothing = client.get(f"{BATCHES}?{cursor}={unknown}", headers=headers())
        assert foreign.status_code == nothing.status_code == 400
        assert foreign.json()["error"]["message"] == nothing.json()["error"]["message"].replace(unknown, theirs.id)
    owner = {"authorization": "Bearer sk-owner"}
    for method, path in (("GET", f"/v1/batches/{mine.id}"), ("POST", f"/v1/batches/{mine.id}/cancel"),
                         ("GET", f"/v1/files/{mine.id}"), ("GET", f"/v1/files/{mine.id}/content"),
                         ("DELETE", f"/v1/files/{mine.id}")):
        assert client.request(method, path, headers=owner).status_code == 404, (method, path)
    made = client.post("/v1/batches", json={"input_file_id": mine.id, "endpoint": "/v1/chat/completions",
                                            "completion_window": "24h"}, headers=owner)
    assert made.status_code == 404
    assert client.get(f"/v1/batches?after={mine.id}", headers=owner).status_code == 400
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}}
    upload = client.post("/v1/files", files={"file": ("in.jsonl", json.dumps(line).encode())}, data={"purpose": "batch"},
                         headers=owner).json()
    openai_batch = client.post("/v1/batches", json={"input_file_id": upload["id"], "endpoint": "/v1/chat/completions",
                                                    "completion_window": "24h"}, headers=owner).json()["id"]
    for method, path in (("GET", ""), ("POST", "/cancel"), ("GET", "/results"), ("DELETE", "")):
        assert client.request(method, f"{BATCHES}/{openai_batch}{path}", headers=headers()).status_code == 404
    assert client.get(f"{BATCHES}?after_id={openai_batch}", headers=headers()).status_code == 400
    assert client.get(f"/v1/batches/{openai_batch}", headers=owner).json()["status"] not in ("cancelling", "cancelled")
    assert client.get(BATCHES, headers={"x-api-key": "sk-admin"}).status_code == 401  # an admin key is no API key
    assert retrieve(client, mine.id).processing_status == "ended"


def test_a_key_removed_while_its_batch_runs_fails_the_rest(tmp_path: Path) -> None:
    """Its remaining requests are errored (authentication_error), none of them runs; the key back,
    its batch and results are there again."""
    from gateway.tenancy.tenants import Tenants

    path = keys_file(tmp_path, "keys:\n  one: {key: sk-one}\n  two: {key: sk-two}\n")
    tenants, engine = Tenants(path, reload_interval_s=0), FakeEngine(delay=0.05)
    app = create_app(fake_settings(keys_file=path, **settings(tmp_path, max_in_flight=1)),
                     engine_starter=lambda es: engine, tenants=tenants)
    with TestClient(app) as client:
        batch = create(client, [{"custom_id": f"r{i}", "params": params()} for i in range(30)], key="sk-one")
        until_sync(lambda: retrieve(client, batch.id, "sk-one").request_counts.succeeded >= 1, what="a request done")
        path.write_text("keys:\n  two: {key: sk-two}\n")
        assert tenants.reload("test")
        assert client.get(f"{BATCHES}/{batch.id}", headers=headers("sk-one")).status_code == 401
        ran = len(engine.requests)
        until_sync(lambda: _status(tmp_path, batch.id) == "completed", what="completed (on disk: no key may read it now)")
        assert len(engine.requests) <= ran + 1  # the one in flight, at most
        path.write_text("keys:\n  one: {key: sk-one}\n  two: {key: sk-two}\n")
        assert tenants.reload("test")
        found = results_of(client, batch.id, "sk-one")
    kinds = [result.type for result in found.values()]
    assert len(found) == 30
    assert kinds.count("succeeded") == len(engine.requests) >= 1
    errored = [r for r in found.values() if isinstance(r, sdk.MessageBatchErroredResult)]
    assert errored
    assert {r.error.error.type for r in errored} == {"authentication_error"}


def _status(tmp_path: Path, batch_id: str) -> str:
    return record(tmp_path / "batches", batch_id).batch.status


# --- the SDK end to end: pages both ways, results, delete ---------------------------------------------


def test_the_sdk_pages_both_ways_and_reads_results(client: TestClient) -> None:
    claude_sdk = claude(client)
    ids = [claude_sdk.messages.batches.create(requests=[  # type: ignore[list-item]
        {"custom_id": "a", "params": params()}, {"custom_id": "b", "params": params(model="nope")}]).id
        for _ in range(5)]
    for batch_id in ids:
        wait(client, batch_id)
    newest_first = ids[::-1]
    assert [b.id for b in claude_sdk.messages.batches.list(limit=2)] == newest_first
    assert [b.id for b in claude_sdk.messages.batches.list(limit=2, after_id=newest_first[0])] == newest_first[1:]
    assert [b.id for b in claude_sdk.messages.batches.list(limit=1, before_id=ids[0])] == ids[1:]
    assert {line.custom_id: line.result.type for line in claude_sdk.messages.batches.results(ids[0])} == {
        "a": "succeeded", "b": "errored"}
    assert claude_sdk.messages.batches.delete(ids[0]).type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError):
        claude_sdk.messages.batches.results(ids[0])
    with pytest.raises(anthropic.NotFoundError):
        claude(client, "sk-other").messages.batches.results(ids[1])
    assert [b.id for b in claude(client, "sk-other").messages.batches.list()] == []


# --- malformed requests: a 4xx in Anthropic's shape ------------------------------------------------------


@pytest.mark.parametrize(("method", "path", "status"), [
    ("PUT", "", 405), ("PATCH", "", 405), ("POST", "/msgbatch_" + "0" * 32, 405),
    ("GET", "/msgbatch_" + "0" * 32 + "/cancel", 405), ("POST", "/msgbatch_" + "0" * 32 + "/results", 405),
    ("GET", "?limit=abc", 400), ("GET", "?limit=1.5", 400), ("GET", "?limit=-1", 400), ("GET", "?limit=", 400),
    ("GET", "?after_id=", 400), ("GET", "/MSGBATCH_" + "0" * 32, 404), ("GET", "/msgbatch_" + "A" * 32, 404),
    ("GET", "/msgbatch_" + "0" * 32 + "/", 404), ("GET", "/%2e%2e", 404), ("GET", "/..%2f..%2fetc", 404),
    ("GET", "/msgbatch_" + "0" * 32 + "%00", 404),
])
def test_odd_requests_are_4xx_in_anthropics_shape(client: TestClient, method: str, path: str, status: int) -> None:
    response = client.request(method, BATCHES + path, headers=headers())
    assert response.status_code == status, response.text
    assert response.json()["type"] == "error"
    assert set(response.json()["error"]) == {"type", "message"}


@pytest.mark.parametrize("body", [
    [1], {"requests": "x"}, {"requests": {}}, {"requests": [1]}, {"requests": [{"custom_id": "a", "params": None}]},
    {"requests": [{"custom_id": "a", "params": []}]}, {"requests": [{"custom_id": 5, "params": {}}]},
    {"requests": [{"custom_id": "abc\n", "params": {}}]}, {"requests": [{"custom_id": "\u00e9", "params": {}}]},
    {"requests": [{"custom_id": "\uff11", "params": {}}]}, {"requests": [{"custom_id": "a", "params": {}}], "foo": 1},
])
def test_a_malformed_create_is_a_400_and_stores_nothing(client: TestClient, body: Any) -> None:
    response = client.post(BATCHES, json=body, headers=headers())
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert client.get(BATCHES, headers=headers()).json()["data"] == []

# --- a batch deleted meanwhile: a 404, never a 500 ---------------------------------------------------


@pytest.mark.parametrize(("method", "path", "status"), [
    ("GET", "", 200), ("POST", "/cancel", 400), ("GET", "/results", 404), ("DELETE", "", 200),
])
def test_a_batch_deleted_between_lookup_and_read_is_never_a_5xx(client: TestClient, monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path, method: str, path: str, status: int) -> None:
    """Two clients (or a retried DELETE) on one batch: the other deletes it right after this request
    found it. What was found answers (its view; a cancel of an ended batch refused; a delete done
    twice is done), and results whose objects are gone are a 404: never a 500."""
    load = SqliteRecords.batch

    async def deleted_after(self: SqliteRecords, batch_id: str) -> Any:
        found = await load(self, batch_id)
        await self.remove(batch_id)
        await asyncio.to_thread((tmp_path / "batches" / input_name(batch_id)).unlink, missing_ok=True)
        return found

    batch = create(client, [{"custom_id": "a", "params": params()}])
    wait(client, batch.id)
    monkeypatch.setattr(SqliteRecords, "batch", deleted_after)
    response = client.request(method, f"{BATCHES}/{batch.id}{path}", headers=headers())
    assert response.status_code == status, response.text
    if status == 404:
        assert response.json()["error"] == {"type": "not_found_error", "message": f"No batch found with id '{batch.id}'."}


def test_results_whose_input_goes_as_it_is_read_are_a_404(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """The delete lands after the input was found for the results and before it was read: a 404, as a delete before
    (it was the thread's FileNotFoundError: a 500)."""
    from gateway.apis.message_batches import message_batches_serving as mb

    batch = create(client, [{"custom_id": "a", "params": params()}])
    wait(client, batch.id)
    unrun = mb._unrun_lines

    def deleted_first(requests: Path, seen: set[str], status: str) -> bytes | None:
        requests.unlink()
        return unrun(requests, seen, status)

    monkeypatch.setattr(mb, "_unrun_lines", deleted_first)
    response = client.get(f"{BATCHES}/{batch.id}/results", headers=headers())
    assert response.status_code == 404, response.text
    assert response.json()["error"]["type"] == "not_found_error"


def test_results_already_streaming_survive_a_delete(client: TestClient, tmp_path: Path) -> None:
    """The results are assembled before the answer starts: a delete then does not cut the JSONL
    short after a 200 (the server's error, mid-stream)."""
    from gateway.apis.message_batches import message_batches_serving as mb

    batch = create(client, [{"custom_id": f"r{i}", "params": params()} for i in range(3)] +
                   [{"custom_id": "bad", "params": params(model="nope")}])
    wait(client, batch.id)
    store = disk_batches(tmp_path / "batches")

    async def read_while_deleted() -> list[bytes]:
        stored = await store.records.batch(batch.id)
        assert stored is not None
        lines = await mb.results(store, stored, "message_batch_id")
        await store.records.remove(batch.id)
        await store.blobs.delete(input_name(batch.id))
        chunks = [chunk async for chunk in lines.chunks]
        await store.aclose()
        return chunks

    chunks = asyncio.run(read_while_deleted())
    assert sorted(json.loads(line)["custom_id"] for line in b"".join(chunks).splitlines()) == ["bad", "r0", "r1", "r2"]


def test_results_are_built_off_the_event_loop(client: TestClient, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Each result line is made in a worker thread, never on the event loop: a large batch's results
    read do not stall the requests the loop serves meanwhile."""
    from gateway.apis.message_batches import message_batches_serving as mb
    from gateway.stores.batchdb import Answer

    batch = create(client, [{"custom_id": f"r{i}", "params": params()} for i in range(3)] +
                   [{"custom_id": "bad", "params": params(model="nope")}])
    wait(client, batch.id)
    made_on: list[threading.Thread] = []
    result = mb._result

    def noted(answer: Answer) -> dict[str, Any]:
        made_on.append(threading.current_thread())
        return result(answer)

    monkeypatch.setattr(mb, "_result", noted)
    store = disk_batches(tmp_path / "batches")

    async def read() -> tuple[bytes, threading.Thread]:
        stored = await store.records.batch(batch.id)
        assert stored is not None
        lines = await mb.results(store, stored, "message_batch_id")
        body = b"".join([chunk async for chunk in lines.chunks])
        await store.aclose()
        return body, threading.current_thread()

    body, loop_thread = asyncio.run(read())
    assert sorted(json.loads(line)["custom_id"] for line in body.splitlines()) == ["bad", "r0", "r1", "r2"]
    assert len(made_on) == 4
    assert loop_thread not in made_on


# --- cancel: twice while it runs, and after it ended ---------------------------------------------------


def test_cancel_twice_keeps_its_first_time_and_a_cancel_after_the_end_speaks_anthropics_words(tmp_path: Path) -> None:
    engine = FakeEngine(delay=0.05)
    with TestClient(app_with(engine, api_keys=KEYS, **settings(tmp_path, max_in_flight=1))) as client:
        claude_sdk = claude(client)
        batch = create(client, [{"custom_id": f"r{i}", "params": params()} for i in range(20)])
        first = claude_sdk.messages.batches.cancel(batch.id)
        assert first.cancel_initiated_at is not None
        again = client.post(f"{BATCHES}/{batch.id}/cancel", headers=headers())
        if again.status_code == 200:
            assert again.json()["cancel_initiated_at"] == first.model_dump(mode="json")["cancel_initiated_at"]
        else:  # the runner carried out the first already: the batch has ended
            assert "has already ended" in again.json()["error"]["message"]
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


# --- the lane is shared: one key's rate limit does not hold another's batch ------------------------------


def test_a_rate_limited_keys_batch_does_not_hold_the_lane_for_another_key(tmp_path: Path) -> None:
    """A key at its requests per minute waits for its next request; its lines that wait give their
    slots of `max_in_flight` back meanwhile, so another key's batch runs (it waited behind the slow
    key's lines, which held every slot asleep, for as long as that key's limit said: a minute)."""
    keys = keys_file(tmp_path, "keys:\n  slow: {key: sk-slow, rpm: 1}\n  fast: {key: sk-fast}\n")
    engine = FakeEngine()
    with TestClient(app_with(engine, keys_file=keys, **settings(tmp_path, max_in_flight=2))) as client:
        refused = _refusals()
        slow = create(client, [{"custom_id": f"r{i}", "params": params()} for i in range(6)], key="sk-slow")
        # its create took the key's one request of this minute: lines wait
        until_sync(lambda: _refusals() != refused, what="a line refused by the key's limit")
        fast = create(client, [{"custom_id": f"r{i}", "params": params()} for i in range(4)], key="sk-fast")
        done = ended(client, fast.id, "sk-fast", timeout=90)
        assert done.request_counts.succeeded == 4
        assert _status(tmp_path, slow.id) == "in_progress"  # still waiting for its limit
        other = SqliteRecords(tmp_path / "batches" / "batches.sqlite3")  # its key may not ask for a minute: as another replica would
        asyncio.run(other.ask_cancel(slow.id))
        runner = client.app_state["gateway"].batch_runner
        runner.cancel(slow.id)
        until_sync(lambda: _status(tmp_path, slow.id) == "cancelled", what="the slow batch cancelled")
        assert runner.slots._value == 2  # every slot back: none lost, none counted twice, by the lines cancelled asleep


def _refusals() -> float:
    import prometheus_client

    return prometheus_client.REGISTRY.get_sample_value("gateway_rate_limited_total", {"limit": "requests"}) or 0.0
