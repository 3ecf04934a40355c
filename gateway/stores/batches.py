"""The Batches API's store: each batch a directory on local disk (`batches.dir`), under its owner's
directory, named by a hash of the owner (as `stores.files` does):

    <dir>/<sha256(owner)[:32]>/batch_<32 hex>/record.json    the batch (`StoredBatch`): written whole, renamed in place
    .../batch_<32 hex>/input.jsonl     the input file's lines, linked or copied at create (a delete of the file does not stop it)
    .../batch_<32 hex>/output.jsonl    answered lines, appended one at a time (flushed and fsynced)
    .../batch_<32 hex>/errors.jsonl    failed lines, the same way
    .../batch_<32 hex>/cancel          a cancel asked for (by any replica): its time
    .../batch_<32 hex>/lease.<n>       who runs it (`Lease`), generation n

A batch is reached only through its owner's view (`BatchStore.of`): another owner's id is a 404
exactly as an unknown one. An id is checked to be an id (`batch_` and 32 lowercase hex) before any
path is built from it. Anthropic's Message Batches live beside OpenAI's batches, as the same records,
under ids of their own (`msgbatch_` and 32 hex, `of(owner, MESSAGE_BATCH)`): each API's view sees only
its own kind, so neither lists nor answers the other's. A new batch's directory is made under a temporary name and renamed, so a
reader (another replica's runner) sees a whole batch or none.

Who writes what: the record is written by its creator, then only by the replica holding its lease
(the runner); a cancel only creates the `cancel` file, which a reader merges into the status it
shows (`cancelling`) until the runner writes `cancelled`. The progress of a batch is the set of
custom_ids in its output and error files: a runner that starts on it reads them (a last line torn
by a crash is cut off) and runs only the others, so every line is answered once.

Leases: with replicas sharing the directory, one runs a batch at a time. The lease is the file
`lease.<n>` of the highest generation n, holding its holder and an expiry. A replica takes a free
batch by creating generation 1 (O_CREAT|O_EXCL: one of two racing replicas wins), an expired
lease by creating generation n+1 the same way, renews its own by rewriting it (rename in place),
and has lost it when a higher generation exists. A holder that stalls past its expiry may still
have lines in flight when another takes over: it checks that it holds the lease before it writes
each answer (and the record), so the lines it loses are answered once, by the new holder.

The interface (`BatchStore`, `OwnedBatches`, `BatchDir`, `Lease`) is what a Redis or S3 store
would implement; only this local one exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import secrets
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from gateway.errors import InvalidRequest, NotFound
from gateway.protocol.batches import DONE, Batch, BatchUsage, StoredBatch

BATCH, MESSAGE_BATCH = "batch_", "msgbatch_"  # the id prefixes of OpenAI's batches and Anthropic's
ID = re.compile(r"(?:msg)?batch_[0-9a-f]{32}")
_MAKING = ".making-"


def not_found(batch_id: str, param: str = "batch_id") -> NotFound:
    return NotFound(f"No batch found with id '{batch_id}'.", param=param)


def new_id(kind: str = BATCH) -> str:
    return kind + secrets.token_hex(16)


def _write_atomic(path: Path, data: bytes) -> None:
    temporary = path.with_name(f"{_MAKING}{path.name}.{secrets.token_hex(4)}")
    with temporary.open("wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.replace(temporary, path)


@dataclass(slots=True)
class Progress:
    """What a batch's output and error files hold: the custom_ids answered, counts and usage."""

    done: set[str] = field(default_factory=set)
    completed: int = 0
    failed: int = 0
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


def _read_lines(path: Path, progress: Progress, ok: bool) -> None:
    """Count a result file's lines into `progress`; a last line cut short by a crash is removed."""
    if not path.exists():
        return
    with path.open("r+b") as results:
        good = 0
        for line in results:
            try:
                parsed = orjson.loads(line) if line.endswith(b"\n") else None
            except orjson.JSONDecodeError:
                parsed = None
            if not isinstance(parsed, dict) or not isinstance(parsed.get("custom_id"), str):
                break  # torn: this line and anything after it were not finished
            response = parsed.get("response")
            body = response.get("body") if isinstance(response, dict) else None
            progress.count(parsed["custom_id"], ok, *tokens_of(body))
            good += len(line)
        results.truncate(good)


@dataclass(slots=True, frozen=True)
class BatchDir:
    """One batch's directory and every file in it."""

    path: Path

    @property
    def id(self) -> str:
        return self.path.name

    @property
    def input(self) -> Path:
        return self.path / "input.jsonl"

    @property
    def output(self) -> Path:
        return self.path / "output.jsonl"

    @property
    def errors(self) -> Path:
        return self.path / "errors.jsonl"

    def read(self) -> StoredBatch:
        """The batch as last written, with a cancel asked for since shown as `cancelling`."""
        stored = StoredBatch.model_validate_json((self.path / "record.json").read_bytes())
        cancelled = self.cancel_asked()
        if cancelled is not None and stored.batch.status not in DONE and stored.batch.status != "cancelling":
            stored.batch.status, stored.batch.cancelling_at = "cancelling", cancelled
        return stored

    def write(self, stored: StoredBatch) -> None:
        _write_atomic(self.path / "record.json", stored.model_dump_json().encode())

    def ask_cancel(self) -> None:
        with contextlib.suppress(FileExistsError):
            fd = os.open(self.path / "cancel", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "wb") as marker:
                marker.write(str(int(time.time())).encode())

    def cancel_asked(self) -> int | None:
        try:
            return int((self.path / "cancel").read_bytes() or b"0")
        except (FileNotFoundError, ValueError):
            return None

    def progress(self) -> Progress:
        progress = Progress()
        _read_lines(self.output, progress, ok=True)
        _read_lines(self.errors, progress, ok=False)
        return progress

    @staticmethod
    def append(path: Path, line: bytes) -> None:
        """One result line, on disk before this returns (the progress a restart resumes from)."""
        with path.open("ab") as results:
            results.write(line + b"\n")
            results.flush()
            os.fsync(results.fileno())


@dataclass(slots=True, frozen=True)
class BatchStore:
    """Every batch has an owner, and the only way to one is through its owner's view (`of`); the
    runner alone walks them all (`pending`)."""

    root: Path

    @classmethod
    def at(cls, directory: Path) -> BatchStore:
        return cls(directory.expanduser())

    def of(self, owner: str, kind: str = BATCH) -> OwnedBatches:
        """The owner's batches of one kind (`BATCH`: OpenAI's, `MESSAGE_BATCH`: Anthropic's)."""
        return OwnedBatches(self.root / hashlib.sha256(owner.encode()).hexdigest()[:32], kind)

    async def pending(self, done: set[str]) -> list[BatchDir]:
        """Every batch of every owner that is not done yet, oldest first (for the runner). `done`: ids
        known to be done, not read again (a done batch never changes); those found done are added."""
        return await asyncio.to_thread(self._pending, done)

    def _pending(self, done: set[str]) -> list[BatchDir]:
        found: list[tuple[int, BatchDir]] = []
        for record in self.root.glob("*/*batch_*/record.json"):
            batch = BatchDir(record.parent)
            if batch.id in done or not ID.fullmatch(batch.id):
                continue
            try:
                stored = batch.read()
            except (FileNotFoundError, ValueError):
                continue
            if stored.batch.status in DONE:
                done.add(batch.id)
            else:
                found.append((stored.batch.created_at, batch))
        return [batch for _, batch in sorted(found, key=lambda item: (item[0], item[1].id))]


@dataclass(slots=True, frozen=True)
class OwnedBatches:
    """One owner's batches of one kind (ids starting with `kind`)."""

    home: Path
    kind: str = BATCH

    def _is_id(self, batch_id: str) -> bool:
        return batch_id.startswith(self.kind) and ID.fullmatch(batch_id) is not None

    def dir_of(self, batch_id: str, param: str = "batch_id") -> BatchDir:
        """The batch's directory (a 404 for anything that is not an id of one of this owner's)."""
        if not self._is_id(batch_id) or not (self.home / batch_id / "record.json").exists():
            raise not_found(batch_id, param)
        return BatchDir(self.home / batch_id)

    async def create(self, stored: StoredBatch, source: Path | bytes) -> None:
        """A new batch, whole or not at all: its input (the file at `source`, or these bytes) and
        record made under a temporary name, renamed."""

        def make() -> None:
            making = self.home / f"{_MAKING}{stored.batch.id}"
            making.mkdir(parents=True)
            try:
                if isinstance(source, bytes):
                    (making / "input.jsonl").write_bytes(source)
                else:
                    try:
                        os.link(source, making / "input.jsonl")  # the same disk: no copy
                    except OSError:
                        shutil.copyfile(source, making / "input.jsonl")
                BatchDir(making).write(stored)
                os.replace(making, self.home / stored.batch.id)
            except BaseException:
                shutil.rmtree(making, ignore_errors=True)
                raise

        await asyncio.to_thread(make)

    async def get(self, batch_id: str) -> Batch:
        batch = self.dir_of(batch_id)
        return (await asyncio.to_thread(batch.read)).batch

    async def cancel(self, batch_id: str) -> Batch:
        """Ask for a cancel (the runner holding the batch carries it out); a batch already done is a 400."""
        batch = self.dir_of(batch_id)
        stored = await asyncio.to_thread(batch.read)
        if stored.batch.status in DONE:
            raise InvalidRequest(f"Cannot cancel a batch with status '{stored.batch.status}'.", param="batch_id")
        await asyncio.to_thread(batch.ask_cancel)
        return (await asyncio.to_thread(batch.read)).batch

    async def delete(self, batch_id: str, param: str = "batch_id") -> None:
        """Remove a batch that is done (a 400 while it runs): renamed away first, so that it is gone for
        every reader at once, then removed."""
        batch = self.dir_of(batch_id, param)
        stored = await asyncio.to_thread(batch.read)
        if stored.batch.status not in DONE:
            raise InvalidRequest(f"Batch '{batch_id}' is still being processed: cancel it and delete it once it "
                                 "has ended.", param=param)

        def remove() -> None:
            doomed = self.home / f"{_MAKING}{batch_id}.deleted"
            os.replace(batch.path, doomed)
            shutil.rmtree(doomed, ignore_errors=True)

        await asyncio.to_thread(remove)

    async def page(self, after: str | None, limit: int, before: str | None = None,
                   names: tuple[str, str] = ("after", "before")) -> tuple[list[StoredBatch], bool]:
        """A page of this owner's batches, newest first: those right after the batch `after`, or right
        before the batch `before` (a 400 naming the parameter, `names`, when it is none of this
        owner's), and whether more follow (or precede, with `before`)."""
        stored = await asyncio.to_thread(self._all)
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

    def _all(self) -> list[StoredBatch]:
        if not self.home.is_dir():
            return []
        found = []
        for record in self.home.glob(f"{self.kind}*/record.json"):
            with contextlib.suppress(FileNotFoundError, ValueError):
                if self._is_id(record.parent.name):
                    found.append(BatchDir(record.parent).read())
        return found


LEASE = re.compile(r"lease\.([0-9]+)")


@dataclass(slots=True)
class Lease:
    """A replica's hold on one batch (see the module's docstring)."""

    batch: BatchDir
    holder: str
    generation: int
    lease_s: float

    @classmethod
    def take(cls, batch: BatchDir, holder: str, lease_s: float) -> Lease | None:
        """The batch's lease, when it is free or its holder's has expired; None when another holds it."""
        generation, current = _newest(batch)
        if current is not None and current.get("expires", 0) > time.time():
            return None
        lease = cls(batch, holder, generation + 1, lease_s)
        try:
            fd = os.open(lease.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return None  # another replica took this generation first
        with os.fdopen(fd, "wb") as out:
            out.write(lease._content())
        for older in range(max(1, generation - 1), generation + 1):  # the ones before are gone already
            (batch.path / f"lease.{older}").unlink(missing_ok=True)
        return lease

    @property
    def path(self) -> Path:
        return self.batch.path / f"lease.{self.generation}"

    def _content(self, expires: float | None = None) -> bytes:
        return orjson.dumps({"holder": self.holder, "expires": time.time() + self.lease_s if expires is None else expires})

    def held(self) -> bool:
        """Still this replica's: no other has taken it over (a higher generation)."""
        return _newest(self.batch)[0] == self.generation

    def renew(self) -> bool:
        """Held for another `lease_s`; False when another replica has taken it over meanwhile."""
        if not self.held():
            return False
        _write_atomic(self.path, self._content())
        return True

    def release(self) -> None:
        """Expired at once, so that another replica may take the batch now (a clean shutdown)."""
        if _newest(self.batch)[0] == self.generation:
            _write_atomic(self.path, self._content(expires=0))


def _newest(batch: BatchDir) -> tuple[int, dict[str, float] | None]:
    """The highest lease generation and its content (0, None: never leased)."""
    generations = [int(m.group(1)) for p in batch.path.iterdir() if (m := LEASE.fullmatch(p.name))]
    if not generations:
        return 0, None
    newest = max(generations)
    try:
        content = orjson.loads((batch.path / f"lease.{newest}").read_bytes())
    except (FileNotFoundError, orjson.JSONDecodeError):
        content = {"expires": time.time() + 1}  # being written right now: held
    return newest, content if isinstance(content, dict) else None
