"""The batch lane's records in a database: files, batches, their counts and each line's answer. `Records` is either
backend: `SqliteRecords` the one-node default (the standard library's SQLite, WAL, one file per part), `RedisRecords`
across replicas. Contents (uploads, inputs, output files) are blobs (`stores.blobs`), written once.

Both backends answer alike. Each line's answer is kept once, the first (`(batch_id, custom_id)` unique); a record's
counts (its answers') and a cancel asked (the first ask's time) are kept beside it, never lost to a runner's write of
the record. `batch` is the record as `merged`, whoever its owner (the caller checks). A run: `claim` hands a fencing
token, higher each time, when no claim on the batch is live; `renew`, `save` and `answer_all` are refused once the
batch was claimed again since: a replica that stalled past its claim writes nothing after another took it over."""

from __future__ import annotations

import asyncio
import hashlib
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias, TypeVar

import structlog
from pydantic import ValidationError

from gateway.protocol.batch_objects import DONE, BatchUsage, FileObject, RequestCounts, StoredBatch
from gateway.stores.blobs import unavailable
from gateway.stores.redis import Client

T = TypeVar("T")
M = TypeVar("M", StoredBatch, FileObject)
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
            if (db := getattr(self._open, "db", None)) is not None:
                db.close()  # the thread ends after this call: its connection is gone with it

        thread, self._thread = self._thread, ThreadPoolExecutor(1, thread_name_prefix="sqlite-records")
        await asyncio.get_running_loop().run_in_executor(thread, close)
        thread.shutdown(wait=False)


COUNTS = ("completed", "failed", "expired", "prompt", "completion")

SCRIPTS = {"claim": """
if redis.call('HEXISTS', KEYS[2], 'record') == 0 or redis.call('ZSCORE', KEYS[3], ARGV[3]) == false then return 0 end
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 0 end
return redis.call('HINCRBY', KEYS[2], 'token', 1)
""", "hold": """
if redis.call('HGET', KEYS[2], 'token') ~= ARGV[1] then return 0 end
if ARGV[2] == '0' then redis.call('DEL', KEYS[1]) else redis.call('SET', KEYS[1], 'held', 'PX', ARGV[2]) end
return 1
""", "cancel": """
if redis.call('HEXISTS', KEYS[1], 'record') == 1 then redis.call('HSETNX', KEYS[1], 'cancel_at', ARGV[1]) end
return 1
""", "save": """
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'record', ARGV[2])
if ARGV[3] == '1' then redis.call('ZREM', KEYS[2], ARGV[4]) end
return 1
""", "answer": """
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then return -1 end
local kept = 0
for at = 2, #ARGV, 7 do
  if redis.call('HSETNX', KEYS[2], ARGV[at], ARGV[at + 1]) == 1 then
    kept = kept + 1
    redis.call('RPUSH', KEYS[3], ARGV[at])
    for i, field in ipairs({'completed', 'failed', 'expired', 'prompt', 'completion'}) do
      redis.call('HINCRBY', KEYS[1], field, ARGV[at + 1 + i])
    end
  end
end
return kept
"""}


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _hash(owner: str) -> str:
    return hashlib.sha256(owner.encode()).hexdigest()[:32]


class RedisRecords:
    """A replica's view of the records shared in one Redis (persistence on: AOF). Under the prefix: `files:<owner
    hash>` a hash of an owner's FileObjects; `batch:<id>` a hash of a batch's record, owner, cancel, fencing token and
    counts; `owned:<owner hash>` the set of an owner's batch ids; `runnable` a sorted set of the batches not done (by
    creation); `answers:<id>` a hash of each line's answer, written with HSETNX (once per line), and `order:<id>` the
    list of its custom_ids as they came; `claim:<id>` the holder of a batch's claim, expiring. Every change of a run is
    one Lua script that checks the run's token first: a replica stalled past its claim is refused once another
    claimed."""

    def __init__(self, client: Client, prefix: str) -> None:
        self._client, self._redis, self._p = client, client.redis, prefix
        self._scripts = {name: self._redis.register_script(source) for name, source in SCRIPTS.items()}

    async def _call(self, call: Awaitable[T]) -> T:
        with unavailable():
            return await self._client.bounded(call)

    async def _script(self, name: str, keys: list[str], args: list[Any]) -> int:
        return int(await self._call(self._scripts[name](keys=keys, args=args)))

    def _batch(self, batch_id: str) -> str:
        return f"{self._p}batch:{batch_id}"

    async def add_file(self, owner: str, file: FileObject) -> None:
        await self._call(self._redis.hset(f"{self._p}files:{_hash(owner)}", file.id, file.model_dump_json()))

    async def file(self, owner: str, file_id: str) -> FileObject | None:
        raw = await self._call(self._redis.hget(f"{self._p}files:{_hash(owner)}", file_id))
        return None if raw is None else parsed(FileObject, raw)

    async def files(self, owner: str) -> list[FileObject]:
        raw = await self._call(self._redis.hvals(f"{self._p}files:{_hash(owner)}"))
        return [file for record in raw if (file := parsed(FileObject, record)) is not None]

    async def remove_file(self, owner: str, file_id: str) -> bool:
        return bool(await self._call(self._redis.hdel(f"{self._p}files:{_hash(owner)}", file_id)))

    async def create(self, stored: StoredBatch) -> None:
        batch_id = stored.batch.id
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(self._batch(batch_id), mapping={"record": stored.model_dump_json(), "token": 0,
                                                       **dict.fromkeys(COUNTS, 0)})
            pipe.sadd(f"{self._p}owned:{_hash(stored.owner.tenant)}", batch_id)
            pipe.zadd(f"{self._p}runnable", {batch_id: stored.created_ns})
            await self._call(pipe.execute())

    async def batch(self, batch_id: str) -> StoredBatch | None:
        raw = await self._call(self._redis.hgetall(self._batch(batch_id)))
        if b"record" not in raw:
            return None
        cancel = raw.get(b"cancel_at")
        counts = [int(raw.get(name.encode(), 0)) for name in COUNTS]
        return merged(raw[b"record"], None if cancel is None else int(cancel), counts)

    async def batches(self, owner: str) -> list[StoredBatch]:
        ids = await self._call(self._redis.smembers(f"{self._p}owned:{_hash(owner)}"))
        found = [await self.batch(_text(batch_id)) for batch_id in ids]
        return [stored for stored in found if stored is not None and stored.owner.tenant == owner]

    async def remove(self, batch_id: str) -> None:
        stored = await self.batch(batch_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._batch(batch_id), f"{self._p}answers:{batch_id}", f"{self._p}order:{batch_id}")
            pipe.zrem(f"{self._p}runnable", batch_id)
            if stored is not None:
                pipe.srem(f"{self._p}owned:{_hash(stored.owner.tenant)}", batch_id)
            await self._call(pipe.execute())

    async def ask_cancel(self, batch_id: str) -> None:
        await self._script("cancel", [self._batch(batch_id)], [int(time.time())])  # none on a batch deleted meanwhile

    async def runnable(self) -> list[str]:
        return [_text(batch_id) for batch_id in await self._call(self._redis.zrange(f"{self._p}runnable", 0, -1))]

    async def claim(self, batch_id: str, holder: str, ttl_s: float) -> int | None:
        keys = [f"{self._p}claim:{batch_id}", self._batch(batch_id), f"{self._p}runnable"]
        return await self._script("claim", keys, [holder, int(ttl_s * 1000), batch_id]) or None

    async def renew(self, batch_id: str, token: int, ttl_s: float) -> bool:
        keys = [f"{self._p}claim:{batch_id}", self._batch(batch_id)]
        return bool(await self._script("hold", keys, [token, max(1, int(ttl_s * 1000))]))

    async def release(self, batch_id: str, token: int) -> None:
        await self._script("hold", [f"{self._p}claim:{batch_id}", self._batch(batch_id)], [token, 0])  # 0: freed

    async def save(self, stored: StoredBatch, token: int) -> None:
        batch_id = stored.batch.id
        done = int(stored.batch.status in DONE)
        keys = [self._batch(batch_id), f"{self._p}runnable"]
        if not await self._script("save", keys, [token, stored.model_dump_json(), done, batch_id]):
            raise Fenced(batch_id)

    async def answer_all(self, batch_id: str, token: int, answers: list[Answer]) -> int:
        keys = [self._batch(batch_id), f"{self._p}answers:{batch_id}", f"{self._p}order:{batch_id}"]
        args: list[Any] = [token]
        for a in answers:
            value = (b"1" if a.ok else b"2" if a.expired else b"0") + a.line
            args += [a.custom_id, value, int(a.ok), int(not a.ok), int(a.expired), a.prompt, a.completion]
        kept = await self._script("answer", keys, args)
        if kept < 0:
            raise Fenced(batch_id)
        return kept

    async def answered(self, batch_id: str) -> set[str]:
        return {_text(custom_id) for custom_id in await self._call(self._redis.hkeys(f"{self._p}answers:{batch_id}"))}

    async def answers(self, batch_id: str) -> AsyncIterator[list[Answer]]:
        start = 0
        while ids := await self._call(self._redis.lrange(f"{self._p}order:{batch_id}", start, start + PAGE - 1)):
            values = await self._call(self._redis.hmget(f"{self._p}answers:{batch_id}", ids))
            yield [Answer(_text(custom_id), value[:1] == b"1", value[1:], value[:1] == b"2")
                   for custom_id, value in zip(ids, values, strict=True) if isinstance(value, bytes)]
            start += PAGE

    async def aclose(self) -> None:
        pass  # the pool is the process's (`RedisPools`)
