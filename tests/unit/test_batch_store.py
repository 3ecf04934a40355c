"""The batch lane's stores on the `Blobs` interface: the index of batches not done (what the runner
reads instead of the whole store: a done batch leaves it, a create or an end cut short by a crash
loses no batch, an older store's batches are entered once), and a store that is down: a 503 in the
route's own error shape on every route of the lane (the server serving the rest meanwhile), and a
runner that outlives the outage and answers every line once."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from gateway.errors import StoreUnavailable
from gateway.protocol.batch_objects import Batch, Owner, StoredBatch
from gateway.stores.batches import INPUT, ORPHAN_S, PENDING, RECORD, BatchStore, new_id
from gateway.stores.blobs import Blobs, BlobsUnavailable, DiskBlobs
from gateway.stores.guarded import Guarded
from gateway.stores.spool import Spool
from tests.fakes import FakeEngine, app_with
from tests.stores import Flaky
from tests.unit.test_batches import KEYS, by_custom_id, chat_line, completed, jsonl, lines_of, settings, submit, wait
from tests.unit.test_message_batches import BATCHES, params
from tests.unit.test_responses import sdk_for
from tests.waits import until_sync

LINES = jsonl(chat_line("a"), chat_line("b"))


@pytest.fixture
def flaky(blobs: Blobs) -> Flaky:
    """The store on each backend (disk, Redis, S3), able to be taken down."""
    return Flaky(blobs)


def store_on(blobs: Flaky, tmp_path: Path) -> BatchStore:
    return BatchStore.on(blobs, Spool.at(tmp_path / "spool"))


def stored(status: str = "validating", owner: str = "t") -> StoredBatch:
    now = int(time.time())
    batch = Batch(id=new_id(), endpoint="/v1/chat/completions", input_file_id="file-" + "0" * 24, status=status,
                  created_at=now, expires_at=now + 86400)
    return StoredBatch(batch=batch, owner=Owner(key_id=owner, tenant=owner), output_expires_after_s=3600)


async def test_a_batch_is_pending_from_its_create_until_it_is_done(flaky: Flaky, tmp_path: Path) -> None:
    store = store_on(flaky, tmp_path)
    made = stored()
    await store.of("t").create(made, LINES)
    assert [b.id for b in await store.pending(set())] == [made.batch.id]
    [batch] = await store.pending(set())
    made.batch.status = "completed"
    await batch.write(made)
    done: set[str] = set()
    assert await store.pending(done) == []
    assert done == {made.batch.id}
    assert await flaky.list(PENDING) == []  # out of the index: never read again, by any replica


async def test_the_runner_reads_the_index_not_the_store(flaky: Flaky, tmp_path: Path) -> None:
    store = store_on(flaky, tmp_path)
    for status in ("validating", "completed", "in_progress"):
        made = stored(status)
        await store.of("t").create(made, LINES)
    await store.pending(set())  # the completed one leaves the index
    flaky.calls.clear()
    assert len(await store.pending(set())) == 2
    assert [name for method, name in flaky.calls if method == "list"] == [PENDING]
    assert {method for method, _ in flaky.calls} == {"list", "get"}
    assert all(name.endswith(("/record.json", "/cancel")) for method, name in flaky.calls if method == "get")


async def test_a_create_cut_short_loses_no_batch(flaky: Flaky, tmp_path: Path) -> None:
    """The index entry, then the input, then the record: a crash before the record leaves an entry
    that waits for it (a create in progress) and is removed only once old, with what was written."""
    store = store_on(flaky, tmp_path)
    mine, made = store.of("t"), stored()
    batch = mine._batch(made.batch.id)
    await flaky.put(batch.entry, json.dumps({"created": time.time()}).encode())
    await flaky.put(batch.name(INPUT), LINES)
    assert await store.pending(set()) == []  # no record yet: not a batch yet
    assert await flaky.list(PENDING) == [batch.entry]  # ...and its entry kept meanwhile
    await batch.write(made)  # the create goes on: the batch is there, and pending
    assert [b.id for b in await store.pending(set())] == [made.batch.id]

    crashed = mine._batch(new_id())
    await flaky.put(crashed.name(INPUT), LINES)
    await flaky.put(crashed.entry, json.dumps({"created": time.time() - ORPHAN_S - 1}).encode())
    assert [b.id for b in await store.pending(set())] == [made.batch.id]
    assert await flaky.list(PENDING) == [batch.entry]  # the old entry without a record: removed
    assert await flaky.list(crashed.prefix) == []  # with its input


async def test_a_batch_that_ended_before_leaving_the_index_leaves_it_at_the_next_poll(flaky: Flaky,
                                                                                      tmp_path: Path) -> None:
    store = store_on(flaky, tmp_path)
    made = stored()
    await store.of("t").create(made, LINES)
    [batch] = await store.pending(set())
    made.batch.status = "cancelled"
    await batch.write(made)  # a crash here: the record says cancelled, the entry is still there
    assert await flaky.list(PENDING) == [batch.entry]
    assert await store.pending(set()) == []
    assert await flaky.list(PENDING) == []


async def test_the_batches_of_an_older_store_are_indexed_once(flaky: Flaky, tmp_path: Path) -> None:
    store = store_on(flaky, tmp_path)
    running, ended = stored("in_progress"), stored("completed")
    for made in (running, ended):
        await store.of("t").create(made, LINES)
        await flaky.delete(store.of("t")._batch(made.batch.id).entry)  # as an older version left them
    assert await store.pending(set()) == []
    assert await store.index_unlisted() == 1
    assert [b.id for b in await store.pending(set())] == [running.batch.id]
    flaky.calls.clear()
    assert await store.index_unlisted() == 0
    assert ("list", "") not in flaky.calls  # the whole store listed once, never again


async def test_a_deleted_batch_leaves_nothing(flaky: Flaky, tmp_path: Path) -> None:
    store = store_on(flaky, tmp_path)
    made = stored("completed")
    await store.of("t").create(made, LINES)
    await store.of("t").delete(made.batch.id)
    assert await flaky.list("") == []


# --- a store that is down -----------------------------------------------------------------------


async def test_a_disk_that_fails_is_unavailable_and_an_object_that_is_none_is_not(tmp_path: Path) -> None:
    (tmp_path / "not-a-directory").write_text("x")
    blobs = DiskBlobs.at(tmp_path / "not-a-directory")
    assert await blobs.get("a/b") is None  # none: no error
    with pytest.raises(BlobsUnavailable, match="disk store failed"):
        await blobs.put("a/b", b"x")
    with pytest.raises(StoreUnavailable):  # as the stores see it: the API's 503
        await Guarded(blobs).append("a/b", b"x")


@pytest.fixture
def stores(monkeypatch: pytest.MonkeyPatch) -> dict[str, Flaky]:
    """The app's two stores, each a `Flaky` on its disk directory."""
    made: dict[str, Flaky] = {}

    def open_blobs(settings: Any, pools: Any, part: str) -> Flaky:
        directory = settings.files.dir if part == "files" else settings.batches.dir
        made[part] = Flaky(DiskBlobs.at(directory))
        return made[part]

    monkeypatch.setattr("gateway.app.open_blobs", open_blobs)
    return made


def down(stores: dict[str, Flaky], is_down: bool = True) -> None:
    for blobs in stores.values():
        blobs.down = is_down


OPENAI = {"authorization": "Bearer sk-owner"}
ANTHROPIC = {"x-api-key": "sk-owner", "anthropic-version": "2023-06-01"}


def routes(file_id: str, batch_id: str, message_batch_id: str) -> list[tuple[str, str, dict[str, Any]]]:
    """Every route of the batch lane, with a request it would take (ids of objects that exist)."""
    return [
        ("POST", "/v1/files", {"files": {"file": ("in.jsonl", LINES)}, "data": {"purpose": "batch"}}),
        ("GET", "/v1/files", {}),
        ("GET", f"/v1/files/{file_id}", {}),
        ("GET", f"/v1/files/{file_id}/content", {}),
        ("DELETE", f"/v1/files/{file_id}", {}),
        ("POST", "/v1/batches", {"json": {"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                          "completion_window": "24h"}}),
        ("GET", "/v1/batches", {}),
        ("GET", f"/v1/batches/{batch_id}", {}),
        ("POST", f"/v1/batches/{batch_id}/cancel", {}),
        ("POST", BATCHES, {"json": {"requests": [{"custom_id": "a", "params": params()}]}}),
        ("GET", BATCHES, {}),
        ("GET", f"{BATCHES}/{message_batch_id}", {}),
        ("POST", f"{BATCHES}/{message_batch_id}/cancel", {}),
        ("DELETE", f"{BATCHES}/{message_batch_id}", {}),
        ("GET", f"{BATCHES}/{message_batch_id}/results", {}),
    ]


@pytest.fixture
def lane(tmp_path: Path, stores: dict[str, Flaky]) -> Iterator[TestClient]:
    """The app, no runner (what is made stays as it is), its stores up."""
    with TestClient(app_with(FakeEngine(), api_keys=KEYS, **settings(tmp_path, enabled=False))) as client:
        yield client


def test_a_store_that_is_down_is_a_503_on_every_route_of_the_lane(lane: TestClient, stores: dict[str, Flaky]) -> None:
    sdk = sdk_for(lane, "sk-owner")
    made = submit(sdk, LINES)
    message_batch = lane.post(BATCHES, json={"requests": [{"custom_id": "a", "params": params()}]}, headers=ANTHROPIC)
    assert message_batch.status_code == 200, message_batch.text
    down(stores)
    for method, path, body in routes(made.input_file_id, made.id, message_batch.json()["id"]):
        anthropic = path.startswith(BATCHES)
        answer = lane.request(method, path, headers=ANTHROPIC if anthropic else OPENAI, **body)
        assert answer.status_code == 503, (method, path, answer.text)
        error = answer.json()["error"]
        if anthropic:
            assert answer.json()["type"] == "error"
            assert error["type"] == "api_error"
        else:
            assert (error["type"], error["code"]) == ("server_error", "service_unavailable")
        assert "store" in error["message"]
        assert "refused" not in error["message"]  # the backend's own error is logged, not shown
    chat = lane.post("/v1/chat/completions", headers=OPENAI,
                     json={"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200  # the rest of the gateway serves on
    down(stores, False)
    assert lane.get(f"/v1/batches/{made.id}", headers=OPENAI).json()["status"] == "validating"
    assert lane.get(f"/v1/files/{made.input_file_id}/content", headers=OPENAI).content == LINES


def test_the_runner_outlives_a_store_outage_and_answers_each_line_once(tmp_path: Path,
                                                                      stores: dict[str, Flaky]) -> None:
    engine = FakeEngine(delay=0.05)  # 12 lines of 4 tokens, 2 at a time: the outage comes mid-run
    app = app_with(engine, **settings(tmp_path, max_in_flight=2, lease_s=0.5))
    with TestClient(app) as client:
        batches = stores["batches"]  # opened as the app starts
        down(stores)  # down as the runner polls: its polls refused, it polls again
        until_sync(lambda: batches.refused >= 2, what="two polls refused")
        down(stores, False)
        sdk = sdk_for(client)
        batch = submit(sdk, jsonl(*(chat_line(f"r{i}", max_tokens=4) for i in range(12))))
        completed(sdk, batch.id, 3)
        refused = batches.refused
        down(stores)  # down mid-run: the run fails here; the batch is taken again once its lease expires
        until_sync(lambda: batches.refused >= refused + 2, what="two more refusals")
        down(stores, False)
        assert any(method == "local" and name.endswith("/input.jsonl") for method, name in batches.calls)
        done = wait(sdk, batch.id)
        output = by_custom_id(lines_of(sdk, done.output_file_id))
        again = wait(sdk, submit(sdk, jsonl(chat_line("after"))).id)  # the runner still runs
    assert done.status == "completed"
    assert set(output) == {f"r{i}" for i in range(12)}
    assert done.request_counts.model_dump() == {"total": 12, "completed": 12, "failed": 0}
    assert again.status == "completed"


def test_a_message_batchs_results_are_read_through_the_store(tmp_path: Path, stores: dict[str, Flaky]) -> None:
    with TestClient(app_with(FakeEngine(), api_keys=KEYS, **settings(tmp_path))) as client:
        made = client.post(BATCHES, json={"requests": [{"custom_id": c, "params": params()} for c in "ab"]},
                           headers=ANTHROPIC).json()
        until_sync(lambda: client.get(f"{BATCHES}/{made['id']}", headers=ANTHROPIC).json()["processing_status"] == "ended",
                   what="the batch ended")
        stores["batches"].calls.clear()
        answer = client.get(f"{BATCHES}/{made['id']}/results", headers=ANTHROPIC)
    assert [json.loads(line)["custom_id"] for line in answer.text.splitlines()] == ["a", "b"]
    read = {name.rpartition("/")[2] for method, name in stores["batches"].calls if method == "local"}
    assert read == {"output.jsonl", "errors.jsonl", "input.jsonl"}


def test_names_stay_under_the_owners_prefix(tmp_path: Path) -> None:
    """The objects of a batch made through the API, as names: its owner's hash, its id, its parts."""
    with TestClient(app_with(FakeEngine(), api_keys=KEYS, **settings(tmp_path))) as client:
        sdk = sdk_for(client, "sk-owner")
        done = wait(sdk, submit(sdk, LINES).id)
    names = asyncio.run(DiskBlobs.at(tmp_path / "batches").list(""))
    home = {n.partition("/")[0] for n in names if not n.startswith((".spool/", PENDING, "pending."))}
    assert len(home) == 1
    assert len(home.pop()) == 32
    assert {n.rpartition("/")[2] for n in names if done.id in n} >= {RECORD, INPUT, "output.jsonl"}
    assert not [n for n in names if n.startswith(PENDING)]  # done: out of the index
