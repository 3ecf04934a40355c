"""The batch lane's stores. The Files API's: each upload's FileObject a record (`stores.batchdb`) under its owner, its
content a blob written once (stored first: a file exists once its record does). The Batches API's and Message Batches
API's: each batch a record with its answers and its input, a blob written once when the batch is created. A file or a
batch is reached only through its owner's view (`of`); only the runner reaches a batch by its id alone."""

from __future__ import annotations

import contextlib
import hashlib
import re
import secrets
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass

from gateway.errors import InvalidRequest, NotFound, StoreUnavailable
from gateway.protocol.batch_objects import DONE, WINDOW_S, Batch, FileObject, Owner, Purpose, RequestCounts, StoredBatch
from gateway.protocol.openai import page_of
from gateway.stores.batchdb import Records
from gateway.stores.blobs import Blobs, Opened, Staged, open_blob, put_chunks

FILE_ID = re.compile(r"file-[0-9a-f]{24}")


def file_not_found(file_id: str) -> NotFound:
    return NotFound(f"No such File object: {file_id}", param="file_id")


def derived_id(name: str) -> str:
    """A file id always the same for `name` (a batch's output: rewritten, not duplicated)."""
    return "file-" + hashlib.sha256(name.encode()).hexdigest()[:24]


@dataclass(slots=True, frozen=True)
class Store:
    """One part of the lane (its files, its batches): records and contents."""

    records: Records
    blobs: Blobs

    async def aclose(self) -> None:
        await self.records.aclose()
        await self.blobs.aclose()

    async def recorded(self, name: str, record: Awaitable[None], undo: bool = True) -> None:
        """The content `name`, stored already, recorded by `record`; when that fails, the content removed (`undo`): no
        listing or delete would ever reach it."""
        try:
            await record
        except BaseException:
            if undo:
                with contextlib.suppress(StoreUnavailable):
                    await self.blobs.delete(name)
            raise


class FileStore(Store):
    def of(self, owner: str) -> OwnedFiles:
        return OwnedFiles(self, owner)


@dataclass(slots=True, frozen=True)
class OwnedFiles:
    """One owner's files; another owner's id is a 404 exactly as an unknown one, checked before anything is read or
    deleted."""

    store: Store
    owner: str

    async def stage(self) -> Staged:
        return await Staged.at(self.store.blobs.spool)

    async def put(self, staged: Staged, filename: str, purpose: Purpose, expires_after_s: int,
                  file_id: str | None = None) -> FileObject:
        """Store an upload under a new id (or `file_id`, replaced: a batch's output written again after a restart):
        content first, then its record."""
        await staged.close()
        now = int(time.time())
        stored = FileObject(id=file_id or "file-" + secrets.token_hex(12), bytes=staged.size, created_at=now,
                            filename=filename, purpose=purpose, expires_at=now + expires_after_s)
        await self.store.blobs.put_file(stored.id, staged.path)
        await self.store.recorded(stored.id, self.store.records.add_file(self.owner, stored), undo=file_id is None)
        return stored

    async def get(self, file_id: str) -> FileObject:
        found = await self.store.records.file(self.owner, file_id) if FILE_ID.fullmatch(file_id) else None
        if found is not None and found.expires_at is not None and found.expires_at <= time.time():
            await self._remove(file_id)
            found = None
        if found is None:
            raise file_not_found(file_id)
        return found

    async def open(self, file_id: str) -> tuple[FileObject, Opened]:
        """A delete after this does not cut the read short."""
        found = await self.get(file_id)
        opened = await open_blob(self.store.blobs, file_id)
        if opened is None:  # deleted between the two reads
            raise file_not_found(file_id)
        return found, opened

    async def delete(self, file_id: str) -> None:
        await self.get(file_id)  # none of this owner's (or expired): 404 before anything is touched
        await self._remove(file_id)

    async def page(self, purpose: str | None, after: str | None, limit: int, descending: bool) -> tuple[list[FileObject], bool]:
        now = time.time()
        files = [f for f in await self.store.records.files(self.owner)
                 if (f.expires_at is None or f.expires_at > now) and purpose in (None, f.purpose)]
        files.sort(key=lambda f: (f.created_at, f.id), reverse=descending)
        return page_of(files, [f.id for f in files], limit, after, missing="No such File object to list {}: {}")

    async def _remove(self, file_id: str) -> None:
        if await self.store.records.remove_file(self.owner, file_id):  # from here on the file is gone for every reader
            await self.store.blobs.delete(file_id)


BATCH, MESSAGE_BATCH = "batch_", "msgbatch_"  # the id prefixes of OpenAI's batches and Anthropic's
BATCH_ID = re.compile(r"(?:msg)?batch_[0-9a-f]{32}")


def not_found(batch_id: str, param: str = "batch_id") -> NotFound:
    return NotFound(f"No batch found with id '{batch_id}'.", param=param)


def new_id(kind: str = BATCH) -> str:
    return kind + secrets.token_hex(16)


def input_name(batch_id: str) -> str:
    return f"{batch_id}.input.jsonl"


class BatchStore(Store):
    def of(self, owner: str, kind: str = BATCH) -> OwnedBatches:
        return OwnedBatches(self, owner, kind)


@dataclass(slots=True, frozen=True)
class OwnedBatches:
    store: Store
    owner: str
    kind: str = BATCH

    async def find(self, batch_id: str, param: str = "batch_id") -> StoredBatch:
        ours = batch_id.startswith(self.kind) and BATCH_ID.fullmatch(batch_id) is not None
        stored = await self.store.records.batch(batch_id) if ours else None
        if stored is None or stored.owner.tenant != self.owner:
            raise not_found(batch_id, param)
        return stored

    def new(self, key_id: str, endpoint: str, output_expires_after_s: int, input_file_id: str | None = None,
            metadata: dict[str, str] | None = None, total: int = 0) -> StoredBatch:
        """A new batch of this owner's, `validating`, its input the file `input_file_id` (or its own, by its id)."""
        now, batch_id = int(time.time()), new_id(self.kind)
        batch = Batch(id=batch_id, endpoint=endpoint, input_file_id=input_file_id or batch_id, status="validating",
                      created_at=now, expires_at=now + WINDOW_S, metadata=metadata,
                      request_counts=RequestCounts(total=total))
        return StoredBatch(batch=batch, owner=Owner(key_id=key_id, tenant=self.owner),
                           output_expires_after_s=output_expires_after_s, created_ns=time.time_ns())

    async def create(self, stored: StoredBatch, source: AsyncIterator[bytes] | bytes) -> None:
        """The input first, then the record: a reader sees a whole batch or none."""
        name = input_name(stored.batch.id)
        await put_chunks(self.store.blobs, name, source)
        await self.store.recorded(name, self.store.records.create(stored))

    async def cancel(self, batch_id: str, param: str = "batch_id", ended: str | None = None) -> StoredBatch:
        """Ask for a cancel (the runner holding the batch carries it out); a batch already done is a 400 (message
        `ended` when given)."""
        stored = await self.find(batch_id, param)
        if stored.batch.status in DONE:
            raise InvalidRequest(ended or f"Cannot cancel a batch with status '{stored.batch.status}'.", param=param)
        await self.store.records.ask_cancel(batch_id)
        return await self.find(batch_id, param)

    async def delete(self, batch_id: str, param: str = "batch_id") -> None:
        """Its record first, so it is gone for every reader at once."""
        stored = await self.find(batch_id, param)
        if stored.batch.status not in DONE:
            raise InvalidRequest(f"Batch '{batch_id}' is still being processed: cancel it and delete it once it "
                                 "has ended.", param=param)
        await self.store.records.remove(batch_id)
        await self.store.blobs.delete(input_name(batch_id))

    async def page(self, after: str | None, limit: int, before: str | None = None,
                   names: tuple[str, str] = ("after", "before")) -> tuple[list[StoredBatch], bool]:
        stored = [s for s in await self.store.records.batches(self.owner) if s.batch.id.startswith(self.kind)]
        stored.sort(key=lambda s: (s.batch.created_at, s.created_ns, s.batch.id), reverse=True)
        return page_of(stored, [s.batch.id for s in stored], limit, after, missing="No batch to list {}: {}", before=before,
                       names=names)
