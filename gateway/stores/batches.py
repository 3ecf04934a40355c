"""The Batches API's and Message Batches API's store: each batch a few objects (record, input, output, errors, cancel,
leases) under its owner's prefix of a `Blobs` store, plus an index of the batches not done yet."""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import orjson
import structlog
from pydantic import ValidationError

from gateway.errors import InvalidRequest, NotFound
from gateway.protocol.batch_objects import DONE, Batch, BatchUsage, StoredBatch
from gateway.stores.blobs import Blobs, Opened, each
from gateway.stores.files import owner_prefix
from gateway.stores.guarded import Guarded
from gateway.stores.spool import Spool

BATCH, MESSAGE_BATCH = "batch_", "msgbatch_"  # the id prefixes of OpenAI's batches and Anthropic's
log = structlog.get_logger(__name__)

ID = re.compile(r"(?:msg)?batch_[0-9a-f]{32}")
HOME = re.compile(r"[0-9a-f]{32}")
RECORD, INPUT, CANCEL = "record.json", "input.jsonl", "cancel"
Results = Literal["output.jsonl", "errors.jsonl"]
OUTPUT: Results = "output.jsonl"
ERRORS: Results = "errors.jsonl"
PENDING = "pending/"
INDEXED = "pending.indexed"  # the batches of a store older than the index entered in it (once)
EXPIRED_CODE = "batch_expired"  # the error of a line a batch past its window never ran
ORPHAN_S = 3600  # an index entry whose record has not come this long after: a create that crashed


def not_found(batch_id: str, param: str = "batch_id") -> NotFound:
    return NotFound(f"No batch found with id '{batch_id}'.", param=param)


def new_id(kind: str = BATCH) -> str:
    return kind + secrets.token_hex(16)


@dataclass(slots=True)
class Progress:
    done: set[str] = field(default_factory=set)
    completed: int = 0
    failed: int = 0
    expired: int = 0  # of the failed: lines never run, written as expired (`batch_expired`)
    usage: BatchUsage = field(default_factory=BatchUsage)

    def count(self, custom_id: str, ok: bool, prompt: int = 0, completion: int = 0) -> None:
        self.done.add(custom_id)
        if ok:
            self.completed += 1
        else:
            self.failed += 1
        self.usage.add(prompt, completion)


def tokens_of(body: object) -> tuple[int, int]:
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return 0, 0
    prompt = usage.get("prompt_tokens", usage.get("input_tokens", 0))
    completion = usage.get("completion_tokens", usage.get("output_tokens", 0))
    return (prompt if isinstance(prompt, int) else 0), (completion if isinstance(completion, int) else 0)


def _count_lines(path: Path, progress: Progress, ok: bool) -> int | None:
    """Count a result file's lines into `progress`; the length of its good part when its last line was torn by a
    crash, else None. Blocking."""
    good, size = 0, path.stat().st_size
    with path.open("rb") as results:
        for line in results:
            try:
                parsed = orjson.loads(line) if line.endswith(b"\n") else None
            except orjson.JSONDecodeError:
                parsed = None
            if not isinstance(parsed, dict) or not isinstance(parsed.get("custom_id"), str):
                break  # torn: this line and anything after it were not finished
            good += len(line)
            if parsed["custom_id"] in progress.done:  # written twice (see `unique_lines`): counted once
                continue
            response = parsed.get("response")
            body = response.get("body") if isinstance(response, dict) else None
            progress.count(parsed["custom_id"], ok, *tokens_of(body))
            error = parsed.get("error")
            progress.expired += not ok and isinstance(error, dict) and error.get("code") == EXPIRED_CODE
    return good if good < size else None


async def unique_lines(chunks: AsyncIterator[bytes], seen: set[str]) -> AsyncIterator[bytes]:
    """The result lines of `chunks` whose custom_id is not in `seen`, the first written kept: a holder that stalled
    past its lease may append a line the next holder answers again (the lease is checked before a write, not fenced
    during one)."""
    rest = b""
    async for chunk in chunks:
        *lines, rest = (rest + chunk).split(b"\n")
        kept = [line + b"\n" for line in lines if _first(line, seen)]
        if kept:
            yield b"".join(kept)
    if rest and _first(rest, seen):
        yield rest


def _first(line: bytes, seen: set[str]) -> bool:
    try:
        custom_id = orjson.loads(line).get("custom_id")
    except (orjson.JSONDecodeError, AttributeError):
        return True  # not a result line: passed on as it is
    if not isinstance(custom_id, str):
        return True
    if custom_id in seen:
        return False
    seen.add(custom_id)
    return True


@dataclass(slots=True, frozen=True)
class BatchObjects:
    blobs: Blobs
    spool: Spool
    home: str  # its owner's prefix
    id: str

    def name(self, part: str) -> str:
        return f"{self.home}/{self.id}/{part}"

    @property
    def prefix(self) -> str:
        return f"{self.home}/{self.id}/"

    @property
    def entry(self) -> str:
        return f"{PENDING}{self.home}.{self.id}"

    async def load(self) -> StoredBatch | None:
        """The batch as last written, a pending cancel shown as `cancelling`; None when there is none or its record is
        unreadable (logged), so one bad record fails only its batch."""
        raw = await self.blobs.get(self.name(RECORD))
        if raw is None:
            return None
        try:
            stored = StoredBatch.model_validate_json(raw)
        except ValidationError as exc:
            log.warning("batch_record_unreadable", batch_id=self.id, errors=exc.error_count())
            return None
        cancelled, batch = await self.cancel_asked(), stored.batch
        if cancelled is not None and batch.status not in DONE and batch.status != "cancelling":
            batch.status, batch.cancelling_at = "cancelling", cancelled
        return stored

    async def exists(self) -> bool:
        return await self.blobs.get(self.name(RECORD)) is not None

    async def read(self) -> StoredBatch:
        stored = await self.load()
        if stored is None:
            raise not_found(self.id)
        return stored

    async def write(self, stored: StoredBatch) -> None:
        await self.blobs.put(self.name(RECORD), stored.model_dump_json().encode())

    async def ask_cancel(self) -> None:
        await self.blobs.create(self.name(CANCEL), str(int(time.time())).encode())

    async def cancel_asked(self) -> int | None:
        raw = await self.blobs.get(self.name(CANCEL))
        try:
            return None if raw is None else int(raw or b"0")
        except ValueError:
            return None

    async def progress(self) -> Progress:
        """A torn last line is cut off by writing the good part back."""
        progress = Progress()
        for part, ok in ((OUTPUT, True), (ERRORS, False)):
            async with self.local(part) as path:
                if path is None:
                    continue
                good = await asyncio.to_thread(_count_lines, path, progress, ok)
                staged = None if good is None else await self.spool.head(path, good)
            if staged is not None:
                try:
                    await self.blobs.put_file(self.name(part), staged.path)
                finally:
                    await staged.discard()
        return progress

    async def append(self, part: Results, lines: bytes) -> None:
        await self.blobs.append(self.name(part), lines)

    def local(self, part: str) -> AbstractAsyncContextManager[Path | None]:
        return self.blobs.local(self.name(part))

    async def open(self, part: str) -> Opened | None:
        return await self.blobs.open(self.name(part))

    async def done(self) -> None:
        await self.blobs.delete(self.entry)


@dataclass(slots=True, frozen=True)
class BatchStore:
    """A batch is reached only through its owner's view (`of`); only the runner walks the pending index. The index
    entry is written first, then the input, then the record, so a reader sees a whole batch or none and a crash
    leaves an orphan entry the runner removes once old."""

    blobs: Blobs
    spool: Spool

    @classmethod
    def on(cls, blobs: Blobs, spool: Spool) -> BatchStore:
        return cls(Guarded(blobs), spool)

    def of(self, owner: str, kind: str = BATCH) -> OwnedBatches:
        return OwnedBatches(self.blobs, self.spool, owner_prefix(owner), kind)

    def _batch(self, home: str, batch_id: str) -> BatchObjects:
        return BatchObjects(self.blobs, self.spool, home, batch_id)

    async def pending(self, done: set[str]) -> list[BatchObjects]:
        """Every batch not done yet, oldest first. `done`: ids known to be done, skipped; those found done are added
        and leave the index."""
        found: list[tuple[int, BatchObjects]] = []
        for entry in await self.blobs.list(PENDING):
            home, _, batch_id = entry.removeprefix(PENDING).partition(".")
            if batch_id in done or not (HOME.fullmatch(home) and ID.fullmatch(batch_id)):
                continue
            batch = self._batch(home, batch_id)
            stored = await batch.load()
            if stored is None and await batch.exists():  # there but unreadable (logged): not read again here
                done.add(batch_id)
            elif stored is None:
                await self._orphan(batch)
            elif stored.batch.status in DONE:
                done.add(batch_id)
                await batch.done()
            else:
                found.append((stored.batch.created_at, batch))
        return [batch for _, batch in sorted(found, key=lambda item: (item[0], item[1].id))]

    async def _orphan(self, batch: BatchObjects) -> None:
        raw = await self.blobs.get(batch.entry)
        try:
            made = orjson.loads(raw).get("created", 0) if raw else 0
        except (orjson.JSONDecodeError, AttributeError):  # unreadable: as old as can be
            made = 0
        if made + ORPHAN_S < time.time() and not await batch.exists():
            await self.blobs.delete(batch.entry, *await self.blobs.list(batch.prefix))

    async def index_unlisted(self) -> int:
        """Batches not done of a store made before the pending index, entered in it once; how many."""
        if await self.blobs.get(INDEXED) is not None:
            return 0
        added = 0
        for name in await self.blobs.list(""):
            home, _, rest = name.partition("/")
            batch_id, _, part = rest.partition("/")
            if part != RECORD or not (HOME.fullmatch(home) and ID.fullmatch(batch_id)):
                continue
            batch = self._batch(home, batch_id)
            stored = await batch.load()
            if stored is not None and stored.batch.status not in DONE:
                added += await self.blobs.create(batch.entry, orjson.dumps({"created": time.time()}))
        await self.blobs.put(INDEXED, b"")
        return added

    async def aclose(self) -> None:
        await self.blobs.aclose()


@dataclass(slots=True, frozen=True)
class OwnedBatches:
    blobs: Blobs
    spool: Spool
    home: str
    kind: str = BATCH

    def _is_id(self, batch_id: str) -> bool:
        return batch_id.startswith(self.kind) and ID.fullmatch(batch_id) is not None

    def _batch(self, batch_id: str) -> BatchObjects:
        return BatchObjects(self.blobs, self.spool, self.home, batch_id)

    async def find(self, batch_id: str, param: str = "batch_id") -> tuple[BatchObjects, StoredBatch]:
        if not self._is_id(batch_id):
            raise not_found(batch_id, param)
        batch = self._batch(batch_id)
        stored = await batch.load()
        if stored is None:
            raise not_found(batch_id, param)
        return batch, stored

    async def create(self, stored: StoredBatch, source: Opened | bytes) -> None:
        batch = self._batch(stored.batch.id)
        await self.blobs.put(batch.entry, orjson.dumps({"created": time.time()}))
        if isinstance(source, bytes):
            await self.blobs.put(batch.name(INPUT), source)
        else:
            staged = await self.spool.fill(source.chunks, "input")
            try:
                await self.blobs.put_file(batch.name(INPUT), staged.path)
            finally:
                await staged.discard()
        await batch.write(stored)

    async def get(self, batch_id: str) -> Batch:
        return (await self.find(batch_id))[1].batch

    async def cancel(self, batch_id: str, param: str = "batch_id", ended: str | None = None) -> StoredBatch:
        """Ask for a cancel (the runner holding the batch carries it out); a batch already done is a 400 (message
        `ended` when given)."""
        batch, stored = await self.find(batch_id, param)
        if stored.batch.status in DONE:
            raise InvalidRequest(ended or f"Cannot cancel a batch with status '{stored.batch.status}'.", param=param)
        await batch.ask_cancel()
        return await batch.read()

    async def delete(self, batch_id: str, param: str = "batch_id") -> None:
        """Its record first, so it is gone for every reader at once."""
        batch, stored = await self.find(batch_id, param)
        if stored.batch.status not in DONE:
            raise InvalidRequest(f"Batch '{batch_id}' is still being processed: cancel it and delete it once it "
                                 "has ended.", param=param)
        await self.blobs.delete(batch.name(RECORD))
        await self.blobs.delete(batch.entry, *await self.blobs.list(batch.prefix))

    async def page(self, after: str | None, limit: int, before: str | None = None,
                   names: tuple[str, str] = ("after", "before")) -> tuple[list[StoredBatch], bool]:
        """A page of this owner's batches, newest first, after `after` or before `before` (a 400 naming `names` when
        unknown), and whether more follow."""
        stored = await self._all()
        stored.sort(key=lambda s: (s.batch.created_at, s.created_ns, s.batch.id), reverse=True)
        ids = [s.batch.id for s in stored]
        for cursor, name in ((after, names[0]), (before, names[1])):
            if cursor is not None and cursor not in ids:
                raise InvalidRequest(f"No batch to list {name.partition('_')[0]}: {cursor}", param=name)
        if before is not None:
            end = ids.index(before)
            return stored[max(0, end - limit) : end], end - limit > 0
        start = 0 if after is None else ids.index(after) + 1
        return stored[start : start + limit], start + limit < len(stored)

    async def _all(self) -> list[StoredBatch]:
        ids = []
        for name in await self.blobs.list(f"{self.home}/"):
            batch_id, _, part = name.removeprefix(f"{self.home}/").partition("/")
            if part == RECORD and self._is_id(batch_id):
                ids.append(batch_id)
        found = await each(ids, lambda batch_id: self._batch(batch_id).load())
        return [stored for stored in found if stored is not None]


LEASE = re.compile(r"lease\.([0-9]+)")


@dataclass(slots=True)
class Lease:
    """A replica's hold on one batch: the object `lease.<n>` of the highest generation n. Taking one is an exclusive
    create of the next generation; a holder has lost it when a higher one exists. A holder checks before each
    write, but asks the store only when less than a margin of its own last expiry is left (`surely_held`)."""

    batch: BatchObjects
    holder: str
    generation: int
    lease_s: float
    until: float = 0.0  # (monotonic) no other replica can take it over before this (see `surely_held`)

    @classmethod
    async def take(cls, batch: BatchObjects, holder: str, lease_s: float) -> Lease | None:
        generation, current = await _newest(batch)
        if current is not None and current.get("expires", 0) > time.time():
            return None
        lease = cls(batch, holder, generation + 1, lease_s)
        written = time.monotonic()
        if not await batch.blobs.create(lease.name, lease._content()):
            return None  # another replica took this generation first
        lease.until = written + lease_s
        older = range(max(1, generation - 1), generation + 1)  # the ones before are gone already
        await batch.blobs.delete(*(batch.name(f"lease.{n}") for n in older))
        return lease

    @property
    def name(self) -> str:
        return self.batch.name(f"lease.{self.generation}")

    def _content(self, expires: float | None = None) -> bytes:
        return orjson.dumps({"holder": self.holder, "expires": time.time() + self.lease_s if expires is None else expires})

    async def held(self) -> bool:
        if (await _newest(self.batch))[0] == self.generation:
            return True
        self.until = 0.0
        return False

    def surely_held(self, margin_s: float) -> bool:
        """No replica takes a lease over before the expiry its holder last wrote; the margin covers clock skew and
        slow writes."""
        return time.monotonic() < self.until - margin_s

    async def renew(self) -> bool:
        if not await self.held():
            return False
        written = time.monotonic()
        await self.batch.blobs.put(self.name, self._content())
        # sure until the new expiry when the write landed before the old one (none could take it in
        # between), or when the lease is still this one's after the write (a taker then sees the new one)
        if time.monotonic() < self.until or await self.held():
            self.until = written + self.lease_s
        return True

    async def release(self) -> None:
        """Expired at once so another replica may take it (a clean shutdown); nothing when the batch is gone."""
        self.until = 0.0
        if await self.held() and await self.batch.exists():
            await self.batch.blobs.put(self.name, self._content(expires=0))


async def _newest(batch: BatchObjects) -> tuple[int, dict[str, float] | None]:
    names = await batch.blobs.list(batch.prefix)
    generations = [int(m.group(1)) for n in names if (m := LEASE.fullmatch(n.rpartition("/")[2]))]
    if not generations:
        return 0, None
    newest = max(generations)
    raw = await batch.blobs.get(batch.name(f"lease.{newest}"))
    try:
        content = orjson.loads(raw) if raw is not None else {"expires": 0}  # removed meanwhile: taken over
    except orjson.JSONDecodeError:
        content = {"expires": time.time() + 1}  # unreadable: held, until its holder writes it again
    return newest, content if isinstance(content, dict) else None

