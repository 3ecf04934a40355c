"""How the runner ends: a shutdown bounded however a run's last writes behave, and a shutdown
right after a wake ends the runner's loop (no wait that swallows a cancel)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from gateway.apis.batches.batches_runner import BatchRun
from gateway.app import create_app
from gateway.stores.batchdb import SqliteRecords
from tests.fakes import FakeEngine, app_with, fake_settings
from tests.unit.test_batches import chat_line, jsonl, settings, submit
from tests.unit.test_responses import sdk_for
from tests.waits import until_sync


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
