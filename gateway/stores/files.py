"""The Files API's store: each upload's FileObject a record (`stores.batchdb`) under its owner, its content a blob
written once (stored first: a file exists once its record does)."""

from __future__ import annotations

import contextlib
import hashlib
import re
import secrets
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

from gateway.errors import InvalidRequest, NotFound, StoreUnavailable
from gateway.protocol.batch_objects import FileObject, Purpose
from gateway.stores.batchdb import Records
from gateway.stores.blobs import Blobs, Opened, Staged, open_blob

T = TypeVar("T")
ID = re.compile(r"file-[0-9a-f]{24}")


def not_found(file_id: str) -> NotFound:
    return NotFound(f"No such File object: {file_id}", param="file_id")


def page_of(items: list[T], ids: list[str], limit: int, after: str | None, before: str | None = None,
            names: tuple[str, str] = ("after", "before"), missing: str = "No such File object to list") -> tuple[list[T], bool]:
    """The page of `items` (whose ids are `ids`) after `after` or before `before` (a 400 naming `names` when unknown),
    and whether more follow."""
    for cursor, name in ((after, names[0]), (before, names[1])):
        if cursor is not None and cursor not in ids:
            raise InvalidRequest(f"{missing} {name.partition('_')[0]}: {cursor}", param=name)
    if before is not None:
        end = ids.index(before)
        return items[max(0, end - limit) : end], end - limit > 0
    start = 0 if after is None else ids.index(after) + 1
    return items[start : start + limit], start + limit < len(items)


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
        found = await self.store.records.file(self.owner, file_id) if ID.fullmatch(file_id) else None
        if found is not None and found.expires_at is not None and found.expires_at <= time.time():
            await self._remove(file_id)
            found = None
        if found is None:
            raise not_found(file_id)
        return found

    async def open(self, file_id: str) -> tuple[FileObject, Opened]:
        """A delete after this does not cut the read short."""
        found = await self.get(file_id)
        opened = await open_blob(self.store.blobs, file_id)
        if opened is None:  # deleted between the two reads
            raise not_found(file_id)
        return found, opened

    async def delete(self, file_id: str) -> None:
        await self.get(file_id)  # none of this owner's (or expired): 404 before anything is touched
        await self._remove(file_id)

    async def page(self, purpose: str | None, after: str | None, limit: int, descending: bool) -> tuple[list[FileObject], bool]:
        now = time.time()
        files = [f for f in await self.store.records.files(self.owner)
                 if (f.expires_at is None or f.expires_at > now) and purpose in (None, f.purpose)]
        files.sort(key=lambda f: (f.created_at, f.id), reverse=descending)
        return page_of(files, [f.id for f in files], limit, after)

    async def _remove(self, file_id: str) -> None:
        if await self.store.records.remove_file(self.owner, file_id):  # from here on the file is gone for every reader
            await self.store.blobs.delete(file_id)

