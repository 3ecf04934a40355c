"""The Batches API (/v1/batches) on the fake engine, through the official `openai` SDK: create, poll,
download; each line answered as its route answers it, in the batch lane; ownership; malformed
batches; cancel; expiry; the key's limits and budget; and exactly-once across a crash and between
two runners on one directory."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from starlette.testclient import TestClient

from gateway.protocol.batch_objects import Batch, Owner, StoredBatch
from gateway.stores.batches import BatchStore, new_id
from tests.fakes import FakeEngine, HeldAfter, app_with
from tests.stores import answers, disk_batches, record
from tests.unit.test_responses import sdk_for
from tests.unit.test_tenants import keys_file
from tests.waits import until_sync

KEYS = ["sk-owner", "sk-other"]
FAST = {"poll_s": 0.05, "retry_s": 0.1, "lease_s": 3}
DONE = ("completed", "failed", "expired", "cancelled")


def chat_line(custom_id: str, content: str = "hi", model: str = "fake-model", **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 3, **body}}


def jsonl(*lines: dict[str, Any]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def settings(tmp_path: Path, **batches: Any) -> dict[str, Any]:
    return {"files": {"dir": tmp_path / "files"}, "batches": {"dir": tmp_path / "batches", **FAST, **batches}}


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def client(tmp_path: Path, engine: FakeEngine) -> Iterator[TestClient]:
    with TestClient(app_with(engine, api_keys=KEYS, **settings(tmp_path))) as test_client:
        yield test_client


def submit(sdk: openai.OpenAI, content: bytes, endpoint: Any = "/v1/chat/completions", **extra: Any) -> Batch:
    made = sdk.files.create(file=("in.jsonl", content), purpose="batch")
    return Batch.model_validate(sdk.batches.create(input_file_id=made.id, endpoint=endpoint, completion_window="24h",
                                                   **extra).model_dump())


def wait(sdk: openai.OpenAI, batch_id: str, statuses: tuple[str, ...] = DONE, timeout: float = 90) -> Any:
    return until_sync(lambda: (found := sdk.batches.retrieve(batch_id)).status in statuses and found, timeout,
                      f"batch {batch_id} {statuses}")


def completed(sdk: openai.OpenAI, batch_id: str, lines: int) -> None:
    until_sync(lambda: sdk.batches.retrieve(batch_id).request_counts.completed >= lines, what=f"{lines} lines done")


def lines_of(sdk: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in sdk.files.content(file_id).read().splitlines()]


def by_custom_id(lines: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    found = {line["custom_id"]: line for line in lines}
    assert len(found) == len(lines), "a custom_id answered twice"
    return found


def test_a_batch_runs_each_line_as_its_route_would(client: TestClient, engine: FakeEngine) -> None:
    sdk = sdk_for(client, "sk-owner")
    lines = [chat_line("a", "one"), chat_line("b", "two two"), chat_line("missing", model="no-such-model"),
             chat_line("streamed", stream=True)]
    batch = submit(sdk, jsonl(*lines), metadata={"job": "nightly"})
    assert (batch.status, batch.object, batch.completion_window) == ("validating", "batch", "24h")
    assert batch.id.startswith("batch_")
    assert batch.expires_at == batch.created_at + 86400
    done = wait(sdk, batch.id)
    assert done.status == "completed"
    assert done.request_counts.model_dump() == {"total": 4, "completed": 2, "failed": 2}
    assert done.metadata == {"job": "nightly"}
    assert all(getattr(done, f) is not None for f in ("in_progress_at", "finalizing_at", "completed_at"))
    output, errors = by_custom_id(lines_of(sdk, done.output_file_id)), by_custom_id(lines_of(sdk, done.error_file_id))
    assert set(output) == {"a", "b"}
    assert set(errors) == {"missing", "streamed"}
    interactive = sdk.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "two two"}],
                                              max_tokens=3)
    answer = output["b"]
    assert answer["id"].startswith("batch_req_")
    assert answer["error"] is None
    assert answer["response"]["status_code"] == 200
    assert answer["response"]["request_id"].startswith("req_")
    body = answer["response"]["body"]
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == interactive.choices[0].message.model_dump(exclude_none=True)
    assert body["usage"] == interactive.usage.model_dump(exclude_none=True)
    assert done.usage.input_tokens == sum(output[c]["response"]["body"]["usage"]["prompt_tokens"] for c in output)
    assert errors["missing"]["response"]["status_code"] == 404
    assert errors["missing"]["response"]["body"]["error"]["code"] == "model_not_found"
    assert errors["streamed"]["response"]["status_code"] == 400
    assert errors["streamed"]["response"]["body"]["error"]["param"] == "stream"
    output_file = sdk.files.retrieve(done.output_file_id)
    assert (output_file.purpose, output_file.filename) == ("batch_output", f"{batch.id}_output.jsonl")
    # the lines ran in the batch lane: below the low class in the engine
    batch_requests = [r for r in engine.requests if r.priority == 2]
    assert len(batch_requests) == 2
    assert engine.requests[-1].priority == 0


def test_every_endpoint_runs_in_a_batch(tmp_path: Path) -> None:
    from gateway.app import create_app
    from tests.fakes import fake_settings

    engines = {"fake-model": FakeEngine(), "fake-embed": FakeEngine("fake-embed", task="embed")}
    app = create_app(fake_settings(embedding_model="fake-embed", **settings(tmp_path)),
                     engine_starter=lambda es: engines[es.served_model_name])
    with TestClient(app) as client:
        sdk = sdk_for(client)
        cases = {
            "/v1/completions": {"model": "fake-model", "prompt": "hello", "max_tokens": 2},
            "/v1/embeddings": {"model": "fake-embed", "input": "hello"},
            "/v1/responses": {"model": "fake-model", "input": "hello", "max_output_tokens": 16},
        }
        for endpoint, body in cases.items():
            batch = submit(sdk, jsonl({"custom_id": "x", "method": "POST", "url": endpoint, "body": body}), endpoint)
            done = wait(sdk, batch.id)
            [line] = lines_of(sdk, done.output_file_id) + lines_of(sdk, done.error_file_id)
            assert line["response"]["status_code"] == 200, (endpoint, line)
            assert line["response"]["body"]["object"] in ("text_completion", "list", "response")


@pytest.mark.parametrize(("change", "status", "param"), [
    ({"input_file_id": "file-0123456789abcdef01234567"}, 404, "file_id"),
    ({"endpoint": "/v1/moderations"}, 400, "endpoint"),
    ({"completion_window": "1h"}, 400, "completion_window"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, 400, "metadata"),
    ({"metadata": {"k": "v" * 513}}, 400, "metadata.k"),  # the value too long, named by its key
    ({"surprise": 1}, 400, "surprise"),
])
def test_a_malformed_create_is_refused(client: TestClient, change: dict[str, Any], status: int, param: str) -> None:
    sdk = sdk_for(client, "sk-owner")
    made = sdk.files.create(file=("in.jsonl", jsonl(chat_line("a"))), purpose="batch")
    body = {"input_file_id": made.id, "endpoint": "/v1/chat/completions", "completion_window": "24h", **change}
    answer = client.post("/v1/batches", json=body, headers={"authorization": "Bearer sk-owner"})
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["param"] == param
    assert client.get("/v1/batches", headers={"authorization": "Bearer sk-owner"}).json()["data"] == []


def test_an_output_file_is_not_a_batch_input(client: TestClient) -> None:
    sdk = sdk_for(client, "sk-owner")
    done = wait(sdk, submit(sdk, jsonl(chat_line("a"))).id)
    with pytest.raises(openai.BadRequestError, match="purpose 'batch_output'"):
        sdk.batches.create(input_file_id=done.output_file_id, endpoint="/v1/chat/completions", completion_window="24h")


def test_lines_for_another_endpoint_fail_the_batch_with_errors(client: TestClient) -> None:
    sdk = sdk_for(client, "sk-owner")
    embed = {"custom_id": "e", "method": "POST", "url": "/v1/embeddings", "body": {"model": "m", "input": "x"}}
    done = wait(sdk, submit(sdk, jsonl(chat_line("a"), embed)).id)
    assert done.status == "failed"
    assert done.failed_at is not None
    assert done.errors.object == "list"
    [error] = done.errors.data
    assert (error.code, error.line, error.param) == ("mismatched_endpoint", 2, "url")
    assert done.output_file_id is None


def test_a_repeated_custom_id_fails_the_batch(tmp_path: Path) -> None:
    """The upload refuses one; a file stored otherwise (an older gateway's) is caught before it runs."""
    store = disk_batches(tmp_path / "batches")
    source = tmp_path / "in.jsonl"
    source.write_bytes(jsonl(chat_line("a"), chat_line("a")))
    batch_id = _stored(store, source)
    with TestClient(app_with(FakeEngine(), **settings(tmp_path))) as client:
        done = wait(sdk_for(client), batch_id)
    assert done.status == "failed"
    assert [(e.code, e.line) for e in done.errors.data] == [("duplicate_custom_id", 2)]


def _stored(store: BatchStore, source: Path, owner: str = "anonymous", expires_at: int | None = None,
            tenant: str | None = None) -> str:
    now = int(time.time())
    batch = Batch(id=new_id(), endpoint="/v1/chat/completions", input_file_id="file-0123456789abcdef01234567",
                  status="validating", created_at=now, expires_at=expires_at or now + 86400)
    stored = StoredBatch(batch=batch, owner=Owner(key_id=owner, tenant=tenant or owner), output_expires_after_s=3600)
    asyncio.run(store.of(owner).create(stored, source.read_bytes()))
    return batch.id


def test_another_keys_batches_are_not_found(client: TestClient) -> None:
    owner, other = sdk_for(client, "sk-owner"), sdk_for(client, "sk-other")
    made = owner.files.create(file=("in.jsonl", jsonl(chat_line("a"))), purpose="batch")
    batch = owner.batches.create(input_file_id=made.id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        other.batches.cancel(batch.id)
    with pytest.raises(openai.NotFoundError):  # the owner's input file is no file of the other's
        other.batches.create(input_file_id=made.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert list(other.batches.list()) == []
    unknown = client.get("/v1/batches/batch_" + "0" * 32, headers={"authorization": "Bearer sk-other"})
    foreign = client.get(f"/v1/batches/{batch.id}", headers={"authorization": "Bearer sk-other"})
    assert foreign.status_code == unknown.status_code == 404
    assert foreign.json()["error"] == {**unknown.json()["error"], "message": foreign.json()["error"]["message"]}
    for bad in ("batch_../../x", "..", "batch_" + "A" * 32):
        assert client.get(f"/v1/batches/{bad}", headers={"authorization": "Bearer sk-owner"}).status_code == 404
    done = wait(owner, batch.id)
    with pytest.raises(openai.NotFoundError):
        other.files.content(done.output_file_id)


def test_list_is_newest_first_and_paginated(client: TestClient) -> None:
    sdk = sdk_for(client, "sk-owner")
    made = sdk.files.create(file=("in.jsonl", jsonl(chat_line("a"))), purpose="batch")
    ids = [sdk.batches.create(input_file_id=made.id, endpoint="/v1/chat/completions", completion_window="24h").id
           for _ in range(3)]
    first = client.get("/v1/batches?limit=2", headers={"authorization": "Bearer sk-owner"}).json()
    assert [b["id"] for b in first["data"]] == ids[::-1][:2]
    assert first["has_more"] is True
    assert (first["first_id"], first["last_id"]) == (ids[2], ids[1])
    rest = client.get(f"/v1/batches?limit=2&after={ids[1]}", headers={"authorization": "Bearer sk-owner"}).json()
    assert [b["id"] for b in rest["data"]] == [ids[0]]
    assert rest["has_more"] is False
    assert [b.id for b in sdk.batches.list()] == ids[::-1]  # the SDK pages through
    for limit in ("0", "101"):
        assert client.get(f"/v1/batches?limit={limit}", headers={"authorization": "Bearer sk-owner"}).status_code == 400


def test_a_cancel_aborts_the_lines_in_flight_and_keeps_the_partial_output(tmp_path: Path) -> None:
    engine = HeldAfter(2)
    with TestClient(app_with(engine, **settings(tmp_path, max_in_flight=2))) as client:
        sdk = sdk_for(client)
        lines = [chat_line(f"r{i}", max_tokens=8) for i in range(20)]
        batch = submit(sdk, jsonl(*lines))
        completed(sdk, batch.id, 2)
        until_sync(lambda: engine.started == 4, what="two lines held in flight")
        cancelling = sdk.batches.cancel(batch.id)
        assert cancelling.status in ("cancelling", "cancelled")
        assert cancelling.cancelling_at is not None
        done = wait(sdk, batch.id)
        assert done.status == "cancelled"
        assert done.cancelled_at is not None
        assert engine.aborted  # the engine requests in flight were aborted
        output = by_custom_id(lines_of(sdk, done.output_file_id))
        assert len(output) == 2 < 20 == done.request_counts.total
        assert done.request_counts.completed == len(output)
        with pytest.raises(openai.BadRequestError):  # done: nothing to cancel
            sdk.batches.cancel(batch.id)


def test_a_batch_resumes_after_a_crash_and_answers_each_line_once(tmp_path: Path) -> None:
    lines = [chat_line(f"r{i}", max_tokens=4) for i in range(12)]
    first = HeldAfter(4)
    with TestClient(app_with(first, **settings(tmp_path, max_in_flight=2))) as client:
        sdk = sdk_for(client)
        batch = submit(sdk, jsonl(*lines))
        completed(sdk, batch.id, 4)
        until_sync(lambda: first.started == 6, what="two lines held in flight")
    # the shutdown left it in progress, its lines in flight cancelled
    stored = record(tmp_path / "batches", batch.id)
    assert stored.batch.status == "in_progress"
    assert stored.batch.request_counts.completed == 4
    before = len(answers(tmp_path / "batches", batch.id))
    assert before == stored.batch.request_counts.completed
    second = FakeEngine()
    with TestClient(app_with(second, **settings(tmp_path))) as client:
        sdk = sdk_for(client)
        done = wait(sdk, batch.id)
        output = by_custom_id(lines_of(sdk, done.output_file_id))
    assert done.status == "completed"
    assert set(output) == {f"r{i}" for i in range(12)}
    assert done.request_counts.model_dump() == {"total": 12, "completed": 12, "failed": 0}
    assert len(second.requests) == 12 - before  # only the lines not written yet ran again


def test_two_runners_on_one_directory_run_a_batch_once(tmp_path: Path) -> None:
    one, two = FakeEngine(delay=0.01), FakeEngine(delay=0.01)
    with TestClient(app_with(one, **settings(tmp_path))) as a, TestClient(app_with(two, **settings(tmp_path))) as b:
        batch = submit(sdk_for(a), jsonl(*(chat_line(f"r{i}") for i in range(10))))
        seen_by_b = sdk_for(b).batches.retrieve(batch.id)  # any replica answers its status
        assert seen_by_b.id == batch.id
        done = wait(sdk_for(b), batch.id)
        output = by_custom_id(lines_of(sdk_for(a), done.output_file_id))
    assert len(output) == 10
    assert sorted([len(one.requests), len(two.requests)]) == [0, 10]  # one replica held the lease


def test_an_expired_batch_fails_its_remaining_lines(tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_bytes(jsonl(chat_line("a"), chat_line("b")))
    batch_id = _stored(disk_batches(tmp_path / "batches"), source, expires_at=int(time.time()) - 1)
    with TestClient(app_with(FakeEngine(), **settings(tmp_path))) as client:
        sdk = sdk_for(client)
        done = wait(sdk, batch_id)
        errors = by_custom_id(lines_of(sdk, done.error_file_id))
    assert done.status == "expired"
    assert done.expired_at is not None
    assert {c: e["error"]["code"] for c, e in errors.items()} == {"a": "batch_expired", "b": "batch_expired"}
    assert errors["a"]["response"] is None


def test_a_spent_budget_fails_the_remaining_lines(tmp_path: Path) -> None:
    path = keys_file(tmp_path, "keys:\n  capped: {key: sk-c, budget: {day: 15}}\n")
    with TestClient(app_with(FakeEngine(), keys_file=path, **settings(tmp_path, max_in_flight=1))) as client:
        sdk = sdk_for(client, "sk-c")
        done = wait(sdk, submit(sdk, jsonl(*(chat_line(f"r{i}") for i in range(6)))).id)
        errors = lines_of(sdk, done.error_file_id)
    assert done.status == "completed"
    assert done.request_counts.completed >= 1
    assert done.request_counts.failed >= 1
    assert {e["response"]["status_code"] for e in errors} == {429}
    assert {e["response"]["body"]["error"]["code"] for e in errors} == {"insufficient_quota"}


def test_a_rate_limit_pauses_lines_instead_of_failing_them(tmp_path: Path) -> None:
    path = keys_file(tmp_path, "keys:\n  slow: {key: sk-s, rpm: 60}\n")  # a bucket of 60, one more a second
    with TestClient(app_with(FakeEngine(), keys_file=path, **settings(tmp_path))) as client:
        sdk = sdk_for(client, "sk-s")
        batch = submit(sdk, jsonl(*(chat_line(f"r{i}") for i in range(62))))  # 2 requests of the 60 taken
        done = on_disk(tmp_path, batch.id, timeout=90)  # polled on disk: polling by HTTP takes requests too
    assert done.request_counts.model_dump() == {"total": 62, "completed": 62, "failed": 0}


def on_disk(tmp_path: Path, batch_id: str, timeout: float = 60) -> Batch:
    """A batch once done, read from its record (for tests whose key cannot spare requests)."""
    return until_sync(lambda: (found := record(tmp_path / "batches", batch_id).batch).status in DONE and found, timeout,
                      f"batch {batch_id} done")


def test_a_removed_key_fails_its_batchs_lines(tmp_path: Path) -> None:
    path = keys_file(tmp_path, "keys:\n  stays: {key: sk-s}\n")
    source = tmp_path / "in.jsonl"
    source.write_bytes(jsonl(chat_line("a")))
    batch_id = _stored(disk_batches(tmp_path / "batches"), source, owner="gone", tenant="keys-file:gone")
    with TestClient(app_with(FakeEngine(), keys_file=path, **settings(tmp_path))):
        assert on_disk(tmp_path, batch_id).status == "completed"
    [line] = answers(tmp_path / "batches", batch_id, ok=False)
    assert line["response"]["status_code"] == 401  # type: ignore[index]


def test_a_drain_starts_no_new_line_and_leaves_the_batch_in_progress(tmp_path: Path) -> None:
    """The one slot held by a line when the drain starts: once that line ends, the next line's task takes the slot,
    finds the drain and gives the slot back (waited for, not a window of time); no line starts."""
    from gateway.app import create_app
    from gateway.pipeline.lifecycle import Lifecycle
    from tests.fakes import HeldEngine, fake_settings

    engine, lifecycle = HeldEngine(), Lifecycle()
    app = create_app(fake_settings(**settings(tmp_path, max_in_flight=1)), engine_starter=lambda es: engine,
                     lifecycle=lifecycle)
    with TestClient(app) as client:
        slots = client.app_state["gateway"].batch_runner.slots
        given_back: list[bool] = []  # each slot given back, and whether the drain had begun
        release = slots.release
        slots.release = lambda: (given_back.append(lifecycle.draining), release())[1]  # type: ignore[method-assign]
        batch = submit(sdk_for(client), jsonl(*(chat_line(f"r{i}", max_tokens=5) for i in range(10))))
        until_sync(lambda: engine.held, what="a line in flight, holding the only slot")
        lifecycle.start_drain()
        client.portal.call(engine.go.set)
        until_sync(lambda: given_back.count(True) >= 2 and not slots.locked(),
                   what="the line's slot given back, then the next one's taken and given back")
        assert len(engine.held) == 1
    stored = record(tmp_path / "batches", batch.id)
    assert stored.batch.status == "in_progress"
    assert stored.batch.request_counts.completed + stored.batch.request_counts.failed == 1
