"""How the runner writes a batch's results (`pipeline.batches`): answers that come while another is
being written appended together, each line once; the record written at most every
`batches.record_every_s`, whole at the end and at a shutdown; the lease checked from memory while it
is surely held (`Lease.surely_held`), from the store once it may not be."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from gateway.apis.batches.batches_runner import BatchRun
from gateway.app import create_app
from gateway.stores.batches import RECORD, BatchObjects, BatchStore, Lease
from gateway.stores.blobs import DiskBlobs
from tests.fakes import FakeEngine, app_with, fake_settings
from tests.stores import Flaky, batch_in, disk_batches
from tests.unit.test_batch_store import stores  # noqa: F401 - the fixture: the app's stores, calls recorded
from tests.unit.test_batches import by_custom_id, chat_line, jsonl, lines_of, settings, submit, wait
from tests.unit.test_responses import sdk_for
from tests.waits import until_sync


def calls(blobs: Flaky, method: str, suffix: str) -> int:
    return sum(1 for m, name in blobs.calls if m == method and name.endswith(suffix))


@pytest.mark.parametrize("every_s", [0, 60])
def test_the_record_is_written_at_most_every_record_every_s_and_whole_at_the_end(
        tmp_path: Path, stores: dict[str, Flaky], every_s: float) -> None:  # noqa: F811
    lane = settings(tmp_path, record_every_s=every_s, max_in_flight=1)  # one line at a time: one a group
    with TestClient(app_with(FakeEngine(), **lane)) as client:
        sdk = sdk_for(client)
        done = wait(sdk, submit(sdk, jsonl(*(chat_line(f"r{i}") for i in range(30)))).id)
        output = by_custom_id(lines_of(sdk, done.output_file_id))
    writes = calls(stores["batches"], "put", "/" + RECORD)
    assert done.status == "completed"
    assert done.request_counts.model_dump() == {"total": 30, "completed": 30, "failed": 0}
    assert set(output) == {f"r{i}" for i in range(30)}
    if every_s:
        assert writes < 10  # made, in progress, its first line, finalizing, completed: not one a line
    else:
        assert writes >= 30  # after every line


def test_a_shutdown_writes_the_record_it_held_back(tmp_path: Path) -> None:
    engine = FakeEngine(delay=0.01)
    with TestClient(app_with(engine, **settings(tmp_path, max_in_flight=2, record_every_s=60))) as client:
        sdk = sdk_for(client)
        batch = submit(sdk, jsonl(*(chat_line(f"r{i}", max_tokens=4) for i in range(60))))
        until_sync(lambda: len(engine.requests) >= 8, what="8 lines sent")
        objects = batch_in(tmp_path / "batches", batch.id)
        assert asyncio.run(objects.read()).batch.request_counts.completed < asyncio.run(objects.progress()).completed
    stored, progress = asyncio.run(objects.read()), asyncio.run(objects.progress())
    assert stored.batch.status == "in_progress"  # stopped mid-run: it resumes after the restart
    assert stored.batch.request_counts.completed == progress.completed >= 4


def test_answers_that_come_together_are_appended_together(tmp_path: Path, stores: dict[str, Flaky],  # noqa: F811
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    append = DiskBlobs.append

    async def slow(self: DiskBlobs, name: str, data: bytes) -> None:  # a store with long round trips
        await asyncio.sleep(0.05)  # the round trip is the behaviour: answers pile up meanwhile
        await append(self, name, data)

    monkeypatch.setattr(DiskBlobs, "append", slow)
    lines = [chat_line(f"r{i}") if i % 4 else chat_line(f"e{i}", model="no-such-model") for i in range(40)]
    with TestClient(app_with(FakeEngine(), **settings(tmp_path, max_in_flight=8))) as client:
        sdk = sdk_for(client)
        done = wait(sdk, submit(sdk, jsonl(*lines)).id)
        output, errors = lines_of(sdk, done.output_file_id), lines_of(sdk, done.error_file_id)
    answered = [line["custom_id"] for line in output + errors]
    assert sorted(answered) == sorted(line["custom_id"] for line in lines)  # each line once
    assert {line["custom_id"][0] for line in errors} == {"e"}
    assert done.request_counts.model_dump() == {"total": 40, "completed": 30, "failed": 10}
    batches = stores["batches"]
    assert calls(batches, "append", "/output.jsonl") + calls(batches, "append", "/errors.jsonl") < 40


def test_a_lease_surely_held_is_not_asked_of_the_store_line_by_line(tmp_path: Path,
                                                                    stores: dict[str, Flaky]) -> None:  # noqa: F811
    with TestClient(app_with(FakeEngine(), **settings(tmp_path, lease_s=30))) as client:
        sdk = sdk_for(client)
        done = wait(sdk, submit(sdk, jsonl(*(chat_line(f"r{i}") for i in range(30)))).id)
    assert done.request_counts.completed == 30
    lease_reads = sum(1 for m, name in stores["batches"].calls if m == "list" and name.endswith(f"/{done.id}/"))
    assert lease_reads < 10  # its take, its release: not one a line


async def test_a_lease_is_surely_held_until_a_margin_before_the_expiry_it_wrote(tmp_path: Path) -> None:
    store = disk_batches(tmp_path)
    batch = BatchObjects(store.blobs, store.spool, "0" * 32, "batch_" + "1" * 32)
    await batch.blobs.put(batch.name(RECORD), b"{}")
    lease = await Lease.take(batch, "a", lease_s=30)
    assert lease is not None
    assert lease.surely_held(10)
    assert not lease.surely_held(30)  # less than that is left: ask the store
    lease.until = 0.0  # a stall: what it wrote last may have expired
    assert not lease.surely_held(0)
    assert await lease.renew()  # renewed late, and still its own after the write: sure again
    assert lease.surely_held(10)
    over = json.dumps({"holder": "b", "expires": time.time() + 60}).encode()
    assert await batch.blobs.create(batch.name(f"lease.{lease.generation + 1}"), over)  # a clock far ahead
    assert not await lease.held()
    assert not lease.surely_held(0)  # found taken over: never sure again
    assert not await lease.renew()


def test_a_shutdown_does_not_wait_for_ever_on_a_run_that_will_not_end(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A run whose last writes never end (a store that never answers, a bug) is given up after
    `lease_s` at shutdown (and logged, `batch_runs_not_stopped`): the server's shutdown is bounded."""

    async def slow(self: BatchRun) -> None:  # the run's last writes, after the shutdown's cancel
        await asyncio.sleep(6)  # still at it well past lease_s (the event loop's close cancels it)

    monkeypatch.setattr(BatchRun, "_written", slow)
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
    pending = BatchStore.pending

    async def noted(self: BatchStore, done: set[str]) -> list[BatchObjects]:
        found = await pending(self, done)
        scanned.set()
        return found

    monkeypatch.setattr(BatchStore, "pending", noted)
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
