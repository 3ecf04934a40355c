"""The Files API's store: uploaded files on local disk (`files.dir`), each tenant's in a directory of
its own, named by a hash of the tenant (never the tenant itself, which may hold any character):

    <dir>/<sha256(owner)[:32]>/file-<24 hex>        the content, as uploaded
    <dir>/<sha256(owner)[:32]>/file-<24 hex>.json   its FileObject; a file exists once this does
    <dir>/<sha256(owner)[:32]>/.upload-<hex>        an upload being received (same disk: renamed in place)

Every file has an owner (the tenant of the key that uploaded it) and is reached only through its
owner's view (`FileStore.of`): another owner's id is a 404 exactly as an unknown one, and nothing is
read or deleted before that check. An id is checked to be an id (`file-` and 24 lowercase hex)
before any path is built from it, so no id names a path outside its owner's directory.

Writes are atomic: the content and then its metadata are each written to a temporary name and
renamed, so a reader sees a whole file or none. Deleting removes the metadata first (the file is
gone for every reader from then on), then the content. An expired file (`expires_at` passed) is
gone: removed when next asked for or listed. Blocking disk calls run in a worker thread.
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
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from gateway.errors import InvalidRequest, NotFound
from gateway.protocol.files import FileObject, Purpose

ID = re.compile(r"file-[0-9a-f]{24}")
_UPLOAD_PREFIX = ".upload-"


def not_found(file_id: str) -> NotFound:
    return NotFound(f"No such File object: {file_id}", param="file_id")


def _new_id() -> str:
    return "file-" + secrets.token_hex(12)


def derived_id(name: str) -> str:
    """A file id that is always the same for `name` (a batch's output: written again, not twice)."""
    return "file-" + hashlib.sha256(name.encode()).hexdigest()[:24]


class Staged:
    """An upload being received: a temporary file in its owner's directory, written chunk by chunk
    and either stored (`OwnedFiles.put`: renamed to its id) or discarded."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.size = 0
        self._file: BinaryIO | None = path.open("xb")

    async def write(self, data: bytes) -> None:
        assert self._file is not None
        self.size += len(data)
        await asyncio.to_thread(self._file.write, data)

    async def close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            await asyncio.to_thread(file.close)

    async def discard(self) -> None:
        """Remove it, unless it was stored (then there is nothing left under its temporary name)."""
        await self.close()
        with contextlib.suppress(FileNotFoundError):
            await asyncio.to_thread(self.path.unlink)


@dataclass(slots=True, frozen=True)
class FileStore:
    """Every stored file has an owner, and the only way to one is through its owner's view (`of`)."""

    root: Path

    @classmethod
    def at(cls, directory: Path) -> FileStore:
        return cls(directory.expanduser())

    def of(self, owner: str) -> OwnedFiles:
        return OwnedFiles(self.root / hashlib.sha256(owner.encode()).hexdigest()[:32])


@dataclass(slots=True, frozen=True)
class OwnedFiles:
    """One owner's files: its directory, and every operation on what is in it."""

    home: Path

    def _paths(self, file_id: str) -> tuple[Path, Path]:
        """The content's and the metadata's paths of an id (404 for anything that is not one of ours)."""
        if not ID.fullmatch(file_id):
            raise not_found(file_id)
        return self.home / file_id, self.home / f"{file_id}.json"

    async def stage(self) -> Staged:
        """A new upload's temporary file (the owner's directory made when it is first needed)."""
        def make() -> Staged:
            self.home.mkdir(parents=True, exist_ok=True)
            return Staged(self.home / f"{_UPLOAD_PREFIX}{secrets.token_hex(16)}")

        return await asyncio.to_thread(make)

    async def put(
        self, staged: Staged, filename: str, purpose: Purpose, expires_after_s: int, file_id: str | None = None,
    ) -> FileObject:
        """Store an upload under a new id (or `file_id`, replaced when it exists: a batch's output
        written again after a restart): its content renamed into place, then its metadata written."""
        await staged.close()
        now = int(time.time())
        stored = FileObject(id=file_id or _new_id(), bytes=staged.size, created_at=now, filename=filename,
                            purpose=purpose, expires_at=now + expires_after_s)
        content, meta = self._paths(stored.id)

        def write() -> None:
            os.replace(staged.path, content)
            temporary = self.home / f"{_UPLOAD_PREFIX}{stored.id}.json"
            temporary.write_bytes(stored.model_dump_json().encode())
            os.replace(temporary, meta)

        await asyncio.to_thread(write)
        return stored

    async def publish(self, source: Path, filename: str, file_id: str, expires_after_s: int) -> FileObject:
        """A copy of `source` stored as the file `file_id` of purpose `batch_output` (a batch's output)."""
        staged = await self.stage()
        try:
            await staged.close()
            await asyncio.to_thread(shutil.copyfile, source, staged.path)
            staged.size = await asyncio.to_thread(lambda: staged.path.stat().st_size)
            return await self.put(staged, filename, "batch_output", expires_after_s, file_id)
        finally:
            await staged.discard()

    async def get(self, file_id: str) -> FileObject:
        content, meta = self._paths(file_id)
        found = await asyncio.to_thread(self._read, content, meta)
        if found is None:
            raise not_found(file_id)
        return found

    async def open(self, file_id: str) -> tuple[FileObject, BinaryIO]:
        """A file's object and its content, opened: a delete after this does not cut the read short."""
        content, meta = self._paths(file_id)

        def opened() -> tuple[FileObject, BinaryIO] | None:
            found = self._read(content, meta)
            if found is None:
                return None
            try:
                return found, content.open("rb")
            except FileNotFoundError:  # deleted between the two reads
                return None

        result = await asyncio.to_thread(opened)
        if result is None:
            raise not_found(file_id)
        return result

    async def content_of(self, file_id: str) -> tuple[FileObject, Path]:
        """A file's object and where its content is (a batch links it; it may be deleted meanwhile)."""
        found = await self.get(file_id)
        return found, self._paths(file_id)[0]

    async def delete(self, file_id: str) -> None:
        content, meta = self._paths(file_id)
        await self.get(file_id)  # none of this owner's (or expired): 404 before anything is touched
        try:
            await asyncio.to_thread(self._remove, content, meta)
        except FileNotFoundError:  # deleted meanwhile by another request
            raise not_found(file_id) from None

    async def page(self, purpose: str | None, after: str | None, limit: int, descending: bool) -> tuple[list[FileObject], bool]:
        """A page of this owner's files (oldest first, or newest first when `descending`) after the
        file `after` (a 400 naming `after` when it is none of this owner's), and whether more follow."""
        files = await asyncio.to_thread(self._all)
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

    def _all(self) -> list[FileObject]:
        if not self.home.is_dir():
            return []
        found = (self._read(self.home / p.stem, p) for p in self.home.glob("file-*.json") if ID.fullmatch(p.stem))
        return [f for f in found if f is not None]

    def _read(self, content: Path, meta: Path) -> FileObject | None:
        """The metadata of a file that exists and has not expired (an expired one is removed)."""
        try:
            found = FileObject.model_validate_json(meta.read_bytes())
        except FileNotFoundError:
            return None
        if found.expires_at is not None and found.expires_at <= time.time():
            with contextlib.suppress(FileNotFoundError):
                self._remove(content, meta)
            return None
        return found

    @staticmethod
    def _remove(content: Path, meta: Path) -> None:
        meta.unlink()  # from here on the file is gone for every reader
        content.unlink(missing_ok=True)
