"""The batch runner: runs the batches kept in `stores.batches`, each line through the pipeline as its
route would run it (`pipeline.batch_line`), in the batch lane (the lowest priority), at most
`batches.max_in_flight` lines at once on this replica across all batches (the engine stays free for
interactive requests, and an idle engine still gets that many lines at once). A line the key's rate
limits refuse for now waits without its slot, and its batch starts no new line until then: a key at
its limit does not hold the lane that other keys' batches share.

A batch's life, as OpenAI's: `validating` (its input checked: `failed` with `errors`) →
`in_progress` (its lines run) → `finalizing` (its output and error files published as files of
its owner, purpose `batch_output`; not for Anthropic's Message Batches, whose results are read
from the batch's own files) → `completed`; or, on a cancel, `cancelling` (the lines in
flight cancelled: their engine requests aborted) → `cancelled`, with the partial output; or, 24 h
after its creation, `expired` (the lines not run written to the error file, code `batch_expired`).

Durability: each answered line is appended to the output or error file (fsynced) before it counts;
a runner that starts on a batch skips the custom_ids already there, so a batch interrupted by a crash
or a shutdown resumes where it was and answers every line once. The answers that come while another
is being written are appended together (one append per object for the group), and the record (its
request_counts and usage) is written at most every `batches.record_every_s`, always when the run
ends or stops: it is what readers see, not what a restart resumes from, so a record behind its
objects costs a reader's freshness, never a line. On a store whose round trips take tens of
milliseconds (S3) a line then costs a fraction of an append (HEAD and PUT) instead of five calls in a
row under the lock (the lease's LIST and GET, the append's two, the record's PUT). Shutdown (`stop`) cancels the
lines in flight (they run again after the restart), leaves the batch `in_progress` and frees its
lease. With replicas on one store, a batch runs on the replica holding its lease
(`stores.batches.Lease`), renewed every third of `lease_s` and checked before each answer is
written (a replica that finds it taken over writes nothing more and stops): from memory while the
lease is surely held (`Lease.surely_held`: more than a third of `lease_s` left of the expiry this
replica last wrote; no other replica may take it before that expiry), from the store once a stall
has eaten that margin; every replica looks for
batches to take every `poll_s` (the store's index of batches not done, `BatchStore.pending`), and
notices a cancel asked on another replica as often.

A store that is down (`StoreUnavailable`) stops nothing but the work that needs it: the poll logs it
and tries again at the next one; a run that fails on it ends here (its lines not written run again)
and its batch is taken again once its lease has expired, here or on another replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import secrets
import socket
import time
from pathlib import Path
from typing import Literal

import orjson
import structlog

from gateway.apis.batches.batches_input import MESSAGES, BatchLine, check_batch_input, read_lines
from gateway.apis.batches.batches_line import LineAnswer, Retry, run_line
from gateway.errors import StoreUnavailable
from gateway.pipeline.state import GatewayState
from gateway.protocol.batch_objects import DONE, Errors, RequestCounts, StoredBatch
from gateway.stores.batches import (
    ERRORS,
    EXPIRED_CODE,
    INPUT,
    OUTPUT,
    BatchObjects,
    BatchStore,
    Lease,
    Progress,
    Results,
    unique_lines,
)
from gateway.stores.blobs import Opened
from gateway.stores.files import OwnedFiles, derived_id

log = structlog.get_logger(__name__)

Ending = Literal["completed", "cancelled", "expired", "lost"]
EXPIRED = {"code": EXPIRED_CODE, "message": "This request could not be executed before the completion window expired."}


def _line_id() -> str:
    return "batch_req_" + secrets.token_hex(16)


def result_line(custom_id: str, answer: LineAnswer) -> bytes:
    """A line of the output (or error) file, as OpenAI's: the route's status and body."""
    head = orjson.dumps({"id": _line_id(), "custom_id": custom_id})[:-1]
    response = b'{"status_code":%d,"request_id":%s,"body":%s}' % (answer.status, orjson.dumps(answer.request_id), answer.body)
    return head + b',"response":' + response + b',"error":null}'


def expired_line(custom_id: str) -> bytes:
    return orjson.dumps({"id": _line_id(), "custom_id": custom_id, "response": None, "error": EXPIRED})


def _unrun(path: Path, done: set[str]) -> list[str]:
    """The custom_ids of a batch's input not in `done`, in order. Blocking."""
    return [line.custom_id for line in read_lines(path) if line.custom_id not in done]


async def _until(timeout_s: float, *events: asyncio.Event) -> None:
    """Until one of the events is set, or `timeout_s`. Never `asyncio.wait_for`: on Python 3.11 it
    returns, its cancel swallowed, when it is cancelled just after the event was set (a wake right
    before a shutdown), and a loop that swallowed its cancel never ends; `asyncio.wait` raises it."""
    waits = {asyncio.ensure_future(event.wait()) for event in events}
    try:
        await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()


class BatchRunner:
    """This replica's runs of batches, and the one bound on their lines in flight."""

    def __init__(self, state: GatewayState, store: BatchStore, holder: str | None = None) -> None:
        self.state, self.store, self.settings = state, store, state.settings.batches
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self.slots = asyncio.Semaphore(self.settings.max_in_flight)
        self.runs: dict[str, BatchRun] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._resting: dict[str, float] = {}  # batch id → when to try again a run that failed unexpectedly
        self._done: set[str] = set()  # batches found done: never read again

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    def wake(self) -> None:
        """Look for batches to run now (one was just created here)."""
        self._wake.set()

    def cancel(self, batch_id: str) -> None:
        """A cancel asked here: the run of this replica notices it now rather than at its next poll."""
        run = self.runs.get(batch_id)
        if run is not None:
            run.cancel_asked.set()
        self.wake()

    async def stop(self) -> None:
        """Shutdown: no new lines; the lines in flight cancelled (they run again after a restart), the
        batches left `in_progress` and their leases freed."""
        if self._task is not None:  # ends at its next await (`asyncio.wait`: a cancel of this shutdown not swallowed)
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=self.settings.lease_s)
        tasks = [run.task for run in self.runs.values() if run.task is not None]
        for task in tasks:
            task.cancel()
        if not tasks:
            return
        # bounded: a run's last writes are each bounded by the store's timeout, and past `lease_s` its
        # lease has expired anyway; a shutdown never waits on the batch lane for ever
        _, stuck = await asyncio.wait(tasks, timeout=self.settings.lease_s)
        if stuck:
            log.error("batch_runs_not_stopped", batches=sorted(run.batch.id for run in self.runs.values()
                                                                if run.task in stuck))

    async def _loop(self) -> None:
        indexed = False
        while True:
            try:
                if not indexed:  # a store older than its index of pending batches: entered once
                    await self.store.index_unlisted()
                    indexed = True
                await self._take_free()
            except (StoreUnavailable, OSError) as exc:  # the store down for now: try again at the next poll
                log.warning("batches_scan_failed", error=str(exc))
            except Exception as exc:  # unforeseen: logged, and the next poll comes (this loop is the only one)
                log.error("batches_scan_failed", error=repr(exc), exc_info=exc)
            await _until(self.settings.poll_s, self._wake)
            self._wake.clear()

    async def _take_free(self) -> None:
        if self.state.lifecycle.draining:  # shutting down: no new batch taken
            return
        now = time.monotonic()
        for batch in await self.store.pending(self._done):
            if batch.id in self.runs or self._resting.get(batch.id, 0) > now:
                continue
            lease = await Lease.take(batch, self.holder, self.settings.lease_s)
            if lease is None:
                continue
            run = self.runs[batch.id] = BatchRun(self, batch, lease)
            run.task = asyncio.create_task(run.run())
            run.task.add_done_callback(functools.partial(self._ended, run))

    def _ended(self, run: BatchRun, task: asyncio.Task[None]) -> None:
        self.runs.pop(run.batch.id, None)
        if not task.cancelled() and task.exception() is not None:
            log.error("batch_run_failed", batch_id=run.batch.id, error=repr(task.exception()))
            self._resting[run.batch.id] = time.monotonic() + self.settings.lease_s


class BatchRun:
    """One batch run by this replica, under its lease."""

    def __init__(self, runner: BatchRunner, batch: BatchObjects, lease: Lease) -> None:
        self.runner, self.batch, self.lease = runner, batch, lease
        self.task: asyncio.Task[None] | None = None
        self.cancel_asked = asyncio.Event()
        self.lost = asyncio.Event()  # another replica holds the lease now: write nothing more
        self.progress = Progress()
        self._lock = asyncio.Lock()  # one group of results written at a time: the lines, then the record
        self._queue: list[tuple[str, LineAnswer]] = []  # answers waiting for the lock: written as one group
        self._writes: set[asyncio.Task[None]] = set()
        self._saved_at = 0.0  # (monotonic) the record's last write
        self._record_due: asyncio.Task[None] | None = None  # the record's next write, once record_every_s has passed
        self._save_now = asyncio.Event()  # the run ends: the record written at once, never later
        self._stored: StoredBatch | None = None
        self._resume_at = 0.0  # (monotonic) the key's limits refused a line: no new line of this batch before
        self._unslotted: set[asyncio.Task[None]] = set()  # lines waiting for the key's limits, their slots given back

    @property
    def stored(self) -> StoredBatch:
        assert self._stored is not None
        return self._stored

    async def run(self) -> None:
        try:
            self._stored = await self.batch.read()
            if self.stored.batch.status == "validating":
                await self._validate()
            if self.stored.batch.status in DONE:
                return
            ending = await self._run_lines()
            if ending != "lost":
                await self._finish(ending)
        finally:
            await self._written()
            try:
                await self.lease.release()
            except StoreUnavailable:  # the store down: the lease expires by itself
                log.warning("batch_lease_not_released", batch_id=self.batch.id)

    async def _holding(self) -> bool:
        """Whether the lease is still ours; taken over (this replica stalled past its expiry), the
        new holder answers the lines and writes the record from now on: `lost`, and nothing more here.
        The store is asked only once the lease is no longer surely held: less than a third of
        `lease_s` before the expiry this replica last wrote (renewed every third, a lease on time is
        always surely held; a stall past that margin asks the store before the next write)."""
        if self.lost.is_set():
            return False
        if not self.lease.surely_held(self.runner.settings.lease_s / 3) and not await self.lease.held():
            self.lost.set()
        return not self.lost.is_set()

    async def _save(self) -> None:
        if await self._holding():
            await self.batch.write(self.stored)

    async def _validate(self) -> None:
        batch = self.stored.batch
        async with self.batch.local(INPUT) as path:
            if path is None:
                raise RuntimeError(f"batch {batch.id} has no input")
            total, problems = await asyncio.to_thread(check_batch_input, path, batch.endpoint)
        now = int(time.time())
        if problems:
            batch.status, batch.failed_at, batch.errors = "failed", now, Errors(data=problems)
            log.info("batch_failed", batch_id=batch.id, errors=len(problems))
        else:
            batch.status, batch.in_progress_at = "in_progress", now
            batch.request_counts = RequestCounts(total=total)
            log.info("batch_started", batch_id=batch.id, lines=total)
        await self._save()

    def _expired(self) -> bool:
        expires = self.stored.batch.expires_at
        return expires is not None and time.time() >= expires

    async def _run_lines(self) -> Ending:
        self.progress = await self.batch.progress()  # a line torn by a crash cut off
        self._count()
        if self.stored.batch.status in ("cancelling", "finalizing"):
            return "cancelled" if self.stored.batch.status == "cancelling" else "completed"
        if self._expired():
            return "expired"
        feeder = asyncio.create_task(self._feed())
        watcher = asyncio.create_task(self._watch())
        try:
            await asyncio.wait({feeder, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (feeder, watcher):
                task.cancel()
            await asyncio.gather(feeder, watcher, return_exceptions=True)
        if not feeder.cancelled() and feeder.exception() is None:
            return "completed"
        if not watcher.cancelled() and watcher.exception() is None:
            return watcher.result()
        failed = [task.exception() for task in (feeder, watcher) if not task.cancelled()]  # the other was cancelled
        raise next((exc for exc in failed if exc is not None), RuntimeError("batch run stopped"))

    async def _feed(self) -> None:
        """Every line not answered yet, each once a slot is free; then the last ones awaited (the input
        read from a local file held for the run: the object itself on disk, a copy otherwise)."""
        async with self.batch.local(INPUT) as path:
            if path is None:
                raise RuntimeError(f"batch {self.batch.id} has no input")
            await self._feed_from(path)

    async def _feed_from(self, path: Path) -> None:
        lines = await asyncio.to_thread(read_lines, path)
        flight: set[asyncio.Task[None]] = set()
        try:
            while (line := await asyncio.to_thread(next, lines, None)) is not None:
                if line.custom_id in self.progress.done:
                    continue
                await self._slot()
                if self.runner.state.lifecycle.draining or self.lost.is_set():  # no new line: those in flight end
                    self.runner.slots.release()
                    await asyncio.Event().wait()  # until the shutdown cancels this run
                task = asyncio.create_task(self._one(line))
                flight.add(task)
                task.add_done_callback(self._done)  # the slot freed however the line ends, even cancelled unstarted
                task.add_done_callback(flight.discard)
            while flight:
                await asyncio.gather(*flight)
        finally:
            for task in flight:
                task.cancel()  # the engine requests aborted
            await asyncio.gather(*flight, return_exceptions=True)
            with contextlib.suppress(ValueError):  # still being read in its thread: closed when collected
                lines.close()

    def _done(self, task: asyncio.Task[None]) -> None:
        if task in self._unslotted:  # ended while it waited without its slot
            self._unslotted.discard(task)
        else:
            self.runner.slots.release()

    async def _slot(self) -> None:
        """A slot of `max_in_flight` for the next line, once the key's limits let this batch go on."""
        while True:
            pause = self._resume_at - time.monotonic()
            if pause > 0:
                await asyncio.sleep(pause)
                continue
            await self.runner.slots.acquire()
            if self._resume_at <= time.monotonic():
                return
            self.runner.slots.release()  # paused while it waited for the slot

    async def _wait_unslotted(self, wait_s: float) -> None:
        """A line the key's limits refused waits without its slot, and the batch starts no new line
        meanwhile: the lane's slots go to other keys' batches, not to lines asleep."""
        task = asyncio.current_task()
        assert task is not None
        self._resume_at = max(self._resume_at, time.monotonic() + wait_s)
        self._unslotted.add(task)
        self.runner.slots.release()
        await asyncio.sleep(wait_s)
        await self.runner.slots.acquire()
        self._unslotted.discard(task)  # cancelled before this line: `_done` frees no slot it does not hold

    async def _one(self, line: BatchLine) -> None:
        settings, owner = self.runner.settings, self.stored.owner
        while True:
            try:
                answer = await run_line(self.runner.state, owner, line.url, line.body, settings.retry_s)
                break
            except Retry as retry:  # the key's rate limits: this line waits, its slot given back meanwhile
                await self._wait_unslotted(retry.wait_s)
        write = asyncio.create_task(self._write(line.custom_id, answer))
        self._writes.add(write)
        write.add_done_callback(self._writes.discard)
        await asyncio.shield(write)  # a cancel now does not lose an answer already had

    async def _write(self, custom_id: str, answer: LineAnswer) -> None:
        """The answer appended to the output or error object, then counted. The answers that come while
        another group is written wait for the lock together and go as one group (one append per
        object: the store's round trips per line shrink as the lines in flight grow)."""
        entry = (custom_id, answer)
        self._queue.append(entry)
        async with self._lock:
            if not any(queued is entry for queued in self._queue):
                return  # written with an earlier group
            group, self._queue = self._queue, []
            if not await self._holding():
                return
            for part, ok in ((OUTPUT, True), (ERRORS, False)):
                lines = b"".join(result_line(c, a) + b"\n" for c, a in group if a.ok is ok)
                if lines:
                    await self.batch.append(part, lines)
            for c, a in group:
                self.progress.count(c, a.ok, a.prompt_tokens, a.completion_tokens)
            self._count()
            await self._record()

    async def _record(self) -> None:
        """The record after lines were counted (under the lock): written now when its last write is
        `record_every_s` old or the run ends, else once that much has passed, one write for the lines
        counted meanwhile. A record behind its objects loses nothing: a restart counts the progress
        from the output and error objects (`BatchObjects.progress`), and the run ends with the record
        written (`_written`)."""
        wait = self._saved_at + self.runner.settings.record_every_s - time.monotonic()
        if wait <= 0 or self._save_now.is_set():
            self._saved_at = time.monotonic()
            await self._save()
        elif self._record_due is None:
            self._record_due = asyncio.create_task(self._record_later(wait))
            self._writes.add(self._record_due)
            self._record_due.add_done_callback(self._writes.discard)

    async def _record_later(self, wait_s: float) -> None:
        await _until(wait_s, self._save_now)
        async with self._lock:
            self._record_due = None
            self._saved_at = time.monotonic()
            await self._save()

    async def _written(self) -> None:
        """Every answer had written and the record with them (now, not `record_every_s` later): before
        the run's last record and before its lease is released."""
        self._save_now.set()
        while self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)

    def _count(self) -> None:
        batch = self.stored.batch
        batch.request_counts = RequestCounts(total=batch.request_counts.total, completed=self.progress.completed,
                                             failed=self.progress.failed)
        batch.usage = self.progress.usage

    async def _watch(self) -> Ending:
        """Until a cancel (asked here or on another replica), the batch's expiry or the lease lost;
        the lease renewed meanwhile."""
        settings = self.runner.settings
        every = settings.lease_s / 3
        renew_at = time.monotonic() + every
        while True:
            await _until(min(settings.poll_s, every), self.cancel_asked, self.lost)
            if self.lost.is_set():
                log.warning("batch_lease_lost", batch_id=self.batch.id)
                return "lost"
            if self.cancel_asked.is_set() or await self.batch.cancel_asked() is not None:
                return "cancelled"
            if self._expired():
                return "expired"
            if time.monotonic() >= renew_at:
                if not await self.lease.renew():
                    log.warning("batch_lease_lost", batch_id=self.batch.id)
                    return "lost"
                renew_at = time.monotonic() + every

    async def _finish(self, ending: Ending) -> None:
        await self._written()
        if not await self._holding():
            return
        batch = self.stored.batch
        if ending == "cancelled" and batch.cancelling_at is None:
            batch.status, batch.cancelling_at = "cancelling", await self.batch.cancel_asked() or int(time.time())
        elif ending == "completed":
            batch.status, batch.finalizing_at = "finalizing", batch.finalizing_at or int(time.time())
        await self._save()
        if ending == "expired":
            await self._expire_rest()
        self.progress = await self.batch.progress()
        self._count()
        if ending == "expired":  # counted from the error object: also those a run that died here wrote
            self.stored.expired_lines = self.progress.expired
        await self._publish()
        now = int(time.time())
        if ending == "cancelled":
            batch.status, batch.cancelled_at = "cancelled", now
        elif ending == "expired":
            batch.status, batch.expired_at = "expired", now
        else:
            batch.status, batch.completed_at = "completed", now
        await self._save()
        if not self.lost.is_set():
            await self.batch.done()  # out of the index of batches to run (else the next poll takes it out)
        log.info("batch_" + batch.status, batch_id=batch.id, completed=batch.request_counts.completed,
                 failed=batch.request_counts.failed)

    async def _expire_rest(self) -> int:
        """The lines not run written to the error object as expired; how many."""
        done = (await self.batch.progress()).done
        async with self.batch.local(INPUT) as path:
            if path is None:
                raise RuntimeError(f"batch {self.batch.id} has no input")
            rest = await asyncio.to_thread(_unrun, path, done)
        lines = b"".join(expired_line(custom_id) + b"\n" for custom_id in rest)
        if lines:
            await self.batch.append(ERRORS, lines)
        return len(rest)

    async def _publish(self) -> None:
        """The output and error files as files of the batch's owner (ids derived from the batch's:
        published again after a crash, they replace themselves). A Message Batch's results are read from
        the batch's own objects (`serving.message_batches`), not kept as files of the Files API."""
        batch, files = self.stored.batch, self.runner.state.files.of(self.stored.owner.tenant)
        if batch.endpoint == MESSAGES:
            return
        seen: set[str] = set()  # each custom_id once across both files: an answer before an error
        if self.progress.completed:
            batch.output_file_id = await self._publish_one(files, OUTPUT, f"{batch.id}_output.jsonl", "output", seen)
        if self.progress.failed:
            batch.error_file_id = await self._publish_one(files, ERRORS, f"{batch.id}_error.jsonl", "error", seen)

    async def _publish_one(self, files: OwnedFiles, part: Results, filename: str, kind: str, seen: set[str]) -> str:
        """One of the batch's result objects copied to the Files API's store (streamed, each custom_id
        not in `seen` once: `unique_lines`); its file id."""
        opened = await self.batch.open(part)
        if opened is None:
            raise RuntimeError(f"batch {self.batch.id} has no {part}")
        try:
            file_id = derived_id(f"{self.batch.id}/{kind}")
            unique = Opened(opened.size, unique_lines(opened.chunks, seen))
            made = await files.publish(unique, filename, file_id, self.stored.output_expires_after_s)
        finally:
            await opened.aclose()
        return made.id
