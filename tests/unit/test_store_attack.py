"""The batch lane's stores attacked on every backend (SQLite or a real redis-server for the records,
a directory or moto's S3 for the contents): a store that fails at each step of an upload or a batch
create leaves nothing behind that nobody will ever remove; two replicas on one store answer every
line once; a store that fails after a route has checked its id is still a 503 before the first
byte; nothing secret reaches the logs."""

from __future__ import annotations

import asyncio
import json
import secrets
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from gateway.errors import StoreUnavailable
from gateway.protocol.batch_objects import Batch, Owner, StoredBatch
from gateway.stores.batchdb import Records, RedisRecords, SqliteRecords
from gateway.stores.batches import BatchStore, FileStore, new_id
from gateway.stores.blobs import Blobs, LocalBlobs, open_blob, unavailable
from tests.fakes import FakeEngine, app_with
from tests.stores import Flaky, failing_stores
from tests.unit.test_batches import by_custom_id, chat_line, jsonl, lines_of, settings, submit, wait
from tests.unit.test_responses import sdk_for
from tests.waits import until_sync

LINES = jsonl(chat_line("a"), chat_line("b"))


def contents(blobs: Blobs) -> list[str]:
    """Every content the store holds, by name (a test's view)."""
    if isinstance(blobs, LocalBlobs):
        return sorted(p.name for p in blobs.root.iterdir() if p.is_file()) if blobs.root.exists() else []
    listed = blobs.client.list_objects_v2(Bucket=blobs.bucket, Prefix=blobs.root)  # type: ignore[attr-defined]
    return sorted(item["Key"] for item in listed.get("Contents", []))


def _stored(owner: str = "t") -> StoredBatch:
    now = int(time.time())
    batch = Batch(id=new_id(), endpoint="/v1/chat/completions", input_file_id="file-" + "0" * 24, status="validating",
                  created_at=now, expires_at=now + 86400)
    return StoredBatch(batch=batch, owner=Owner(key_id=owner, tenant=owner), output_expires_after_s=3600)


# --- a store failing mid-way leaves nothing no one removes ---------------------------------------------


@pytest.mark.parametrize("failing", ["put_file", "add_file"])
async def test_an_upload_cut_short_by_the_store_leaves_no_object(blobs: Blobs, tmp_path: Path, failing: str) -> None:
    """The content is handed over, then the record written: when the second fails, the content (one
    no listing shows, that no delete reaches) is not left behind."""
    flaky = Flaky()
    flaky.refuse = lambda method: method == failing
    mine = FileStore(flaky.wrap(SqliteRecords(tmp_path / "db.sqlite3")), flaky.wrap(blobs)).of("t")
    staged = await mine.stage()
    await staged.write(LINES)
    with pytest.raises(StoreUnavailable):
        await mine.put(staged, "in.jsonl", "batch", 3600)
    await staged.discard()
    assert contents(blobs) == []
    assert list(blobs.spool.iterdir()) == []


@pytest.mark.parametrize("failing", ["put_file", "create"])
async def test_a_create_cut_short_at_any_step_leaves_nothing(blobs: Blobs, tmp_path: Path, failing: str) -> None:
    """A batch create that the store fails at its input or its record: the batch is not there, and its
    input (a 200 MB blob no batch names) is not kept."""
    flaky = Flaky()
    flaky.refuse = lambda method: method == failing
    store = BatchStore(flaky.wrap(SqliteRecords(tmp_path / "db.sqlite3")), flaky.wrap(blobs))
    made = _stored()
    with pytest.raises(StoreUnavailable):
        await store.of("t").create(made, LINES)
    flaky.refuse = lambda method: False
    assert await store.records.runnable() == []
    assert contents(blobs) == []


# --- a store failing after the id was checked: a 503 before the first byte ------------------------------


def test_a_message_batchs_results_are_a_503_when_the_store_fails_after_the_check(tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch is found (its record read), then the store fails as its results are read: the answer
    is a 503 in Anthropic's shape, not a 200 whose body stops short."""
    from tests.unit.test_message_batches import BATCHES, params

    made = failing_stores(monkeypatch)
    anthropic = {"x-api-key": "sk-owner", "anthropic-version": "2023-06-01"}
    with TestClient(app_with(FakeEngine(), api_keys=["sk-owner"], **settings(tmp_path))) as client:
        batch = client.post(BATCHES, json={"requests": [{"custom_id": "a", "params": params()}]}, headers=anthropic).json()
        until_sync(lambda: client.get(f"{BATCHES}/{batch['id']}", headers=anthropic).json()["processing_status"] == "ended",
                   what="the batch ended")
        made["batches"].refuse = lambda method: method == "answers"
        answer = client.get(f"{BATCHES}/{batch['id']}/results", headers=anthropic)
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["type"] == "api_error"


# --- two replicas on one store, on each backend -----------------------------------------------------------


@pytest.fixture(params=["disk", "redis", "s3"])
def store_settings(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """The `store` settings of an app on each backend (a fresh prefix or bucket per test)."""
    if request.param == "disk":
        yield {}
    elif request.param == "redis":
        server = request.getfixturevalue("redis_server")
        yield {"store": {"backend": "redis", "redis_url": server.url, "redis_prefix": f"t{secrets.token_hex(4)}:"}}
    else:
        from tests.s3_server import shared

        s3 = shared()
        yield {"store": {"backend": "s3", "s3_endpoint_url": s3.url, "s3_bucket": s3.bucket(),
                         "s3_access_key_id": "test", "s3_secret_access_key": "test", "s3_timeout_s": 10}}


def test_two_replicas_on_one_store_answer_each_line_once(tmp_path: Path, store_settings: dict[str, Any]) -> None:
    one, two = FakeEngine(delay=0.02), FakeEngine(delay=0.02)
    # leases that do not run out, however slow the machine: no take-over, so each line runs once
    config = {**settings(tmp_path, max_in_flight=3, lease_s=30), **store_settings}
    with TestClient(app_with(one, **config)) as a, TestClient(app_with(two, **config)) as b:
        batches = [submit(sdk_for(a if i % 2 else b), jsonl(*(chat_line(f"r{i}.{n}") for n in range(8))))
                   for i in range(4)]
        for i, batch in enumerate(batches):
            done = wait(sdk_for(b), batch.id, timeout=60)
            assert done.status == "completed"
            assert done.request_counts.model_dump() == {"total": 8, "completed": 8, "failed": 0}
            output = by_custom_id(lines_of(sdk_for(a if i % 2 else b), done.output_file_id))
            assert set(output) == {f"r{i}.{n}" for n in range(8)}
    assert len(one.requests) + len(two.requests) == 32  # every line run once, on one replica or the other


def test_a_replica_killed_mid_batch_is_taken_over_once_its_claim_lapses(tmp_path: Path, store_settings: dict[str, Any],
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A's claims are never released (a kill, not a shutdown): B claims the batch once A's claim has
    lapsed, and every line is answered once."""
    async def kept(self: Records, batch_id: str, token: int) -> None:
        return None

    monkeypatch.setattr(SqliteRecords, "release", kept)
    monkeypatch.setattr(RedisRecords, "release", kept)
    one, two = FakeEngine(delay=0.05), FakeEngine(delay=0.01)
    config = {**settings(tmp_path, max_in_flight=2, lease_s=1.0), **store_settings}
    with TestClient(app_with(one, **config)) as a:
        sdk = sdk_for(a)
        batch = submit(sdk, jsonl(*(chat_line(f"r{i}", max_tokens=4) for i in range(16))))
        until_sync(lambda: sdk.batches.retrieve(batch.id).request_counts.completed >= 3, 60, "3 lines done")
    with TestClient(app_with(two, **config)) as b:
        done = wait(sdk_for(b), batch.id, timeout=60)
        output = by_custom_id(lines_of(sdk_for(b), done.output_file_id))
    assert done.status == "completed"
    assert set(output) == {f"r{i}" for i in range(16)}
    assert done.request_counts.model_dump() == {"total": 16, "completed": 16, "failed": 0}


def test_an_expired_batchs_counts_are_its_answers_on_every_backend(tmp_path: Path, store_settings: dict[str, Any],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch whose window ends mid-run, more lines left than one write of expired answers takes: each line in one
    file once, and the counts and token totals exactly those of the lines in the files."""
    monkeypatch.setattr("gateway.stores.batches.WINDOW_S", 2)
    config = {**settings(tmp_path, max_in_flight=2), **store_settings}
    with TestClient(app_with(FakeEngine(delay=0.01), **config)) as client:
        sdk = sdk_for(client)
        batch = submit(sdk, jsonl(*(chat_line(f"r{i}") for i in range(1100))))
        done = wait(sdk, batch.id, timeout=60)
        output, errors = by_custom_id(lines_of(sdk, done.output_file_id)), by_custom_id(lines_of(sdk, done.error_file_id))
    assert done.status == "expired"
    assert set(output) | set(errors) == {f"r{i}" for i in range(1100)}
    assert (done.request_counts.completed, done.request_counts.failed) == (len(output), len(errors)) == (
        len(output), 1100 - len(output))
    usage = [line["response"]["body"]["usage"] for line in output.values()]
    assert (done.usage.input_tokens, done.usage.output_tokens) == (sum(u["prompt_tokens"] for u in usage),
                                                                  sum(u["completion_tokens"] for u in usage))
    assert all(line["error"]["code"] == "batch_expired" for line in errors.values())


# --- nothing secret in the logs -----------------------------------------------------------------------


async def test_a_store_that_is_down_logs_no_password_or_secret_key(capsys: pytest.CaptureFixture[str],
                                                                   tmp_path: Path) -> None:
    from gateway.settings import StoreSettings
    from gateway.stores.blobs_s3 import S3Blobs
    from gateway.stores.redis import RedisPools

    pools = RedisPools()
    redis_url = f"unix://:redis-password-1234@{tmp_path / 'none.sock'}?db=0"
    s3 = StoreSettings(backend="s3", s3_endpoint_url="http://127.0.0.1:9", s3_bucket="b", s3_timeout_s=1,
                       s3_access_key_id="AKIAEXAMPLE", s3_secret_access_key="s3-secret-key-5678")
    with pytest.raises(StoreUnavailable):
        await RedisRecords(pools.client(redis_url, 1), "x:").file("t", "file-" + "0" * 24)
    blobs = S3Blobs.from_settings(s3, "files", tmp_path)
    with pytest.raises(StoreUnavailable), unavailable():
        await open_blob(blobs, "a")
    await blobs.aclose()
    await pools.aclose()
    captured = capsys.readouterr()
    logged = captured.out + captured.err
    assert "store_unavailable" in logged
    for secret in ("redis-password-1234", "s3-secret-key-5678"):
        assert secret not in logged
    json.dumps(logged)


# --- a run killed mid-way ----------------------------------------------------------------------------------


def test_a_run_killed_while_expiring_a_batch_counts_its_expired_lines(tmp_path: Path) -> None:
    """The unrun lines were written as expired, then the runner died before the record said `expired`:
    the next run finds nothing left to expire, and still counts those lines as expired, not errored."""
    from gateway.apis.batches.batches_input import MESSAGES
    from gateway.apis.batches.batches_line import result_line
    from gateway.protocol.batch_objects import RequestCounts
    from gateway.stores.batchdb import Answer
    from gateway.stores.batches import MESSAGE_BATCH
    from tests.stores import disk_batches
    from tests.unit.test_message_batches import params, results
    from tests.unit.test_message_batches import wait as wait_ended

    store, now = disk_batches(tmp_path / "batches"), int(time.time())
    batch_id = new_id(MESSAGE_BATCH)
    batch = Batch(id=batch_id, endpoint=MESSAGES, input_file_id=batch_id, status="in_progress", created_at=now - 86400,
                  expires_at=now - 1, in_progress_at=now - 86400, request_counts=RequestCounts(total=2))
    stored = StoredBatch(batch=batch, owner=Owner(key_id="anonymous", tenant="anonymous"), output_expires_after_s=3600)
    lines = b"".join(json.dumps({"custom_id": c, "method": "POST", "url": MESSAGES, "body": params()}).encode() + b"\n"
                     for c in ("a", "b"))
    mine = store.of("anonymous", MESSAGE_BATCH)
    asyncio.run(mine.create(stored, lines))

    async def expired_then_killed() -> None:
        token = await store.records.claim(batch_id, "killed", 0.01)  # its claim lapses at once: never released
        assert token is not None
        await store.records.answer_all(batch_id, token, [Answer(c, False, result_line(c, None), expired=True) for c in "ab"])

    asyncio.run(expired_then_killed())
    with TestClient(app_with(FakeEngine(), **settings(tmp_path))) as client:
        done = wait_ended(client, batch_id)
        found = results(client, done)
    assert done.request_counts.model_dump() == {"processing": 0, "succeeded": 0, "errored": 0, "canceled": 0,
                                                "expired": 2}
    assert set(found) == {"a", "b"}


# --- many objects at once ------------------------------------------------------------------------------------


async def test_an_owner_with_many_files_and_batches_lists_them(records: Records) -> None:
    from gateway.protocol.batch_objects import FileObject

    now = int(time.time())
    ids = [f"file-{i:024x}" for i in range(150)]
    for file_id in ids:
        await records.add_file("t", FileObject(id=file_id, bytes=1, created_at=now, filename="f", purpose="batch",
                                               expires_at=now + 3600))
        await records.create(_stored())
    mine = FileStore(records, LocalBlobs(Path("/nonexistent"))).of("t")
    for page, more in await asyncio.gather(*(mine.page(None, None, 200, False) for _ in range(8))):
        assert [f.id for f in page] == ids
        assert not more
    batches = BatchStore(records, LocalBlobs(Path("/nonexistent")))
    for listed, _ in await asyncio.gather(*(batches.of("t").page(None, 200) for _ in range(8))):
        assert len(listed) == 150


# --- tenancy: ids crafted, or another owner's ------------------------------------------------------------

CRAFTED = ["file-" + "A" * 24, "file-" + "0" * 24 + "\n", "file-" + "\u0660" * 24, "file-" + "0" * 25, "file-" + "0" * 10_000,
           "file-../" + "0" * 19, "file-" + "0" * 23 + "/", "FILE-" + "0" * 24, " file-" + "0" * 24]


def _batch_crafted(kind: str) -> list[str]:
    hexes = "0" * 32
    return [kind + "A" * 32, kind + hexes + "\n", kind + "\u0660" * 32, kind + hexes + "0", kind + "0" * 10_000,
            kind + "../" + hexes[:29], kind.upper() + hexes, " " + kind + hexes, kind + hexes[:31] + "/"]


async def test_another_owners_or_a_crafted_id_is_none_of_mine(records: Records, tmp_path: Path) -> None:
    from gateway.errors import InvalidRequest, NotFound
    from gateway.stores.batches import MESSAGE_BATCH

    blobs = LocalBlobs(tmp_path / "store")
    files, batches = FileStore(records, blobs), BatchStore(records, blobs)
    staged = await files.of("owner").stage()
    await staged.write(LINES)
    theirs = await files.of("owner").put(staged, "in.jsonl", "batch", 3600)
    made, message = _stored("owner"), _stored("owner")
    message.batch.id = new_id(MESSAGE_BATCH)
    await batches.of("owner").create(made, LINES)
    await batches.of("owner", MESSAGE_BATCH).create(message, LINES)
    for owner in ("other", "owner/..", "owner\n", "Owner", ""):
        mine = files.of(owner)
        for file_id in [theirs.id, *CRAFTED]:
            for call in (mine.get, mine.open, mine.delete):
                with pytest.raises(NotFound):
                    await call(file_id)
        with pytest.raises(InvalidRequest):
            await mine.page(None, theirs.id, 10, False)
        for kind, batch_id in (("batch_", made.batch.id), (MESSAGE_BATCH, message.batch.id)):
            view = batches.of(owner, kind)
            for crafted in [batch_id, *_batch_crafted(kind)]:
                for find in (view.find, view.cancel, view.delete):
                    with pytest.raises(NotFound):
                        await find(crafted)
            with pytest.raises(InvalidRequest):
                await view.page(batch_id, 10)
            with pytest.raises(InvalidRequest):
                await view.page(None, 10, before=batch_id)
    with pytest.raises(NotFound):  # each API's view sees only its own kind, for the owner too
        await batches.of("owner").find(message.batch.id)
    with pytest.raises(NotFound):
        await batches.of("owner", MESSAGE_BATCH).find(made.batch.id)
    assert (await files.of("owner").get(theirs.id)).id == theirs.id  # nothing of the owner's was touched
    found = await records.batch(made.batch.id)
    assert found is not None
    assert (found.batch.status, found.batch.cancelling_at) == ("validating", None)  # no cancel asked


# --- the disk backend: a write that fails leaves no temporary file -----------------------------------------


def test_a_disk_write_that_fails_leaves_no_temporary_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk that fails as a content is moved in (full, or the spool on another disk) fails the call
    (a 503), and leaves no temporary file beside the contents (no one would ever remove it)."""
    import errno
    import os

    store = LocalBlobs(tmp_path / "store")
    source = tmp_path / "source"
    source.write_bytes(b"upload")

    def not_moved(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", not_moved)
        with pytest.raises(StoreUnavailable):
            asyncio.run(store.put_file("moved", source))
    assert [p.name for p in (tmp_path / "store").iterdir()] == []
    assert not source.exists()  # the store's even when it failed


# --- the routes with the store failing at each of its calls ------------------------------------------------


@pytest.mark.parametrize("step", [("files", "put_file"), ("files", "add_file"), ("files", "local"),
                                  ("batches", "put_file"), ("batches", "create")])
def test_an_upload_or_create_failing_at_each_call_is_a_503_and_leaves_no_spool_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: tuple[str, str]) -> None:
    made = failing_stores(monkeypatch)
    big = jsonl(*(chat_line(f"r{i}", content="x" * 1000) for i in range(300)))  # over a chunk: streamed
    with TestClient(app_with(FakeEngine(), api_keys=["sk-owner"], **settings(tmp_path, enabled=False))) as client:
        headers = {"authorization": "Bearer sk-owner"}
        part, method = step
        if part == "files" and method != "local":
            made[part].refuse = lambda called: called == method
            answer = client.post("/v1/files", files={"file": ("in.jsonl", big)}, data={"purpose": "batch"},
                                 headers=headers)
        else:
            uploaded = client.post("/v1/files", files={"file": ("in.jsonl", big)}, data={"purpose": "batch"},
                                   headers=headers).json()
            made[part].refuse = lambda called: called == method
            answer = client.post("/v1/batches", headers=headers, json={
                "input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"})
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "service_unavailable"
        made[part].refuse = lambda called: False
        assert client.get("/v1/batches", headers=headers).json()["data"] == []
    for spool in (tmp_path / "files" / ".spool", tmp_path / "batches" / ".spool"):
        assert not spool.exists() or list(spool.iterdir()) == []


def test_a_run_that_dies_between_publishing_and_completed_publishes_once(
        tmp_path: Path, store_settings: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The output published as a file, then the run dies before the record says `completed`: the next
    run publishes it again under the same id (replaced, not a second file) and completes."""
    from gateway.stores.batches import OwnedFiles

    put, died = OwnedFiles.put, []

    async def dies_after(self: OwnedFiles, *args: Any, **kwargs: Any) -> Any:
        made = await put(self, *args, **kwargs)
        if not died and made.purpose == "batch_output":
            died.append(made.id)
            raise RuntimeError("killed right after publishing")
        return made

    monkeypatch.setattr(OwnedFiles, "put", dies_after)
    config = {**settings(tmp_path, lease_s=0.5), **store_settings}
    with TestClient(app_with(FakeEngine(), **config)) as client:
        sdk = sdk_for(client)
        done = wait(sdk, submit(sdk, jsonl(*(chat_line(f"r{i}") for i in range(5)))).id, timeout=90)  # a bound on a loaded machine
        output = by_custom_id(lines_of(sdk, done.output_file_id))
        listed = [f.id for f in sdk.files.list().data]
    assert died == [done.output_file_id]
    assert done.status == "completed"
    assert set(output) == {f"r{i}" for i in range(5)}
    assert len(listed) == 2  # the input and one output


def test_one_unreadable_record_stops_no_other_batch(tmp_path: Path) -> None:
    """A record the runner cannot read (a disk that corrupted it, a hand edit, a version whose record
    this one does not know) fails that batch alone: the runner keeps running every other."""
    from tests.stores import disk_batches

    store = disk_batches(tmp_path / "batches")
    bad = _stored("anonymous")
    asyncio.run(store.of("anonymous").create(bad, LINES))
    asyncio.run(store.aclose())
    with sqlite3.connect(tmp_path / "batches" / "batches.sqlite3") as db:
        db.execute("UPDATE batches SET record = ? WHERE id = ?", ('{"batch": {"id": 1', bad.batch.id))
    with TestClient(app_with(FakeEngine(), **settings(tmp_path))) as client:
        sdk = sdk_for(client)
        done = wait(sdk, submit(sdk, LINES).id, timeout=10)
        corrupt = sdk.files.create(file=("in.jsonl", LINES), purpose="batch")
        with sqlite3.connect(tmp_path / "files" / "files.sqlite3") as db:
            db.execute("UPDATE files SET record = '{' WHERE id = ?", (corrupt.id,))
        listed = [b.id for b in sdk.batches.list().data]
        files = [f.id for f in sdk.files.list().data]
        missing = client.get(f"/v1/batches/{bad.batch.id}")
    assert done.status == "completed"
    assert listed == [done.id]  # the owner's listing still answers, without the unreadable one
    assert corrupt.id not in files
    assert done.input_file_id in files
    assert missing.status_code == 404


def test_the_runner_outlives_a_poll_that_fails_unexpectedly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A poll that raises what no one foresaw (a bug, a record of a kind not known) is logged and the
    next poll comes: the runner's loop is the only one, and it must not end."""
    runnable, failed = SqliteRecords.runnable, []

    async def fails_once(self: SqliteRecords) -> Any:
        if not failed:
            failed.append(True)
            raise KeyError("unforeseen")
        return await runnable(self)

    monkeypatch.setattr(SqliteRecords, "runnable", fails_once)
    with TestClient(app_with(FakeEngine(), **settings(tmp_path))) as client:
        sdk = sdk_for(client)
        done = wait(sdk, submit(sdk, LINES).id, timeout=10)
    assert failed
    assert done.status == "completed"
