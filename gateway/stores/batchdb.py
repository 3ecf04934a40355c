"""The batch lane's records in a database: files, batches, their counts and each line's answer. `Records` is the
interface; `SqliteRecords` the one-node default (the standard library's SQLite, WAL, one file per part); Redis across
replicas is `batchdb_redis`. Contents (uploads, inputs, output files) are blobs (`stores.blobs`), written once.

Each line's answer is kept once, the first: `(batch_id, custom_id)` is unique. A batch is run by whoever holds its
claim: `claim` hands out a fencing token, higher each time, and every write of a run (`save`, `answer`) names it and is
refused (`Fenced`) once the batch was claimed again since, so a replica that stalled past its claim writes nothing after
another took the batch over. A record's counts are the answers' (kept beside it, changed with each answer), and a
cancel asked is kept beside it too: neither is lost to a runner's write of the record."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

import structlog
from pydantic import ValidationError

from gateway.protocol.batch_objects import DONE, BatchUsage, RequestCounts, StoredBatch
from gateway.protocol.file_objects import FileObject
from gateway.stores.blobs import unavailable

T = TypeVar("T")
log = structlog.get_logger(__name__)
PAGE = 1000  # answers read per round trip


class Fenced(Exception):
    """The batch was claimed again since this run's claim: the run writes nothing more."""


@dataclass(slots=True, frozen=True)
class Answer:
    """One line's answer as its result line (OpenAI's output or error file), and what it counts."""

    custom_id: str
    ok: bool
    line: bytes
    expired: bool = False  # never run: the batch expired first
    prompt: int = 0
    completion: int = 0


@dataclass(slots=True, frozen=True)
class Counts:
    completed: int = 0
    failed: int = 0
    expired: int = 0
    prompt: int = 0
    completion: int = 0


def merged(stored: StoredBatch, counts: Counts, cancel_at: int | None) -> StoredBatch:
    """The record as readers see it: its answers counted, a cancel asked shown as `cancelling`."""
    batch = stored.batch
    batch.request_counts = RequestCounts(total=batch.request_counts.total, completed=counts.completed,
                                         failed=counts.failed)
    batch.usage = BatchUsage()
    batch.usage.add(counts.prompt, counts.completion)
    stored.expired_lines = counts.expired
    if cancel_at is not None and batch.status not in DONE and batch.status != "cancelling":
        batch.status, batch.cancelling_at = "cancelling", cancel_at
    return stored


class Records(Protocol):
    async def add_file(self, owner: str, file: FileObject) -> None: ...
    async def file(self, owner: str, file_id: str) -> FileObject | None: ...
    async def files(self, owner: str) -> list[FileObject]: ...

    async def remove_file(self, owner: str, file_id: str) -> bool:
        """Whether it was there (and this call removed it)."""

    async def create(self, stored: StoredBatch) -> None: ...

    async def batch(self, batch_id: str) -> StoredBatch | None:
        """Its record, counts and cancel merged (`merged`); whoever its owner (the caller checks)."""

    async def batches(self, owner: str) -> list[StoredBatch]: ...
    async def remove(self, batch_id: str) -> None: ...

    async def ask_cancel(self, batch_id: str) -> None:
        """A cancel asked (the first ask's time kept); its runner carries it out."""

    async def runnable(self) -> list[str]:
        """The batches not done, oldest first."""

    async def claim(self, batch_id: str, holder: str, ttl_s: float) -> int | None:
        """A new fencing token when no claim on the batch is live (else None)."""

    async def renew(self, batch_id: str, token: int, ttl_s: float) -> bool:
        """The claim kept `ttl_s` longer; False when the batch was claimed again since `token`."""

    async def release(self, batch_id: str, token: int) -> None: ...

    async def save(self, stored: StoredBatch, token: int) -> None:
        """The record written (its counts aside); `Fenced` when claimed again since `token`."""

    async def answer(self, batch_id: str, token: int, answer: Answer) -> bool:
        """The answer kept and counted unless its line has one already (then False); `Fenced` as `save`."""

    async def answer_all(self, batch_id: str, token: int, answers: list[Answer]) -> int:
        """`answer` for each, in one transaction; how many were kept."""

    async def answered(self, batch_id: str) -> set[str]: ...

    def answers(self, batch_id: str) -> AsyncIterator[Answer]:
        """Every answer kept, in the order they came (counts aside)."""

    async def aclose(self) -> None: ...


SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
  id TEXT PRIMARY KEY, owner TEXT NOT NULL, record TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS files_owner ON files (owner);
CREATE TABLE IF NOT EXISTS batches (
  id TEXT PRIMARY KEY, owner TEXT NOT NULL, created_ns INTEGER NOT NULL, done INTEGER NOT NULL DEFAULT 0,
  record TEXT NOT NULL, cancel_at INTEGER, token INTEGER NOT NULL DEFAULT 0, holder TEXT,
  claim_until REAL NOT NULL DEFAULT 0, completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0,
  expired INTEGER NOT NULL DEFAULT 0, prompt INTEGER NOT NULL DEFAULT 0, completion INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS batches_owner ON batches (owner);
CREATE INDEX IF NOT EXISTS batches_runnable ON batches (done, created_ns);
CREATE TABLE IF NOT EXISTS answers (
  seq INTEGER PRIMARY KEY, batch_id TEXT NOT NULL, custom_id TEXT NOT NULL, ok INTEGER NOT NULL,
  expired INTEGER NOT NULL, prompt INTEGER NOT NULL, completion INTEGER NOT NULL, line BLOB NOT NULL,
  UNIQUE (batch_id, custom_id));
"""
_BATCH = "SELECT record, cancel_at, completed, failed, expired, prompt, completion FROM batches"


M = TypeVar("M", StoredBatch, FileObject)


def parsed(model: type[M], raw: str | bytes) -> M | None:
    """A record; None when it is unreadable (a disk that corrupted it, a hand edit), logged: that one alone is gone."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        log.warning("record_unreadable", kind=model.__name__, errors=exc.error_count())
        return None


def _stored(row: tuple[str, int | None, int, int, int, int, int]) -> StoredBatch | None:
    record, cancel_at, *counts = row
    stored = parsed(StoredBatch, record)
    return None if stored is None else merged(stored, Counts(*counts), cancel_at)


class SqliteRecords:
    """One connection, its calls one at a time in a worker thread; every change a transaction (`BEGIN IMMEDIATE`), so
    processes sharing the file (on one node) see each other's writes whole."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._db_open: sqlite3.Connection | None = None
        self._lock = threading.Lock()

    def _db(self) -> sqlite3.Connection:
        """The connection, opened at the first call (a gateway that never uses the batch lane writes nothing)."""
        if self._db_open is None:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False, timeout=30)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")  # an answer kept is on disk before its line counts
            db.executescript(SCHEMA)
            self._db_open = db
        return self._db_open

    async def _run(self, work: Callable[[sqlite3.Connection], T], write: bool = False) -> T:
        def locked() -> T:
            with self._lock:
                db = self._db()
                if not write:
                    return work(db)
                db.execute("BEGIN IMMEDIATE")
                try:
                    result = work(db)
                except BaseException:
                    db.execute("ROLLBACK")
                    raise
                db.execute("COMMIT")
                return result

        with unavailable():
            return await asyncio.to_thread(locked)

    async def add_file(self, owner: str, file: FileObject) -> None:
        await self._run(lambda db: db.execute("INSERT OR REPLACE INTO files VALUES (?, ?, ?)",
                                              (file.id, owner, file.model_dump_json())), write=True)

    async def file(self, owner: str, file_id: str) -> FileObject | None:
        row = await self._run(lambda db: db.execute("SELECT record FROM files WHERE id = ? AND owner = ?",
                                                    (file_id, owner)).fetchone())
        return None if row is None else parsed(FileObject, row[0])

    async def files(self, owner: str) -> list[FileObject]:
        rows = await self._run(lambda db: db.execute("SELECT record FROM files WHERE owner = ?", (owner,)).fetchall())
        return [file for record, in rows if (file := parsed(FileObject, record)) is not None]

    async def remove_file(self, owner: str, file_id: str) -> bool:
        return await self._run(lambda db: db.execute("DELETE FROM files WHERE id = ? AND owner = ?",
                                                     (file_id, owner)).rowcount == 1, write=True)

    async def create(self, stored: StoredBatch) -> None:
        row = (stored.batch.id, stored.owner.tenant, stored.created_ns, stored.model_dump_json())
        await self._run(lambda db: db.execute("INSERT INTO batches (id, owner, created_ns, record) VALUES (?, ?, ?, ?)",
                                              row), write=True)

    async def batch(self, batch_id: str) -> StoredBatch | None:
        row = await self._run(lambda db: db.execute(f"{_BATCH} WHERE id = ?", (batch_id,)).fetchone())
        return None if row is None else _stored(row)

    async def batches(self, owner: str) -> list[StoredBatch]:
        rows = await self._run(lambda db: db.execute(f"{_BATCH} WHERE owner = ?", (owner,)).fetchall())
        return [stored for row in rows if (stored := _stored(row)) is not None]

    async def remove(self, batch_id: str) -> None:
        def remove(db: sqlite3.Connection) -> None:
            db.execute("DELETE FROM answers WHERE batch_id = ?", (batch_id,))
            db.execute("DELETE FROM batches WHERE id = ?", (batch_id,))

        await self._run(remove, write=True)

    async def ask_cancel(self, batch_id: str) -> None:
        await self._run(lambda db: db.execute("UPDATE batches SET cancel_at = ? WHERE id = ? AND cancel_at IS NULL",
                                              (int(time.time()), batch_id)), write=True)

    async def runnable(self) -> list[str]:
        rows = await self._run(lambda db: db.execute("SELECT id FROM batches WHERE done = 0 ORDER BY created_ns, id")
                               .fetchall())
        return [batch_id for batch_id, in rows]

    async def claim(self, batch_id: str, holder: str, ttl_s: float) -> int | None:
        now = time.time()
        row = await self._run(lambda db: db.execute(
            "UPDATE batches SET token = token + 1, holder = ?, claim_until = ? WHERE id = ? AND done = 0 AND "
            "claim_until <= ? RETURNING token", (holder, now + ttl_s, batch_id, now)).fetchone(), write=True)
        return None if row is None else int(row[0])

    async def renew(self, batch_id: str, token: int, ttl_s: float) -> bool:
        return await self._run(lambda db: db.execute(
            "UPDATE batches SET claim_until = ? WHERE id = ? AND token = ?", (time.time() + ttl_s, batch_id, token),
        ).rowcount == 1, write=True)

    async def release(self, batch_id: str, token: int) -> None:
        await self._run(lambda db: db.execute("UPDATE batches SET claim_until = 0 WHERE id = ? AND token = ?",
                                              (batch_id, token)), write=True)

    async def save(self, stored: StoredBatch, token: int) -> None:
        args = (stored.model_dump_json(), stored.batch.status in DONE, stored.batch.id, token)

        def save(db: sqlite3.Connection) -> None:
            if db.execute("UPDATE batches SET record = ?, done = ? WHERE id = ? AND token = ?", args).rowcount != 1:
                raise Fenced(stored.batch.id)

        await self._run(save, write=True)

    async def answer(self, batch_id: str, token: int, answer: Answer) -> bool:
        return await self.answer_all(batch_id, token, [answer]) == 1

    async def answer_all(self, batch_id: str, token: int, answers: list[Answer]) -> int:
        def add(db: sqlite3.Connection) -> int:
            if db.execute("SELECT 1 FROM batches WHERE id = ? AND token = ?", (batch_id, token)).fetchone() is None:
                raise Fenced(batch_id)
            kept = [a for a in answers if db.execute(
                "INSERT OR IGNORE INTO answers (batch_id, custom_id, ok, expired, prompt, completion, line) VALUES "
                "(?, ?, ?, ?, ?, ?, ?)", (batch_id, a.custom_id, a.ok, a.expired, a.prompt, a.completion, a.line)).rowcount]
            db.execute("UPDATE batches SET completed = completed + ?, failed = failed + ?, expired = expired + ?, "
                       "prompt = prompt + ?, completion = completion + ? WHERE id = ?",
                       (sum(a.ok for a in kept), sum(not a.ok for a in kept), sum(a.expired for a in kept),
                        sum(a.prompt for a in kept), sum(a.completion for a in kept), batch_id))
            return len(kept)

        return await self._run(add, write=True)

    async def answered(self, batch_id: str) -> set[str]:
        rows = await self._run(lambda db: db.execute("SELECT custom_id FROM answers WHERE batch_id = ?",
                                                     (batch_id,)).fetchall())
        return {custom_id for custom_id, in rows}

    async def answers(self, batch_id: str) -> AsyncIterator[Answer]:
        def page(after: int) -> Callable[[sqlite3.Connection], list[tuple[int, str, int, int, bytes]]]:
            return lambda db: db.execute("SELECT seq, custom_id, ok, expired, line FROM answers WHERE batch_id = ? AND "
                                         "seq > ? ORDER BY seq LIMIT ?", (batch_id, after, PAGE)).fetchall()

        rows = await self._run(page(-1))
        while rows:
            for _, custom_id, ok, expired, line in rows:
                yield Answer(custom_id, bool(ok), bytes(line), bool(expired))
            rows = await self._run(page(rows[-1][0])) if len(rows) == PAGE else []

    async def aclose(self) -> None:
        def close() -> None:
            with self._lock:  # after a call still running in its thread (its caller cancelled), never during it
                if self._db_open is not None:
                    self._db_open.close()

        await asyncio.to_thread(close)
