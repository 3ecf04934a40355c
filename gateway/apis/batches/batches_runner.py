"""The batch runner: runs the batches kept in `stores.batches`, each line through the pipeline as its
route would run it (`batches_line`), in the batch lane (the lowest priority), at most
`batches.max_in_flight` lines at once on this replica across all batches (the engine stays free for
interactive requests, and an idle engine still gets that many lines at once). A line the key's rate
limits refuse for now waits without its slot, and its batch starts no new line until then: a key at
its limit does not hold the lane that other keys' batches share.

A batch's life, as OpenAI's: `validating` (its input checked: `failed` with `errors`) →
`in_progress` (its lines run) → `finalizing` (its output and error files assembled from its answers
and published as files of its owner, purpose `batch_output`; not for Anthropic's Message Batches,
whose results are read from the answers) → `completed`; or, on a cancel, `cancelling` (the lines in
flight cancelled: their engine requests aborted) → `cancelled`, with the partial output; or, 24 h
after its creation, `expired` (the lines not run answered as expired, code `batch_expired`).

The loop: every `poll_s` (at once when a batch is created or cancelled here) it claims each
runnable batch no one holds (`Records.claim`: a fencing token, renewed every third of `lease_s`) and
runs its unanswered lines, each answer kept in the database before it counts (`Records.answer`: once
per line). Every write names the run's token: a replica that stalled past its claim while another
took over has its late writes refused (`Fenced`) and stops. A crash, a shutdown (the lines in flight
cancelled, the batch left `in_progress`, its claim freed) or a store that is down (`StoreUnavailable`:
the poll tries again) leaves the batch to be claimed again, resumed from the answers kept.
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
from gateway.stores.batchdb import Answer, Fenced
from gateway.stores.batches import EXPIRED_CODE, BatchStore, input_name
from gateway.stores.files import derived_id

log = structlog.get_logger(__name__)

Ending = Literal["completed", "cancelled", "expired", "lost"]
EXPIRED = {"code": EXPIRED_CODE, "message": "This request could not be executed before the completion window expired."}
FLUSH_LINES = 512  # result lines gathered before a write to the file being assembled


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
        batches left `in_progress` and their claims freed."""
        if self._task is not None:  # ends at its next await (`asyncio.wait`: a cancel of this shutdown not swallowed)
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=self.settings.lease_s)
        tasks = [run.task for run in self.runs.values() if run.task is not None]
        for task in tasks:
            task.cancel()
        if not tasks:
            return
        # bounded: a run's last writes are each bounded by the store's timeout, and past `lease_s` its
        # claim has lapsed anyway; a shutdown never waits on the batch lane for ever
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

    def __init__(self, runner: BatchRunner, batch_id: str, token: int) -> None:
        self.runner, self.id, self.token = runner, batch_id, token
        self.records = runner.store.records
        self.task: asyncio.Task[None] | None = None
        self.cancel_asked = asyncio.Event()
        self.lost = asyncio.Event()  # claimed by another replica since: write nothing more
        self.done: set[str] = set()  # the custom_ids answered
        self._writes: set[asyncio.Future[bool]] = set()
        self._stored: StoredBatch | None = None
        self._resume_at = 0.0  # (monotonic) the key's limits refused a line: no new line of this batch before
        self._unslotted: set[asyncio.Task[None]] = set()  # lines waiting for the key's limits, their slots given back

    @property
    def stored(self) -> StoredBatch:
        assert self._stored is not None
        return self._stored

    async def _load(self) -> StoredBatch:
        stored = await self.records.batch(self.id)
        if stored is None:
            raise Fenced(self.id)  # deleted: nothing to run
        self._stored = stored
        return stored

    async def run(self) -> None:
        try:
            if (await self._load()).batch.status == "validating":
                await self._validate()
            if self.stored.batch.status in DONE:
                return
            ending = await self._run_lines()
            if ending != "lost":
                await self._finish(ending)
        except Fenced:
            log.warning("batch_claim_lost", batch_id=self.id)
        finally:
            await self._written()
            try:
                await self.records.release(self.id, self.token)
            except StoreUnavailable:  # the store down: the claim lapses by itself
                log.warning("batch_claim_not_released", batch_id=self.id)

    async def _validate(self) -> None:
        batch = self.stored.batch
        async with self.runner.store.blobs.local(input_name(self.id)) as path:
            if path is None:
                raise RuntimeError(f"batch {self.id} has no input")
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

    def _expired(self) -> bool:
        expires = self.stored.batch.expires_at
        return expires is not None and time.time() >= expires

    async def _run_lines(self) -> Ending:
        self.done = await self.records.answered(self.id)
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
        if self.lost.is_set():
            return "lost"
        if not feeder.cancelled() and feeder.exception() is None:
            return "completed"
        if not watcher.cancelled() and watcher.exception() is None:
            return watcher.result()
        failed = [task.exception() for task in (feeder, watcher) if not task.cancelled()]  # the other was cancelled
        raise next((exc for exc in failed if exc is not None), RuntimeError("batch run stopped"))

    async def _feed(self) -> None:
        """Every line not answered yet, each once a slot is free; then the last ones awaited (the input
        read from a local file held for the run: the blob itself on a local directory, a copy otherwise)."""
        async with self.runner.store.blobs.local(input_name(self.id)) as path:
            if path is None:
                raise RuntimeError(f"batch {self.id} has no input")
            lines = await asyncio.to_thread(read_lines, path)
            flight: set[asyncio.Task[None]] = set()
            try:
                while (line := await asyncio.to_thread(next, lines, None)) is not None:
                    if line.custom_id in self.done:
                        continue
                    await self._slot()
                    if self.runner.state.lifecycle.draining or self.lost.is_set():  # no new line: those in flight end
                        self.runner.slots.release()
                        await asyncio.Event().wait()  # until the shutdown cancels this run
                    task = asyncio.create_task(self._one(line))
                    flight.add(task)
                    task.add_done_callback(self._freed)  # the slot freed however the line ends, even cancelled unstarted
                    task.add_done_callback(flight.discard)
                while flight:
                    await asyncio.gather(*flight)
            finally:
                for task in flight:
                    task.cancel()  # the engine requests aborted
                await asyncio.gather(*flight, return_exceptions=True)
                with contextlib.suppress(ValueError):  # still being read in its thread: closed when collected
                    lines.close()

    def _freed(self, task: asyncio.Task[None]) -> None:
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
        self._unslotted.discard(task)  # cancelled before this line: `_freed` frees no slot it does not hold

    async def _one(self, line: BatchLine) -> None:
        settings, owner = self.runner.settings, self.stored.owner
        while True:
            try:
                answer = await run_line(self.runner.state, owner, line.url, line.body, settings.retry_s)
                break
            except Retry as retry:  # the key's rate limits: this line waits, its slot given back meanwhile
                await self._wait_unslotted(retry.wait_s)
        await self._keep(Answer(line.custom_id, answer.ok, result_line(line.custom_id, answer),
                                prompt=answer.prompt_tokens, completion=answer.completion_tokens))

    async def _keep(self, answer: Answer) -> None:
        """The answer kept (a cancel now does not lose an answer already had); a run claimed by another
        replica since writes nothing more."""
        write = asyncio.ensure_future(self.records.answer(self.id, self.token, answer))
        self._writes.add(write)
        write.add_done_callback(self._writes.discard)
        try:
            await asyncio.shield(write)
        except Fenced:
            self.lost.set()
            return
        self.done.add(answer.custom_id)

    async def _written(self) -> None:
        """Every answer had written: before the run's last record and before its claim is released."""
        while self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)

    async def _watch(self) -> Ending:
        """Until a cancel (asked here or on another replica), the batch's expiry or the claim lost;
        the claim renewed meanwhile."""
        settings = self.runner.settings
        every = settings.lease_s / 3
        renew_at = time.monotonic() + every
        while True:
            await _until(min(settings.poll_s, every), self.cancel_asked, self.lost)
            if self.lost.is_set():
                return "lost"
            if self.cancel_asked.is_set() or (await self._load()).batch.status == "cancelling":
                return "cancelled"
            if self._expired():
                return "expired"
            if time.monotonic() >= renew_at:
                if not await self.records.renew(self.id, self.token, settings.lease_s):
                    return "lost"
                renew_at = time.monotonic() + every

    async def _finish(self, ending: Ending) -> None:
        await self._written()
        batch = (await self._load()).batch
        if ending == "cancelled" and batch.cancelling_at is None:
            batch.status, batch.cancelling_at = "cancelling", int(time.time())
        elif ending == "completed":
            batch.status, batch.finalizing_at = "finalizing", batch.finalizing_at or int(time.time())
        await self.records.save(self.stored, self.token)
        if ending == "expired":
            await self._expire_rest()
        batch = (await self._load()).batch
        await self._publish()
        now = int(time.time())
        if ending == "cancelled":
            batch.status, batch.cancelled_at = "cancelled", now
        elif ending == "expired":
            batch.status, batch.expired_at = "expired", now
        else:
            batch.status, batch.completed_at = "completed", now
        await self.records.save(self.stored, self.token)
        log.info("batch_" + batch.status, batch_id=self.id, completed=batch.request_counts.completed,
                 failed=batch.request_counts.failed)

    async def _expire_rest(self) -> None:
        """The lines not run answered as expired."""
        done = await self.records.answered(self.id)
        async with self.runner.store.blobs.local(input_name(self.id)) as path:
            if path is None:
                raise RuntimeError(f"batch {self.id} has no input")
            rest = await asyncio.to_thread(_unrun, path, done)
        for custom_id in rest:
            await self.records.answer(self.id, self.token, Answer(custom_id, False, expired_line(custom_id), expired=True))

    async def _publish(self) -> None:
        """The output and error files assembled from the answers, as files of the batch's owner (ids
        derived from the batch's: published again after a crash, they replace themselves). A Message
        Batch's results are read from its answers (`message_batches_serving`), not kept as files."""
        batch, files = self.stored.batch, self.runner.state.files.of(self.stored.owner.tenant)
        if batch.endpoint == MESSAGES:
            return
        output, errors = await files.stage(), await files.stage()
        try:
            pending: dict[bool, list[bytes]] = {True: [], False: []}
            async for answer in self.records.answers(self.id):
                pending[answer.ok].append(answer.line + b"\n")
                if len(pending[answer.ok]) >= FLUSH_LINES:
                    await (output if answer.ok else errors).write(b"".join(pending[answer.ok]))
                    pending[answer.ok].clear()
            for ok, staged in ((True, output), (False, errors)):
                await staged.write(b"".join(pending[ok]))
            expires = self.stored.output_expires_after_s
            if output.size:
                made = await files.put(output, f"{self.id}_output.jsonl", "batch_output", expires,
                                       derived_id(f"{self.id}/output"))
                batch.output_file_id = made.id
            if errors.size:
                made = await files.put(errors, f"{self.id}_error.jsonl", "batch_output", expires,
                                       derived_id(f"{self.id}/error"))
                batch.error_file_id = made.id
        finally:
            await output.discard()
            await errors.discard()
