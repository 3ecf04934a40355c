"""The Files API's store: each upload's content and its FileObject (written last: a file exists once it does) under
its owner's hashed prefix of a `Blobs` store."""

from __future__ import annotations

import contextlib
import hashlib
import re
import secrets
import time
from dataclasses import dataclass

import structlog
from pydantic import ValidationError

from gateway.errors import InvalidRequest, NotFound, StoreUnavailable
from gateway.protocol.file_objects import FileObject, Purpose
from gateway.stores.blobs import Blobs, Opened, each
from gateway.stores.guarded import Guarded
from gateway.stores.spool import Spool, Staged

log = structlog.get_logger(__name__)

ID = re.compile(r"file-[0-9a-f]{24}")
_META = ".json"


def not_found(file_id: str) -> NotFound:
    return NotFound(f"No such File object: {file_id}", param="file_id")


def _new_id() -> str:
    return "file-" + secrets.token_hex(12)


def derived_id(name: str) -> str:
    """A file id always the same for `name` (a batch's output: rewritten, not duplicated)."""
    return "file-" + hashlib.sha256(name.encode()).hexdigest()[:24]


def owner_prefix(owner: str) -> str:
    """The name segment of an owner's objects: a hash, as an owner may hold any character."""
    return hashlib.sha256(owner.encode()).hexdigest()[:32]


@dataclass(slots=True, frozen=True)
class FileStore:
    blobs: Blobs
    spool: Spool

    @classmethod
    def on(cls, blobs: Blobs, spool: Spool) -> FileStore:
        return cls(Guarded(blobs), spool)

    def of(self, owner: str) -> OwnedFiles:
        return OwnedFiles(self.blobs, self.spool, owner_prefix(owner))

    async def aclose(self) -> None:
        await self.blobs.aclose()


@dataclass(slots=True, frozen=True)
class OwnedFiles:
    """One owner's files; another owner's id is a 404 exactly as an unknown one, checked before anything is read or
    deleted."""

    blobs: Blobs
    spool: Spool
    home: str

    def _names(self, file_id: str) -> tuple[str, str]:
        if not ID.fullmatch(file_id):
            raise not_found(file_id)
        return f"{self.home}/{file_id}", f"{self.home}/{file_id}{_META}"

    async def stage(self) -> Staged:
        return await self.spool.stage()

    async def put(
        self, staged: Staged, filename: str, purpose: Purpose, expires_after_s: int, file_id: str | None = None,
    ) -> FileObject:
        """Store an upload under a new id (or `file_id`, replaced: a batch's output written again after a restart):
        content first, then metadata."""
        await staged.close()
        now = int(time.time())
        stored = FileObject(id=file_id or _new_id(), bytes=staged.size, created_at=now, filename=filename,
                            purpose=purpose, expires_at=now + expires_after_s)
        content, meta = self._names(stored.id)
        await self.blobs.put_file(content, staged.path)
        try:
            await self.blobs.put(meta, stored.model_dump_json().encode())
        except BaseException:
            if file_id is None:  # a new id's content, which no listing or delete would ever reach
                with contextlib.suppress(StoreUnavailable):
                    await self.blobs.delete(content)
            raise
        return stored

    async def publish(self, source: Opened, filename: str, file_id: str, expires_after_s: int) -> FileObject:
        staged = await self.spool.fill(source.chunks, "publish")
        try:
            return await self.put(staged, filename, "batch_output", expires_after_s, file_id)
        finally:
            await staged.discard()

    async def get(self, file_id: str) -> FileObject:
        content, meta = self._names(file_id)
        found = await self._read(content, meta)
        if found is None:
            raise not_found(file_id)
        return found

    async def open(self, file_id: str) -> tuple[FileObject, Opened]:
        """A delete after this does not cut the read short."""
        content, _ = self._names(file_id)
        found = await self.get(file_id)
        opened = await self.blobs.open(content)
        if opened is None:  # deleted between the two reads
            raise not_found(file_id)
        return found, opened

    async def delete(self, file_id: str) -> None:
        content, meta = self._names(file_id)
        await self.get(file_id)  # none of this owner's (or expired): 404 before anything is touched
        await self._remove(content, meta)

    async def page(self, purpose: str | None, after: str | None, limit: int, descending: bool) -> tuple[list[FileObject], bool]:
        files = await self._all()
        files.sort(key=lambda f: (f.created_at, f.id), reverse=descending)
        if purpose is not None:
            files = [f for f in files if f.purpose == purpose]
        start = 0
        if after is not None:
            ids = [f.id for f in files]
            if after not in ids:
                raise InvalidRequest(f"No such File object to list after: {after}", param="after")
            start = ids.index(after) + 1
        return files[start : start + limit], start + limit < len(files)

    async def _all(self) -> list[FileObject]:
        names = await self.blobs.list(f"{self.home}/")
        ids = sorted(n[len(self.home) + 1 : -len(_META)] for n in names if n.endswith(_META))
        found = await each([i for i in ids if ID.fullmatch(i)], lambda i: self._read(*self._names(i)))
        return [f for f in found if f is not None]

    async def _read(self, content: str, meta: str) -> FileObject | None:
        raw = await self.blobs.get(meta)
        if raw is None:
            return None
        try:
            found = FileObject.model_validate_json(raw)
        except ValidationError as exc:  # a disk that corrupted it, a hand edit: that file alone is gone
            log.warning("file_record_unreadable", name=meta, errors=exc.error_count())
            return None
        if found.expires_at is not None and found.expires_at <= time.time():
            await self._remove(content, meta)
            return None
        return found

    async def _remove(self, content: str, meta: str) -> None:
        await self.blobs.delete(meta)  # from here on the file is gone for every reader
        await self.blobs.delete(content)
