"""The batch lane's records in a database: files, batches, their counts and each line's answer. `Records` is either
backend: `SqliteRecords` the one-node default (the standard library's SQLite, WAL, one file per part), `batchdb_redis`
across replicas. Contents (uploads, inputs, output files) are blobs (`stores.blobs`), written once.

Both backends answer alike. Each line's answer is kept once, the first (`(batch_id, custom_id)` unique); a record's
counts are its answers' and a cancel asked (`ask_cancel`, the first ask's time) is kept beside it: neither is lost to a
runner's write of the record. `batch` is the record as `merged`, whoever its owner (the caller checks); `runnable` the
batches not done, oldest first; `remove_file` whether this call removed the file. A run: `claim` hands a fencing token,
higher each time, when no claim on the batch is live (else None); `renew` keeps it `ttl_s` longer (False once the batch
was claimed again since `token`); `save` (the record, its counts aside) and `answer_all` (one transaction; how many
answers were kept) raise `Fenced` once it was: a replica that stalled past its claim writes nothing after another took
the batch over. `answers` are every answer kept, in the order they came, a page at a time."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

import structlog
from pydantic import ValidationError

from gateway.protocol.batch_objects import DONE, BatchUsage, RequestCounts, StoredBatch
from gateway.protocol.file_objects import FileObject
from gateway.stores.blobs import unavailable

if TYPE_CHECKING:
    from gateway.stores.batchdb_redis import RedisRecords

T = TypeVar("T")
log = structlog.get_logger(__name__)
PAGE = 1000  # answers read per round trip
Records: TypeAlias = "SqliteRecords | RedisRecords"  # the one-node default, and Redis across replicas


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
CREATE TRIGGER IF NOT EXISTS batches_removed AFTER DELETE ON batches BEGIN
  DELETE FROM answers WHERE batch_id = OLD.id; END;
CREATE TRIGGER IF NOT EXISTS answers_counted AFTER INSERT ON answers BEGIN
  UPDATE batches SET completed = completed + NEW.ok, failed = failed + 1 - NEW.ok, expired = expired + NEW.expired,
  prompt = prompt + NEW.prompt, completion = completion + NEW.completion WHERE id = NEW.batch_id; END;
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


def merged(record: str | bytes, cancel_at: int | None, counts: Sequence[int]) -> StoredBatch | None:
    """The record as readers see it (None when unreadable): its answers counted (completed, failed, expired, prompt
    and completion tokens), a cancel asked shown as `cancelling`."""
    stored = parsed(StoredBatch, record)
    if stored is None:
        return None
    batch, (completed, failed, expired, prompt, completion) = stored.batch, counts
    batch.request_counts = RequestCounts(total=batch.request_counts.total, completed=completed, failed=failed)
    batch.usage = BatchUsage(input_tokens=prompt, output_tokens=completion, total_tokens=prompt + completion)
    stored.expired_lines = expired
    if cancel_at is not None and batch.status not in DONE and batch.status != "cancelling":
        batch.status, batch.cancelling_at = "cancelling", cancel_at
    return stored


class SqliteRecords:
    """One connection, in a thread of its own: the calls run there one at a time, whatever else keeps the default
    executor busy. Every change a transaction (`BEGIN IMMEDIATE`), so processes sharing the file (on one node) see each
    other's writes whole."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._open = threading.local()  # the connection of the thread: a call made while a close waits opens its own
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="sqlite-records")

    def _db(self) -> sqlite3.Connection:
        """The connection, opened at the first call (a gateway that never uses the batch lane writes nothing)."""
        db: sqlite3.Connection | None = getattr(self._open, "db", None)
        if db is None:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self._path, isolation_level=None, timeout=30)
            db.execute("PRAGMA journal_mode=WAL")
            # WAL with NORMAL: a commit survives the process crashing (the WAL is in the OS); a power loss may take
            # back the last commits before a checkpoint, which the runner then runs again (each line answered once)
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(SCHEMA)
            self._open.db = db
        return db

    async def _run(self, work: Callable[[sqlite3.Connection], T], write: bool = False) -> T:
        def call() -> T:
            db = self._db()
            if not write:
                return work(db)
            db.execute("BEGIN IMMEDIATE")
            with db:  # committed, or rolled back on an error
                return work(db)

        with unavailable():  # a caller cancelled leaves its call to end in the thread, before the next one starts
            return await asyncio.get_running_loop().run_in_executor(self._thread, call)

    async def _rows(self, sql: str, *args: object, write: bool = False) -> list[Any]:
        return await self._run(lambda db: db.execute(sql, args).fetchall(), write)

    async def _change(self, sql: str, *args: object) -> int:
        """The rows changed."""
        return await self._run(lambda db: db.execute(sql, args).rowcount, write=True)

    async def add_file(self, owner: str, file: FileObject) -> None:
        await self._change("INSERT OR REPLACE INTO files VALUES (?, ?, ?)", file.id, owner, file.model_dump_json())

    async def file(self, owner: str, file_id: str) -> FileObject | None:
        rows = await self._rows("SELECT record FROM files WHERE id = ? AND owner = ?", file_id, owner)
        return parsed(FileObject, rows[0][0]) if rows else None

    async def files(self, owner: str) -> list[FileObject]:
        rows = await self._rows("SELECT record FROM files WHERE owner = ?", owner)
        return [file for record, in rows if (file := parsed(FileObject, record)) is not None]

    async def remove_file(self, owner: str, file_id: str) -> bool:
        return await self._change("DELETE FROM files WHERE id = ? AND owner = ?", file_id, owner) == 1

    async def create(self, stored: StoredBatch) -> None:
        await self._change("INSERT INTO batches (id, owner, created_ns, record) VALUES (?, ?, ?, ?)",
                           stored.batch.id, stored.owner.tenant, stored.created_ns, stored.model_dump_json())

    async def batch(self, batch_id: str) -> StoredBatch | None:
        rows = await self._rows(f"{_BATCH} WHERE id = ?", batch_id)
        return merged(rows[0][0], rows[0][1], rows[0][2:]) if rows else None

    async def batches(self, owner: str) -> list[StoredBatch]:
        return [stored for record, cancel_at, *counts in await self._rows(f"{_BATCH} WHERE owner = ?", owner)
                if (stored := merged(record, cancel_at, counts)) is not None]

    async def remove(self, batch_id: str) -> None:
        await self._change("DELETE FROM batches WHERE id = ?", batch_id)  # its answers with it (`batches_removed`)

    async def ask_cancel(self, batch_id: str) -> None:
        await self._change("UPDATE batches SET cancel_at = ? WHERE id = ? AND cancel_at IS NULL", int(time.time()),
                           batch_id)

    async def runnable(self) -> list[str]:
        return [batch_id for batch_id, in await self._rows("SELECT id FROM batches WHERE done = 0 ORDER BY created_ns, id")]

    async def claim(self, batch_id: str, holder: str, ttl_s: float) -> int | None:
        now = time.time()
        rows = await self._rows("UPDATE batches SET token = token + 1, holder = ?, claim_until = ? WHERE id = ? AND "
                                "done = 0 AND claim_until <= ? RETURNING token", holder, now + ttl_s, batch_id, now,
                                write=True)
        return int(rows[0][0]) if rows else None

    async def renew(self, batch_id: str, token: int, ttl_s: float) -> bool:
        return await self._change("UPDATE batches SET claim_until = ? WHERE id = ? AND token = ?", time.time() + ttl_s,
                                  batch_id, token) == 1

    async def release(self, batch_id: str, token: int) -> None:
        await self._change("UPDATE batches SET claim_until = 0 WHERE id = ? AND token = ?", batch_id, token)

    async def save(self, stored: StoredBatch, token: int) -> None:
        if not await self._change("UPDATE batches SET record = ?, done = ? WHERE id = ? AND token = ?",
                                  stored.model_dump_json(), stored.batch.status in DONE, stored.batch.id, token):
            raise Fenced(stored.batch.id)

    async def answer_all(self, batch_id: str, token: int, answers: list[Answer]) -> int:
        def add(db: sqlite3.Connection) -> int:
            if db.execute("SELECT 1 FROM batches WHERE id = ? AND token = ?", (batch_id, token)).fetchone() is None:
                raise Fenced(batch_id)
            return sum(db.execute("INSERT OR IGNORE INTO answers (batch_id, custom_id, ok, expired, prompt, completion, "
                                  "line) VALUES (?, ?, ?, ?, ?, ?, ?)",  # counted by `answers_counted`
                                  (batch_id, a.custom_id, a.ok, a.expired, a.prompt, a.completion, a.line)).rowcount
                       for a in answers)

        return await self._run(add, write=True)

    async def answered(self, batch_id: str) -> set[str]:
        return {custom_id for custom_id, in await self._rows("SELECT custom_id FROM answers WHERE batch_id = ?", batch_id)}

    async def answers(self, batch_id: str) -> AsyncIterator[list[Answer]]:
        after = -1
        while rows := await self._rows("SELECT seq, custom_id, ok, expired, line FROM answers WHERE batch_id = ? AND "
                                       "seq > ? ORDER BY seq LIMIT ?", batch_id, after, PAGE):
            yield [Answer(custom_id, bool(ok), bytes(line), bool(expired)) for _, custom_id, ok, expired, line in rows]
            after = rows[-1][0]

    async def aclose(self) -> None:
        """The connection closed once the calls before have ended; a call after opens it again."""
        def close() -> None:
            if getattr(self._open, "db", None) is not None:
                self._open.db.close()
                self._open.db = None

        thread, self._thread = self._thread, ThreadPoolExecutor(1, thread_name_prefix="sqlite-records")
        await asyncio.get_running_loop().run_in_executor(thread, close)
        thread.shutdown(wait=False)
