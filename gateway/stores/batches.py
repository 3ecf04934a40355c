"""The Batches API's store: each batch a few objects of a `Blobs` store (`stores.blobs`: local disk
under `batches.dir` by default, Redis or S3 as `store.backend` says), under its owner's prefix, named
by a hash of the owner (as `stores.files` does):

    <sha256(owner)[:32]>/batch_<32 hex>/record.json    the batch (`StoredBatch`): written whole (`put`)
    .../batch_<32 hex>/input.jsonl     the input file's lines, copied at create (a delete of the file does not stop it)
    .../batch_<32 hex>/output.jsonl    answered lines, appended one at a time (kept once appended)
    .../batch_<32 hex>/errors.jsonl    failed lines, the same way
    .../batch_<32 hex>/cancel          a cancel asked for (by any replica): its time
    .../batch_<32 hex>/lease.<n>       who runs it (`Lease`), generation n
    pending/<sha256(owner)[:32]>.<batch id>   the index of batches not done yet (what the runner reads)

(On disk these are files below `batches.dir`, the layout of earlier versions.) A batch is reached
only through its owner's view (`BatchStore.of`): another owner's id is a 404 exactly as an unknown
one. An id is checked to be an id (`batch_` and 32 lowercase hex) before any name is built from it.
Anthropic's Message Batches live beside OpenAI's batches, as the same records, under ids of their own
(`msgbatch_` and 32 hex, `of(owner, MESSAGE_BATCH)`): each API's view sees only its own kind, so
neither lists nor answers the other's.

A batch exists once its record does: its entry in the pending index is written first, then its
input, then its record, so a reader (another replica's runner) sees a whole batch or none, and a
crash or a store failing between the steps loses no batch that was made and leaves nothing behind
for good (an entry whose record never came is removed by the runner once it is old, with the input
written under it). Its entry is removed once the batch is done (by the runner that ends
it, or by the next one that finds it done), so a runner lists only the batches it may have to run
(`pending`), never the whole store. Deleting removes the record first (the batch is gone for every
reader), then the rest.

Who writes what: the record is written by its creator, then only by the replica holding its lease
(the runner); a cancel only creates the `cancel` object, which a reader merges into the status it
shows (`cancelling`) until the runner writes `cancelled`. The progress of a batch is the set of
custom_ids in its output and error objects: a runner that starts on it reads them (a last line torn
by a crash, on disk, is cut off by writing the good part back) and runs only the others, so every
line is answered once.

Leases: with replicas sharing the store, one runs a batch at a time. The lease is the object
`lease.<n>` of the highest generation n, holding its holder and an expiry. A replica takes a free
batch by creating generation 1 (`create`: one of two racing replicas wins), an expired lease by
creating generation n+1 the same way, renews its own by rewriting it (`put`), and has lost it when a
higher generation exists. A holder that stalls past its expiry may still have lines in flight when
another takes over: it checks that it holds the lease before it writes each answer (and the record),
so the lines it loses are answered once, by the new holder. A write already under way when the
lease passes may still land after the new holder read the progress (a check, not a fence): the same
custom_id then appears twice in the objects, and everything that reads them keeps the first
(`unique_lines`: the counts, the published files, a Message Batch's results). That check asks the store only when it
must (`Lease.surely_held`): no replica takes a lease over before the expiry its holder last wrote, so
a holder that wrote an expiry (taken, or renewed before the previous one passed) holds it until then
without asking; it asks again once less than a margin is left (the runner's: a third of `lease_s`,
for clocks that disagree and writes slow to land), which a holder renewing on time never reaches and
a stalled one always does. A holder that finds itself taken over forgets that certainty.

A store that is down is a `StoreUnavailable` (503, `stores.guarded`); the runner logs it and tries
again at its next poll.
"""

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
from gateway.protocol.batches import DONE, Batch, BatchUsage, StoredBatch
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
    """What a batch's output and error objects hold: the custom_ids answered, counts and usage."""

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
    """(prompt, completion) tokens of an answer's `usage`, in any of the endpoints' shapes."""
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return 0, 0
    prompt = usage.get("prompt_tokens", usage.get("input_tokens", 0))
    completion = usage.get("completion_tokens", usage.get("output_tokens", 0))
    return (prompt if isinstance(prompt, int) else 0), (completion if isinstance(completion, int) else 0)


def _count_lines(path: Path, progress: Progress, ok: bool) -> int | None:
    """Count a result file's lines into `progress`; the length of its good part when its last line was
    cut short by a crash (and anything after it is to be cut off), else None. Blocking."""
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
    """The result lines of `chunks` whose custom_id is not in `seen` (added as they pass): each
    custom_id once, the first written. A holder that stalled past its lease may append a line after
    the replica that took the batch over read its progress and answered it again (its lease is checked
    before a write, not fenced during one); what a client reads (the published files, a Message
    Batch's results) and what is counted (`_count_lines`) keep the first, so each line is answered
    once whatever reached the store."""
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


def _merge_cancel(stored: StoredBatch, cancelled: int | None) -> StoredBatch:
    if cancelled is not None and stored.batch.status not in DONE and stored.batch.status != "cancelling":
        stored.batch.status, stored.batch.cancelling_at = "cancelling", cancelled
    return stored


@dataclass(slots=True, frozen=True)
class BatchObjects:
    """One batch's objects, and every operation on them."""

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
        """Its entry in the index of batches not done yet."""
        return f"{PENDING}{self.home}.{self.id}"

    async def load(self) -> StoredBatch | None:
        """The batch as last written, with a cancel asked for since shown as `cancelling`; None when
        there is none (never made, or deleted) or its record cannot be read (logged: a disk that
        corrupted it, a hand edit, a version whose record this one does not know), so that one such
        batch fails nothing but itself."""
        raw = await self.blobs.get(self.name(RECORD))
        if raw is None:
            return None
        try:
            stored = StoredBatch.model_validate_json(raw)
        except ValidationError as exc:
            log.warning("batch_record_unreadable", batch_id=self.id, errors=exc.error_count())
            return None
        return _merge_cancel(stored, await self.cancel_asked())

    async def exists(self) -> bool:
        return await self.blobs.get(self.name(RECORD)) is not None

    async def read(self) -> StoredBatch:
        """The batch as `load` reads it; a 404 when there is none."""
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
        """The custom_ids answered so far, counted from the output and error objects (a torn last line
        cut off: the good part written back)."""
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
        """Result lines (each ending in a newline), kept before this returns (the progress a restart
        resumes from)."""
        await self.blobs.append(self.name(part), lines)

    def local(self, part: str) -> AbstractAsyncContextManager[Path | None]:
        """A local file of one of its objects, for blocking reads (see `Blobs.local`)."""
        return self.blobs.local(self.name(part))

    async def open(self, part: str) -> Opened | None:
        return await self.blobs.open(self.name(part))

    async def done(self) -> None:
        """Out of the index of batches not done yet (its record says it is done)."""
        await self.blobs.delete(self.entry)


@dataclass(slots=True, frozen=True)
class BatchStore:
    """Every batch has an owner, and the only way to one is through its owner's view (`of`); the
    runner alone walks the batches not done yet (`pending`)."""

    blobs: Blobs
    spool: Spool

    @classmethod
    def on(cls, blobs: Blobs, spool: Spool) -> BatchStore:
        """The store on `blobs` (its failures the API's 503), copying inputs through `spool`."""
        return cls(Guarded(blobs), spool)

    def of(self, owner: str, kind: str = BATCH) -> OwnedBatches:
        """The owner's batches of one kind (`BATCH`: OpenAI's, `MESSAGE_BATCH`: Anthropic's)."""
        return OwnedBatches(self.blobs, self.spool, owner_prefix(owner), kind)

    def _batch(self, home: str, batch_id: str) -> BatchObjects:
        return BatchObjects(self.blobs, self.spool, home, batch_id)

    async def pending(self, done: set[str]) -> list[BatchObjects]:
        """Every batch of every owner that is not done yet, oldest first (for the runner), from the
        index. `done`: ids known to be done, not read again; those found done are added (and leave the
        index), and entries whose batch never came are removed once old."""
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
        """An entry without a record: a create in progress, or one that crashed (removed once old)."""
        raw = await self.blobs.get(batch.entry)
        try:
            made = orjson.loads(raw).get("created", 0) if raw else 0
        except (orjson.JSONDecodeError, AttributeError):  # unreadable: as old as can be
            made = 0
        if made + ORPHAN_S < time.time() and not await batch.exists():
            await self.blobs.delete(batch.entry, *await self.blobs.list(batch.prefix))

    async def index_unlisted(self) -> int:
        """The batches not done of a store made before the pending index, entered in it (the whole
        store listed once, then never again); how many."""
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
    """One owner's batches of one kind (ids starting with `kind`)."""

    blobs: Blobs
    spool: Spool
    home: str
    kind: str = BATCH

    def _is_id(self, batch_id: str) -> bool:
        return batch_id.startswith(self.kind) and ID.fullmatch(batch_id) is not None

    def _batch(self, batch_id: str) -> BatchObjects:
        return BatchObjects(self.blobs, self.spool, self.home, batch_id)

    async def find(self, batch_id: str, param: str = "batch_id") -> tuple[BatchObjects, StoredBatch]:
        """The batch and its record (a 404 naming `param` for anything that is not an id of one of this
        owner's batches of this kind)."""
        if not self._is_id(batch_id):
            raise not_found(batch_id, param)
        batch = self._batch(batch_id)
        stored = await batch.load()
        if stored is None:
            raise not_found(batch_id, param)
        return batch, stored

    async def create(self, stored: StoredBatch, source: Opened | bytes) -> None:
        """A new batch, whole or not at all: its entry in the pending index (first: what is written
        after it is removed with it when the create does not end), its input (the content opened at
        `source`, streamed through the spool, or these bytes), then its record."""
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
        """Ask for a cancel (the runner holding the batch carries it out); a batch already done is a 400
        (its message `ended` when given: in the words of the API asked)."""
        batch, stored = await self.find(batch_id, param)
        if stored.batch.status in DONE:
            raise InvalidRequest(ended or f"Cannot cancel a batch with status '{stored.batch.status}'.", param=param)
        await batch.ask_cancel()
        return await batch.read()

    async def delete(self, batch_id: str, param: str = "batch_id") -> None:
        """Remove a batch that is done (a 400 while it runs): its record first, so that it is gone for
        every reader at once, then the rest."""
        batch, stored = await self.find(batch_id, param)
        if stored.batch.status not in DONE:
            raise InvalidRequest(f"Batch '{batch_id}' is still being processed: cancel it and delete it once it "
                                 "has ended.", param=param)
        await self.blobs.delete(batch.name(RECORD))
        await self.blobs.delete(batch.entry, *await self.blobs.list(batch.prefix))

    async def page(self, after: str | None, limit: int, before: str | None = None,
                   names: tuple[str, str] = ("after", "before")) -> tuple[list[StoredBatch], bool]:
        """A page of this owner's batches, newest first: those right after the batch `after`, or right
        before the batch `before` (a 400 naming the parameter, `names`, when it is none of this
        owner's), and whether more follow (or precede, with `before`)."""
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
    """A replica's hold on one batch (see the module's docstring)."""

    batch: BatchObjects
    holder: str
    generation: int
    lease_s: float
    until: float = 0.0  # (monotonic) no other replica can take it over before this (see `surely_held`)

    @classmethod
    async def take(cls, batch: BatchObjects, holder: str, lease_s: float) -> Lease | None:
        """The batch's lease, when it is free or its holder's has expired; None when another holds it."""
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
        """Still this replica's: no other has taken it over (a higher generation)."""
        if (await _newest(self.batch))[0] == self.generation:
            return True
        self.until = 0.0
        return False

    def surely_held(self, margin_s: float) -> bool:
        """Held for at least `margin_s` more, known without asking the store: another replica takes a
        lease over only once the expiry its holder last wrote has passed, and this one wrote it (at
        `take`, or at a `renew` that landed before the expiry before it) at `until - lease_s` or
        later. The margin covers the clocks of the replicas disagreeing and a write that is slow to
        land; a replica that stalls past it asks the store again (`held`)."""
        return time.monotonic() < self.until - margin_s

    async def renew(self) -> bool:
        """Held for another `lease_s`; False when another replica has taken it over meanwhile."""
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
        """Expired at once, so that another replica may take the batch now (a clean shutdown); nothing
        when the batch is gone (a Message Batch deleted as soon as it ended)."""
        self.until = 0.0
        if await self.held() and await self.batch.exists():
            await self.batch.blobs.put(self.name, self._content(expires=0))


async def _newest(batch: BatchObjects) -> tuple[int, dict[str, float] | None]:
    """The highest lease generation and its content (0, None: never leased)."""
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

