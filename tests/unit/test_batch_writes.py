"""How the runner ends: a shutdown bounded however a run's last writes behave, and a shutdown
right after a wake ends the runner's loop (no wait that swallows a cancel); how a batch is finished: its
expired lines written in bulk, its claim kept meanwhile, its output published only under its claim."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from gateway.apis.batches.batches_input import BatchLine
from gateway.apis.batches.batches_runner import BatchRun
from gateway.app import create_app
from gateway.pipeline.lifecycle import Lifecycle
from gateway.protocol.batch_objects import Batch, Owner, RequestCounts, StoredBatch
from gateway.stores.batchdb import Answer, SqliteRecords
from gateway.stores.batches import new_id
from tests.fakes import FakeEngine, app_with, fake_settings
from tests.stores import disk_batches
from tests.unit.test_batches import chat_line, jsonl, lines_of, settings, submit, wait
from tests.unit.test_responses import sdk_for
from tests.waits import until, until_awaited, until_sync


def test_a_shutdown_does_not_wait_for_ever_on_a_run_that_will_not_end(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A run whose last writes never end (a store that never answers, a bug) is given up after
    `lease_s` at shutdown (and logged, `batch_runs_not_stopped`): the server's shutdown is bounded."""

    async def slow(self: BatchRun) -> None:  # the run's writes of answers, the last ones after the shutdown's cancel
        await asyncio.sleep(6)  # still at it well past lease_s (the event loop's close cancels it)

    monkeypatch.setattr(BatchRun, "_flush", slow)
    engine = FakeEngine(delay=0.01)
    with TestClient(app_with(engine, **settings(tmp_path, lease_s=1))) as client:
        submit(sdk_for(client), jsonl(*(chat_line(f"r{i}", max_tokens=4) for i in range(20))))
        until_sync(lambda: engine.requests, what="a line sent")
        leaving = time.monotonic()
    stopped = time.monotonic()
    assert stopped - leaving < 5  # it returned before the run's 6 s were over (a bound, not a measurement)


async def test_a_shutdown_just_after_a_wake_ends_the_runner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch created (the runner woken) just before a shutdown: the shutdown ends the runner's loop.
    Python 3.11's `asyncio.wait_for` returned, the cancel swallowed, when it was cancelled just after
    its event was set: the loop went on polling and the lifespan's shutdown waited for it for ever."""
    scanned = asyncio.Event()
    runnable = SqliteRecords.runnable

    async def noted(self: SqliteRecords) -> list[str]:
        found = await runnable(self)
        scanned.set()
        return found

    monkeypatch.setattr(SqliteRecords, "runnable", noted)
    app = create_app(fake_settings(**settings(tmp_path)), engine_starter=lambda _: FakeEngine())
    lifespan = app.router.lifespan_context(app)
    runner = (await lifespan.__aenter__())["gateway"].batch_runner
    await scanned.wait()
    for _ in range(3):  # its first look for batches over: it waits for a wake or the next poll
        await asyncio.sleep(0)
    runner.wake()
    shutdown = asyncio.ensure_future(lifespan.__aexit__(None, None, None))
    await asyncio.wait({shutdown}, timeout=20)  # a guard on the test (it hung for ever before), not a measurement
    if not shutdown.done():
        shutdown.cancel()  # the loop taken down by a second cancel, for the next tests
        await asyncio.wait({shutdown})
        pytest.fail("the shutdown waited for the runner's loop, which had swallowed its cancel")
    assert runner._task.done()


def _expired_batch(tmp_path: Path, lines: int) -> str:
    """A batch past its window, none of its lines run, made straight in the store."""
    now, store = int(time.time()), disk_batches(tmp_path / "batches")
    batch = Batch(id=new_id(), endpoint="/v1/chat/completions", input_file_id="file-" + "0" * 24, status="in_progress",
                  created_at=now - 86400, expires_at=now - 1, in_progress_at=now - 86400,
                  request_counts=RequestCounts(total=lines))
    stored = StoredBatch(batch=batch, owner=Owner(key_id="anonymous", tenant="anonymous"), output_expires_after_s=3600)
    asyncio.run(store.of("anonymous").create(stored, jsonl(*(chat_line(f"r{i}") for i in range(lines)))))
    return batch.id


def test_an_expired_batch_answers_its_lines_in_a_few_transactions(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Its lines not run are written as expired a chunk per transaction, not one each (one fsync a
    line took longer than a lease for a large batch)."""
    batch_id, writes = _expired_batch(tmp_path, 2000), []
    run = SqliteRecords._run

    async def counted(self: SqliteRecords, work: Any, write: bool = False) -> Any:
        writes.append(write)
        return await run(self, work, write)

    monkeypatch.setattr(SqliteRecords, "_run", counted)
    with TestClient(app_with(FakeEngine(), **settings(tmp_path))) as client:
        done = wait(sdk_for(client), batch_id)
        assert len(lines_of(sdk_for(client), done.error_file_id)) == 2000
    assert done.status == "expired"
    assert done.request_counts.failed == 2000
    assert sum(writes) < 100  # the claim, its renewals, the records and 2000 / CHUNK expiries: not 2000


def test_a_batch_being_finished_stays_claimed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its output assembled for longer than a lease: the claim is renewed meanwhile, so no other
    replica takes the batch over in the middle of its finishing."""
    assembling, go, answers = threading.Event(), threading.Event(), SqliteRecords.answers
    path = tmp_path / "batches" / "batches.sqlite3"

    async def held(self: SqliteRecords, batch_id: str) -> AsyncIterator[Answer]:
        assembling.set()
        await until(go.is_set, what="the test's go")
        async for answer in answers(self, batch_id):
            yield answer

    monkeypatch.setattr(SqliteRecords, "answers", held)
    with TestClient(app_with(FakeEngine(), **settings(tmp_path, lease_s=1.5))) as client:
        sdk = sdk_for(client)
        batch = submit(sdk, jsonl(*(chat_line(f"r{i}") for i in range(3))))
        until_sync(assembling.is_set, what="the output being assembled")
        with contextlib.closing(sqlite3.connect(path)) as db:
            (lapses,), = db.execute("SELECT claim_until FROM batches WHERE id = ?", (batch.id,)).fetchall()
        until_sync(lambda: time.time() > lapses, what="the claim as it stood then lapsed, unless renewed")
        other = SqliteRecords(path)  # another replica
        assert asyncio.run(other.claim(batch.id, "other", 60)) is None
        go.set()
        assert wait(sdk, batch.id).status == "completed"


def test_a_run_that_lost_its_claim_publishes_no_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run stalled while it assembled the output (its renewals did not land) and another replica
    took the batch over: it publishes no output file (it would replace the one the other publishes)
    and writes nothing more."""
    answers, released = SqliteRecords.answers, threading.Event()
    other = SqliteRecords(tmp_path / "batches" / "batches.sqlite3")  # another replica

    async def stalled(self: SqliteRecords, batch_id: str, token: int, ttl_s: float) -> bool:
        return True  # the renewal never lands: the claim runs out

    async def taken_over(self: SqliteRecords, batch_id: str) -> AsyncIterator[Answer]:
        await until_awaited(lambda: other.claim(batch_id, "other", 60), what="the batch claimed by another")
        async for answer in answers(self, batch_id):
            yield answer

    async def noted(self: SqliteRecords, batch_id: str, token: int) -> None:
        released.set()

    for name, patched in (("renew", stalled), ("answers", taken_over), ("release", noted)):
        monkeypatch.setattr(SqliteRecords, name, patched)
    with TestClient(app_with(FakeEngine(), **settings(tmp_path, lease_s=0.5))) as client:
        sdk = sdk_for(client)
        batch = submit(sdk, jsonl(*(chat_line(f"r{i}") for i in range(3))))
        until_sync(released.is_set, what="the run ended")
        assert [f.purpose for f in sdk.files.list().data] == ["batch"]
        assert sdk.batches.retrieve(batch.id).status == "finalizing"


def test_a_line_sent_back_runs_again_in_its_own_task_its_slot_given_back_meanwhile(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The last line running is sent back by the key's limits: its task gives its slot back, waits, and runs it
    again (the task group of the lines in flight ends only with it): the batch does not end short of it."""
    from gateway.apis.batches import batches_runner
    from gateway.apis.batches.batches_line import Retry

    run = BatchRun.__new__(BatchRun)  # only what `_one` and `_flush` read
    run.id, run.token, run._resume_at, run._kept, run._writer = "b", 1, 0.0, [], None
    run.stored = StoredBatch.model_validate({"batch": {"id": "b", "endpoint": "/v1/chat/completions", "status":
                                            "in_progress", "input_file_id": "b", "created_at": 0},
                                            "owner": {"key_id": "k", "tenant": "t"}, "output_expires_after_s": 1})
    written: list[list[str]] = []
    held_at_try: list[bool] = []  # whether the one slot was held at each try

    async def run_line(*_: Any) -> Answer:
        held_at_try.append(run.runner.slots.locked())
        if len(held_at_try) == 1:
            raise Retry(0.01)
        return Answer("a", True, b"{}")

    async def answer_all(batch_id: str, token: int, answers: list[Answer]) -> int:
        written.append([a.custom_id for a in answers])
        return len(answers)

    async def scenario() -> bool:
        run._writing = asyncio.Lock()
        run.records = type("Records", (), {"answer_all": staticmethod(answer_all)})()
        run.runner = type("Runner", (), {"slots": asyncio.Semaphore(1), "settings": fake_settings().batches,
                                         "state": type("State", (), {"lifecycle": Lifecycle()})()})()
        async with asyncio.TaskGroup() as flight:
            flight.create_task(run._one(BatchLine("a", "/v1/chat/completions", b"{}"), flight))
        return run.runner.slots.locked()

    monkeypatch.setattr(batches_runner, "run_line", run_line)
    assert asyncio.run(scenario()) is False  # its slot given back
    assert (held_at_try, written) == ([True, True], [["a"]])  # held at each try; answered once, by the second
    assert run._resume_at > 0  # the batch paused meanwhile
