"""The batch runner: runs the batches kept in `stores.batches`, each line through the pipeline as its route would run it
(`batches_line`), in the batch lane, at most `batches.max_in_flight` lines at once on this replica across all batches. A
batch's life, as OpenAI's (docs/api.md, Batches): `validating` → `in_progress` → `finalizing` (its output and error
files assembled from its answers; not for Message Batches, whose results are read from them) → `completed`; or
`cancelling` → `cancelled`; or, past its window, `expired` (its lines not run answered as expired).

Every `poll_s` (at once on a create or a cancel here) the loop claims each runnable batch no one holds (`Records.claim`:
a fencing token, renewed every third of `lease_s` for the whole run) and runs its unanswered lines. Every write names
the token: a replica that stalled past its claim while another took over has its late writes refused (`Fenced`). A
crash, a shutdown or a store that is down leaves the batch to be claimed again, resumed from the answers kept."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

import structlog

from gateway.apis.batches.batches_input import MESSAGES, BatchLine, check_batch_input, read_lines
from gateway.apis.batches.batches_line import Retry, result_line, run_line
from gateway.errors import StoreUnavailable
from gateway.pipeline.state import GatewayState
from gateway.protocol.batch_objects import DONE, Batch, Errors, RequestCounts, StoredBatch
from gateway.stores.batchdb import Answer, Fenced
from gateway.stores.batches import BatchStore, derived_id, input_name

log = structlog.get_logger(__name__)

Ending = Literal["completed", "cancelled", "expired"]  # each the batch's last status
CHUNK = 512  # input lines read per thread hop, expired answers written per transaction


async def _until(timeout_s: float, event: asyncio.Event, *tasks: asyncio.Task[None]) -> None:
    """Until the event is set, one of the tasks ends, or `timeout_s`. Never `asyncio.wait_for`: on Python
    3.11 it returns, its cancel swallowed, when it is cancelled just after the event was set (a wake right
    before a shutdown), and a loop that swallowed its cancel never ends; `asyncio.wait` raises it."""
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({waiter, *tasks}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()


class BatchRunner:
    """This replica's runs of batches, and the one bound on their lines in flight."""

    def __init__(self, state: GatewayState, store: BatchStore) -> None:
        self.state, self.store, self.settings = state, store, state.settings.batches
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self.slots = asyncio.Semaphore(self.settings.max_in_flight)
        self.runs: dict[str, BatchRun] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._resting: dict[str, float] = {}  # batch id → when to try again a run that failed unexpectedly

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    def wake(self) -> None:
        """Look for batches to run now (one was just created here)."""
        self._wake.set()

    def cancel(self, batch_id: str) -> None:
        """A cancel asked here: the run of this replica notices it now rather than at its next poll."""
        if (run := self.runs.get(batch_id)) is not None:
            run.cancel_asked.set()
        self.wake()

    async def stop(self) -> None:
        """Shutdown: no new lines; the lines in flight cancelled (they run again after a restart), the
        batches left `in_progress` and their claims freed. Bounded: a run's last writes are each bounded
        by the store's timeout, and past `lease_s` its claim has lapsed anyway."""
        tasks = [task for task in (self._task, *(run.task for run in self.runs.values())) if task is not None]
        for task in tasks:  # the loop's ends at its next await (`asyncio.wait`: a cancel not swallowed)
            task.cancel()
        if not tasks:
            return
        _, stuck = await asyncio.wait(tasks, timeout=self.settings.lease_s)
        if stuck:
            log.error("batch_runs_not_stopped", batches=sorted(run.id for run in self.runs.values() if run.task in stuck))

    async def _loop(self) -> None:
        while True:
            try:
                await self._take_free()
            except (StoreUnavailable, OSError) as exc:  # the store down for now: try again at the next poll
                log.warning("batches_scan_failed", error=str(exc))
            except Exception as exc:  # unforeseen: logged, and the next poll comes (this loop is the only one)
                log.error("batches_scan_failed", error=repr(exc), exc_info=exc)
            await _until(self.settings.poll_s, self._wake)
            self._wake.clear()

    async def _take_free(self) -> None:
        now = time.monotonic()
        for batch_id in await self.store.records.runnable():
            if self.state.lifecycle.draining:  # shutting down: no new batch taken
                return
            if batch_id in self.runs or self._resting.get(batch_id, 0) > now:
                continue
            token = await self.store.records.claim(batch_id, self.holder, self.settings.lease_s)
            if token is None:
                continue
            run = self.runs[batch_id] = BatchRun(self, batch_id, token)
            run.task = asyncio.create_task(run.run())
            run.task.add_done_callback(functools.partial(self._ended, run))

    def _ended(self, run: BatchRun, task: asyncio.Task[None]) -> None:
        self.runs.pop(run.id, None)
        if not task.cancelled() and task.exception() is not None:
            log.error("batch_run_failed", batch_id=run.id, error=repr(task.exception()))
            self._resting[run.id] = time.monotonic() + self.settings.lease_s


class BatchRun:
    """One batch run by this replica, under its claim (`token`)."""

    stored: StoredBatch  # its record, as last read

    def __init__(self, runner: BatchRunner, batch_id: str, token: int) -> None:
        self.runner, self.id, self.token = runner, batch_id, token
        self.records = runner.store.records
        self.task: asyncio.Task[None] | None = None
        self.cancel_asked = asyncio.Event()
        self._kept: list[Answer] = []  # answers had, not written yet
        self._writing = asyncio.Lock()
        self._writer: asyncio.Task[None] | None = None  # writing the answers had, while the lines run on
        self._resume_at = 0.0  # (monotonic) the key's limits refused a line: no new line of this batch before

    async def run(self) -> None:
        try:
            async with asyncio.TaskGroup() as group:
                keeper = group.create_task(self._renew())
                if (await self._load()).batch.status == "validating":
                    await self._validate()
                if self.stored.batch.status not in DONE:
                    await self._finish(await self._lines())
                keeper.cancel()
        except* Fenced:
            log.warning("batch_claim_lost", batch_id=self.id)
        finally:
            try:
                await self.records.release(self.id, self.token)
            except StoreUnavailable:  # the store down: the claim lapses by itself
                log.warning("batch_claim_not_released", batch_id=self.id)

    async def _renew(self) -> None:
        """The claim renewed every third of `lease_s`; lost (`Fenced`) when the batch was claimed again since."""
        lease_s = self.runner.settings.lease_s
        while True:
            await asyncio.sleep(lease_s / 3)
            if not await self.records.renew(self.id, self.token, lease_s):
                raise Fenced(self.id)

    async def _load(self) -> StoredBatch:
        stored = await self.records.batch(self.id)
        if stored is None:
            raise Fenced(self.id)  # deleted: nothing to run
        self.stored = stored
        return stored

    @contextlib.asynccontextmanager
    async def _input(self) -> AsyncIterator[Path]:
        async with self.runner.store.blobs.local(input_name(self.id)) as path:
            if path is None:
                raise RuntimeError(f"batch {self.id} has no input")
            yield path

    async def _validate(self) -> None:
        batch = self.stored.batch
        async with self._input() as path:
            total, problems = await asyncio.to_thread(check_batch_input, path, batch.endpoint)
        now = int(time.time())
        if problems:
            batch.status, batch.failed_at, batch.errors = "failed", now, Errors(data=problems)
            log.info("batch_failed", batch_id=self.id, errors=len(problems))
        else:
            batch.status, batch.in_progress_at = "in_progress", now
            batch.request_counts = RequestCounts(total=total)
            log.info("batch_started", batch_id=self.id, lines=total)
        await self.records.save(self.stored, self.token)

    async def _lines(self) -> Ending:
        """The lines run until each is answered, a cancel (asked here or on another replica) or the batch's
        expiry; then the lines in flight cancelled, and the answers had written."""
        status = self.stored.batch.status
        if status in ("cancelling", "finalizing"):
            return "cancelled" if status == "cancelling" else "completed"
        feeder = asyncio.create_task(self._feed())
        try:
            while (expires := self.stored.batch.expires_at) is None or time.time() < expires:
                await _until(self.runner.settings.poll_s, self.cancel_asked, feeder)
                if feeder.done():
                    feeder.result()  # a line whose answer could not be written stopped them all: its error
                    return "completed"
                if self.cancel_asked.is_set() or (await self._load()).batch.status == "cancelling":
                    return "cancelled"
            return "expired"
        finally:
            feeder.cancel()
            await asyncio.wait({feeder})
            await self._flush()

    async def _feed(self) -> None:
        """Every line not answered yet, each a task of the task group of those in flight (at most `max_in_flight` of
        this batch's at once), the input read a chunk at a time (a thread hop per chunk, not per line)."""
        done = await self.records.answered(self.id)
        room = asyncio.Semaphore(self.runner.settings.max_in_flight)
        async with self._input() as path:
            lines = read_lines(path)
            try:
                async with asyncio.TaskGroup() as flight:
                    while chunk := await asyncio.to_thread(list, itertools.islice(lines, CHUNK)):
                        for line in chunk:
                            if line.custom_id not in done:
                                await room.acquire()  # released as the task ends, even cancelled unstarted
                                flight.create_task(self._one(line, flight)).add_done_callback(lambda _: room.release())
            finally:
                with contextlib.suppress(ValueError):  # still being read in its thread: closed when collected
                    lines.close()

    async def _slot(self) -> None:
        """A slot of `max_in_flight` (this replica's, across batches) once the key's limits let this batch go on; none
        in a drain: no new line, those in flight end (this run then waits for the shutdown to cancel it)."""
        while True:
            await asyncio.sleep(max(0.0, self._resume_at - time.monotonic()))
            await self.runner.slots.acquire()
            if self.runner.state.lifecycle.draining:
                self.runner.slots.release()
                await asyncio.Event().wait()
            if self._resume_at <= time.monotonic():
                return
            self.runner.slots.release()  # paused while it waited for the slot

    async def _one(self, line: BatchLine, flight: asyncio.TaskGroup) -> None:
        """The line run in a slot; the key's rate limits refusing it for now, its slot given back, and the line run
        again once they let the batch go on (no new line of the batch starts before)."""
        while True:
            await self._slot()
            try:
                answer = await run_line(self.runner.state, self.stored.owner, line, self.runner.settings.retry_s,
                                        self.stored.batch.expires_at)
                break
            except Retry as retry:
                self._resume_at = max(self._resume_at, time.monotonic() + retry.wait_s)
            finally:
                self.runner.slots.release()
        self._kept.append(answer)
        if self._writer is None or self._writer.done():  # else the writer under way takes this one too
            self._writer = flight.create_task(self._flush())  # its slot free meanwhile: the write holds no line

    async def _flush(self) -> None:
        """The answers had, written a group per transaction until none is left (those of the lines ending
        meanwhile go with the next). One cancelled mid-write is written again by the next (a line's second
        answer is ignored): a cancel does not lose an answer already had."""
        async with self._writing:
            while self._kept:
                kept, self._kept = self._kept, []
                try:
                    await self.records.answer_all(self.id, self.token, kept)
                except asyncio.CancelledError:
                    self._kept[:0] = kept
                    raise

    async def _finish(self, ending: Ending) -> None:
        batch, now = (await self._load()).batch, int(time.time())
        if ending == "cancelled":
            batch.status, batch.cancelling_at = "cancelling", batch.cancelling_at or now
        elif ending == "completed":
            batch.status, batch.finalizing_at = "finalizing", batch.finalizing_at or now
        await self.records.save(self.stored, self.token)
        if ending == "expired":
            await self._expire_rest()
        batch = (await self._load()).batch  # counted with the lines expired
        await self._publish(batch)
        batch.status = ending
        setattr(batch, f"{ending}_at", int(time.time()))
        await self.records.save(self.stored, self.token)
        log.info("batch_" + batch.status, batch_id=self.id, completed=batch.request_counts.completed,
                 failed=batch.request_counts.failed)

    async def _expire_rest(self) -> None:
        """The lines not run answered as expired, a chunk of them per transaction."""
        done = await self.records.answered(self.id)
        async with self._input() as path:
            rest = await asyncio.to_thread(lambda: [line.custom_id for line in read_lines(path) if line.custom_id not in done])
        for start in range(0, len(rest), CHUNK):
            await self.records.answer_all(self.id, self.token, [
                Answer(custom_id, False, result_line(custom_id, None), expired=True) for custom_id in rest[start : start + CHUNK]])

    async def _publish(self, batch: Batch) -> None:
        """The output and error files assembled from the answers, as files of the batch's owner (ids derived
        from the batch's: published again after a crash, they replace themselves), once a write fenced by the
        run's token finds the claim still its own: a run that lost it replaces no file of the run that took
        over. A Message Batch's results are read from its answers (`message_batches_serving`), not files."""
        if batch.endpoint == MESSAGES:
            return
        files = self.runner.state.files.of(self.stored.owner.tenant)
        staged = {True: await files.stage(), False: await files.stage()}
        try:
            async for page in self.records.answers(self.id):
                for ok, file in staged.items():
                    await file.write(b"".join(answer.line + b"\n" for answer in page if answer.ok is ok))
            await self.records.save(self.stored, self.token)  # `Fenced` once another run took the batch over
            for ok, kind in ((True, "output"), (False, "error")):
                if staged[ok].size:
                    made = await files.put(staged[ok], f"{self.id}_{kind}.jsonl", "batch_output",
                                           self.stored.output_expires_after_s, derived_id(f"{self.id}/{kind}"))
                    setattr(batch, f"{kind}_file_id", made.id)
        finally:
            for file in staged.values():
                await file.discard()
