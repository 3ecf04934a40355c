"""The batch lane's records (`stores.batchdb`) on each backend (SQLite, a real redis-server): each
line answered once (a constraint, not a convention), a batch claimed by one replica at a time and
every write of a run fenced by its token (a replica that stalled past its claim cannot write after
another took over), counts and a cancel kept beside the record; and a store that is down: a 503 in
the route's own error shape on every route of the lane (the server serving the rest meanwhile), and
a runner that outlives the outage and answers every line once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sqlite3
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson
import pytest
from starlette.testclient import TestClient

from gateway.errors import StoreUnavailable
from gateway.protocol.batch_objects import Batch, Owner, StoredBatch
from gateway.stores.batchdb import PAGE, SCHEMA, Answer, Fenced, Records, RedisRecords, SqliteRecords
from gateway.stores.batches import input_name, new_id
from gateway.stores.redis import RedisPools
from tests.fakes import FakeEngine, app_with
from tests.redis_server import RedisServer
from tests.stores import Flaky, failing_stores
from tests.unit.test_batches import KEYS, by_custom_id, chat_line, completed, jsonl, lines_of, settings, submit, wait
from tests.unit.test_message_batches import BATCHES, params
from tests.unit.test_responses import sdk_for
from tests.waits import until, until_awaited, until_sync

LINES = jsonl(chat_line("a"), chat_line("b"))


def stored(status: str = "in_progress", owner: str = "t") -> StoredBatch:
    now = int(time.time())
    batch = Batch(id=new_id(), endpoint="/v1/chat/completions", input_file_id="file-" + "0" * 24, status=status,
                  created_at=now, expires_at=now + 86400)
    return StoredBatch(batch=batch, owner=Owner(key_id=owner, tenant=owner), output_expires_after_s=3600,
                       created_ns=time.time_ns())


async def claimed(records: Records, batch_id: str, holder: str) -> int:
    """The batch claimed by `holder` once the claim on it has lapsed."""
    token = await until_awaited(lambda: records.claim(batch_id, holder, 30), what=f"{holder} claims {batch_id}")
    assert token is not None
    return token


async def one(records: Records, batch_id: str, token: int, answer: Answer) -> bool:
    """The answer written alone; whether it was kept."""
    return await records.answer_all(batch_id, token, [answer]) == 1


def answer(custom_id: str, ok: bool = True, content: str = "x") -> Answer:
    return Answer(custom_id, ok, orjson.dumps({"custom_id": custom_id, "content": content}), prompt=2, completion=3)


# --- the records, on each backend ---------------------------------------------------------------------


async def test_each_line_is_answered_once_the_first_kept(records: Records) -> None:
    made = stored()
    await records.create(made)
    token = await records.claim(made.batch.id, "a", 30)
    assert token is not None
    assert await one(records, made.batch.id, token, answer("r1", content="first"))
    assert not await one(records, made.batch.id, token, answer("r1", content="again"))  # the constraint refuses it
    assert not await one(records, made.batch.id, token, answer("r1", ok=False))
    assert await one(records, made.batch.id, token, answer("r2", ok=False))
    kept = [(a.custom_id, a.ok, orjson.loads(a.line)["content"]) async for page in records.answers(made.batch.id) for a in page]
    assert kept == [("r1", True, "first"), ("r2", False, "x")]
    assert await records.answered(made.batch.id) == {"r1", "r2"}
    found = await records.batch(made.batch.id)
    assert found is not None
    assert (found.batch.request_counts.completed, found.batch.request_counts.failed) == (1, 1)  # counted once each
    assert (found.batch.usage.input_tokens, found.batch.usage.output_tokens) == (4, 6)


async def test_answers_written_together_are_each_kept_once_and_fenced_together(records: Records) -> None:
    made = stored()
    await records.create(made)
    token = await records.claim(made.batch.id, "a", 30)
    assert token is not None
    assert await records.answer_all(made.batch.id, token, [answer("r1"), answer("r2", ok=False)]) == 2
    assert await records.answer_all(made.batch.id, token, [answer("r2", content="again"), answer("r3")]) == 1
    kept = [(a.custom_id, a.ok, orjson.loads(a.line)["content"]) async for page in records.answers(made.batch.id) for a in page]
    assert kept == [("r1", True, "x"), ("r2", False, "x"), ("r3", True, "x")]
    found = await records.batch(made.batch.id)
    assert found is not None
    assert (found.batch.request_counts.completed, found.batch.request_counts.failed) == (2, 1)
    assert (found.batch.usage.input_tokens, found.batch.usage.output_tokens) == (6, 9)
    await records.release(made.batch.id, token)
    assert await records.claim(made.batch.id, "b", 30) is not None
    with pytest.raises(Fenced):
        await records.answer_all(made.batch.id, token, [answer("r4"), answer("r5")])
    assert await records.answered(made.batch.id) == {"r1", "r2", "r3"}


async def test_a_line_twice_in_one_write_is_kept_and_counted_once(records: Records) -> None:
    """Within one `answer_all` as across two: the first answer of a line kept, counted once (an expired line too),
    and answers past a page read back whole, in order."""
    made = stored()
    await records.create(made)
    token = await records.claim(made.batch.id, "a", 30)
    assert token is not None
    expired = [Answer(f"e{i}", False, b"{}", expired=True) for i in range(PAGE + 100)]
    written = [answer("r1"), answer("r1", ok=False), answer("r2", ok=False), expired[0], expired[0], *expired]
    assert await records.answer_all(made.batch.id, token, written) == 2 + len(expired)
    assert await records.answer_all(made.batch.id, token, expired) == 0
    found = await records.batch(made.batch.id)
    assert found is not None
    counts = found.batch.request_counts
    assert (counts.completed, counts.failed, found.expired_lines) == (1, 1 + len(expired), len(expired))
    assert (found.batch.usage.input_tokens, found.batch.usage.output_tokens) == (4, 6)
    kept = [(a.custom_id, a.ok, a.expired) async for page in records.answers(made.batch.id) for a in page]
    assert kept == [("r1", True, False), ("r2", False, False), *((a.custom_id, False, True) for a in expired)]


async def test_one_claim_at_a_time_and_a_stale_token_is_fenced(records: Records) -> None:
    made = stored()
    await records.create(made)
    batch_id = made.batch.id
    first = await records.claim(batch_id, "a", 30)
    assert first is not None
    assert await records.claim(batch_id, "b", 30) is None  # held
    assert await records.renew(batch_id, first, 30)
    await records.release(batch_id, first)
    second = await records.claim(batch_id, "b", 30)  # released: claimed at once
    assert second is not None
    assert second > first
    assert not await records.renew(batch_id, first, 30)  # the old holder finds out
    with pytest.raises(Fenced):
        await one(records, batch_id, first, answer("late"))
    with pytest.raises(Fenced):
        await records.save(made, first)
    assert await records.answered(batch_id) == set()
    await records.save(made, second)
    made.batch.status = "completed"
    await records.save(made, second)
    assert batch_id not in await records.runnable()  # done: never claimed again
    await records.release(batch_id, second)
    assert await records.claim(batch_id, "c", 30) is None


async def test_a_claim_lapses_and_a_cancel_is_kept_beside_the_record(records: Records) -> None:
    made = stored()
    await records.create(made)
    batch_id = made.batch.id
    assert await records.claim(batch_id, "a", 0.2) is not None
    taken = await claimed(records, batch_id, "b")  # the lapsed claim taken
    await records.ask_cancel(batch_id)
    await records.save(made, taken)  # a runner's write of the record keeps the cancel asked
    found = await records.batch(batch_id)
    assert found is not None
    assert found.batch.status == "cancelling"
    assert found.batch.cancelling_at is not None


async def test_a_batch_is_its_owners_and_leaves_nothing_when_removed(records: Records) -> None:
    mine, theirs = stored(owner="t"), stored(owner="t:x")
    for made in (mine, theirs):
        await records.create(made)
    assert [s.batch.id for s in await records.batches("t")] == [mine.batch.id]
    assert await records.runnable() == [mine.batch.id, theirs.batch.id]  # oldest first
    token = await records.claim(mine.batch.id, "a", 30)
    assert token is not None
    assert await one(records, mine.batch.id, token, answer("r1"))
    await records.remove(mine.batch.id)
    assert await records.batch(mine.batch.id) is None
    assert await records.answered(mine.batch.id) == set()  # its answers with it
    assert await records.batches("t") == []
    assert await records.runnable() == [theirs.batch.id]


async def test_a_cancel_of_a_batch_removed_meanwhile_leaves_nothing(records: Records) -> None:
    made = stored()
    await records.create(made)
    await records.remove(made.batch.id)
    await records.ask_cancel(made.batch.id)  # its find came just before the remove
    assert await records.batch(made.batch.id) is None
    if isinstance(records, RedisRecords):  # no stray hash of a cancel under the batch's key
        assert not await records._redis.exists(records._batch(made.batch.id))


async def test_a_store_closed_opens_again_at_its_next_call(records: Records) -> None:
    made = stored()
    await records.create(made)
    await records.aclose()
    found = await records.batch(made.batch.id)  # SQLite's closed connection was taken for an open one
    assert found is not None
    assert found.batch.id == made.batch.id


async def test_a_sqlite_call_made_while_the_store_closes_uses_a_connection_of_its_own(tmp_path: Path) -> None:
    """A call made once `aclose` has begun (a run still writing at shutdown) runs in the new thread while the close
    waits behind a call still running in the old one: it opens a connection of its own. It took the old thread's
    connection (sqlite3 refuses one made in another thread: a 503), and the close then forgot the new one."""
    records = SqliteRecords(tmp_path / "db.sqlite3")
    made = stored()
    await records.create(made)
    release, old = threading.Event(), records._thread
    busy = asyncio.ensure_future(records._run(lambda db: release.wait(30)))
    closing = asyncio.ensure_future(records.aclose())
    await until(lambda: records._thread is not old, what="the close begun")
    try:
        found = await records.batch(made.batch.id)
        assert found is not None
    finally:
        release.set()
        await busy
        await closing
    assert await records.batch(made.batch.id) is not None
    await records.aclose()


async def test_a_sqlite_database_made_before_its_triggers_gets_them(tmp_path: Path) -> None:
    """A database of an earlier version (its tables, no triggers) counts each answer and removes a
    batch's answers with it once opened."""
    path = tmp_path / "db.sqlite3"
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.executescript(SCHEMA[: SCHEMA.index("CREATE TRIGGER")])
    records = SqliteRecords(path)
    made = stored()
    await records.create(made)
    token = await records.claim(made.batch.id, "a", 30)
    assert token is not None
    assert await one(records, made.batch.id, token, answer("r1"))
    found = await records.batch(made.batch.id)
    assert found is not None
    assert found.batch.request_counts.completed == 1
    await records.remove(made.batch.id)
    assert await records.answered(made.batch.id) == set()
    await records.aclose()


async def test_sqlite_calls_do_not_wait_for_the_default_executor(tmp_path: Path) -> None:
    """The SQLite store's calls run in a thread of its own: a default executor kept busy by other work
    (every `asyncio.to_thread`) does not hold them up."""
    loop = asyncio.get_running_loop()
    loop.set_default_executor(ThreadPoolExecutor(1))
    release = threading.Event()
    busy = loop.run_in_executor(None, release.wait)
    records = SqliteRecords(tmp_path / "db.sqlite3")
    try:
        made = stored()
        create = asyncio.ensure_future(records.create(made))
        done, _ = await asyncio.wait({create}, timeout=20)  # a guard on the test (it hung before), not a measurement
        assert create in done
        assert await records.batch(made.batch.id) is not None
    finally:
        release.set()
        await busy
        await records.aclose()


async def test_a_replica_stalled_mid_write_on_redis_has_its_late_write_refused(redis_server: RedisServer) -> None:
    """Two replicas (each its own connections) on one Redis. A claims a batch and answers a line,
    then stalls mid-batch (its renewals never come: a pause, a partition): its claim lapses, B claims
    the batch and answers; when A goes on, its late writes (the line B answered, the next line, its
    record) are refused, and B's answers stand."""
    replicas = [RedisPools(), RedisPools()]
    a, b = (RedisRecords(pools.client(redis_server.url, 5), "stall:") for pools in replicas)
    made = stored()
    await a.create(made)
    batch_id = made.batch.id
    token_a = await a.claim(batch_id, "a", 0.3)
    assert token_a is not None
    assert await one(a, batch_id, token_a, answer("r0"))
    token_b = await claimed(b, batch_id, "b")  # A stalled: its claim lapsed
    assert await one(b, batch_id, token_b, answer("r1", content="B's"))
    for late in (one(a, batch_id, token_a, answer("r1", content="A's, late")), one(a, batch_id, token_a, answer("r2")),
                 a.save(made, token_a)):
        with pytest.raises(Fenced):
            await late
    assert not await a.renew(batch_id, token_a, 30)
    kept = {x.custom_id: orjson.loads(x.line)["content"] async for page in b.answers(batch_id) for x in page}
    assert kept == {"r0": "x", "r1": "B's"}
    for pools in replicas:
        await pools.aclose()


async def test_a_killed_or_stalled_redis_is_unavailable(redis_server: RedisServer) -> None:
    pools = RedisPools()
    records = RedisRecords(pools.client(redis_server.url, 0.3), "down:")
    made = stored()
    await records.create(made)
    assert redis_server.process is not None
    redis_server.process.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(StoreUnavailable):
            await records.batch(made.batch.id)
    finally:
        redis_server.process.send_signal(signal.SIGCONT)
    redis_server.process.kill()
    redis_server.process.wait()
    for call in (records.batch(made.batch.id), records.claim(made.batch.id, "a", 1), records.runnable(),
                 records.file("t", "file-" + "0" * 24)):
        with pytest.raises(StoreUnavailable):
            await call
    redis_server.start()  # back at the same address: the store serves again
    assert await records.batch(made.batch.id) is None  # it kept nothing (no persistence in this test's Redis)
    await pools.aclose()


def test_the_redis_backend_needs_its_url() -> None:
    from gateway.settings import StoreSettings

    with pytest.raises(ValueError, match="redis_url"):
        StoreSettings(backend="redis")


# --- a store that is down -----------------------------------------------------------------------------


@pytest.fixture
def stores(monkeypatch: pytest.MonkeyPatch) -> dict[str, Flaky]:
    return failing_stores(monkeypatch)


def down(stores: dict[str, Flaky], is_down: bool = True) -> None:
    for part in stores.values():
        part.down = is_down


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
        batches = stores["batches"]
        down(stores)  # down as the runner polls: its polls refused, it polls again
        until_sync(lambda: batches.refused >= 2, what="two polls refused")
        down(stores, False)
        sdk = sdk_for(client)
        batch = submit(sdk, jsonl(*(chat_line(f"r{i}", max_tokens=4) for i in range(12))))
        completed(sdk, batch.id, 3)
        refused = batches.refused
        down(stores)  # down mid-run: the run fails here; the batch is claimed again once its claim lapses
        until_sync(lambda: batches.refused >= refused + 2, what="two more refusals")
        down(stores, False)
        done = wait(sdk, batch.id)
        output = by_custom_id(lines_of(sdk, done.output_file_id))
        again = wait(sdk, submit(sdk, jsonl(chat_line("after"))).id)  # the runner still runs
    assert done.status == "completed"
    assert set(output) == {f"r{i}" for i in range(12)}
    assert done.request_counts.model_dump() == {"total": 12, "completed": 12, "failed": 0}
    assert again.status == "completed"


def test_a_message_batchs_results_are_read_from_its_answers(tmp_path: Path, stores: dict[str, Flaky]) -> None:
    with TestClient(app_with(FakeEngine(), api_keys=KEYS, **settings(tmp_path))) as client:
        made = client.post(BATCHES, json={"requests": [{"custom_id": c, "params": params()} for c in "ab"]},
                           headers=ANTHROPIC).json()
        until_sync(lambda: client.get(f"{BATCHES}/{made['id']}", headers=ANTHROPIC).json()["processing_status"] == "ended",
                   what="the batch ended")
        stores["batches"].calls.clear()
        answer = client.get(f"{BATCHES}/{made['id']}/results", headers=ANTHROPIC)
    assert [json.loads(line)["custom_id"] for line in answer.text.splitlines()] == ["a", "b"]
    assert ("answers", made["id"]) in stores["batches"].calls
    assert ("local", input_name(made["id"])) in stores["batches"].calls


def test_a_batch_keeps_its_input_and_its_records_only(tmp_path: Path) -> None:
    """A batch made through the API: its input one blob named by its id, its answers in the database;
    its output a file of the Files API (a blob named by its id). Nothing is named by its owner."""
    with TestClient(app_with(FakeEngine(), api_keys=KEYS, **settings(tmp_path))) as client:
        sdk = sdk_for(client, "sk-owner")
        done = wait(sdk, submit(sdk, LINES).id)
    batches = sorted(p.name for p in (tmp_path / "batches").iterdir() if p.is_file())
    assert [n for n in batches if not n.startswith("batches.sqlite3")] == [input_name(done.id)]
    files = sorted(p.name for p in (tmp_path / "files").iterdir() if p.is_file())
    assert [n for n in files if not n.startswith("files.sqlite3")] == sorted([done.input_file_id, done.output_file_id])
    assert asyncio.run(_integrity(tmp_path / "batches" / "batches.sqlite3")) == "ok"


async def _integrity(path: Path) -> str:
    import sqlite3

    with sqlite3.connect(path) as db:
        return str(db.execute("PRAGMA integrity_check").fetchone()[0])
