"""The batch lane's contents, each written once and whole: an upload, a batch's input, a batch's output and error
files. `Blobs` is either backend: `LocalBlobs` a local directory (the default), `blobs_s3` a bucket. Also the local spool
an upload is received into (`Staged`), and the one place where the lane's stores failing becomes the API's 503.

Both backends answer alike: contents by name, each written once, whole (never appended to); a missing one is never an
error; a backend that fails raises what `unavailable` maps to a 503; nothing blocks the event loop. `spool` is where a
content is staged before `put_file` (the local file `path` as `name`; the file is the store's afterwards: moved or
removed); `local` a local file holding the content for blocking reads (the blob itself on a local directory,
else a temporary copy removed on exit), None when there is none, read only."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import sqlite3
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, ParamSpec, TypeAlias, TypeVar

import structlog

from gateway.errors import StoreUnavailable
from gateway.stores.redis import ERRORS as REDIS_ERRORS

if TYPE_CHECKING:
    from gateway.stores.blobs_s3 import S3Blobs

P = ParamSpec("P")
T = TypeVar("T")
log = structlog.get_logger(__name__)
CHUNK_BYTES = 256 * 1024
_TEMPORARY = ".tmp-"  # a name being written: never read as a blob
Blobs: TypeAlias = "LocalBlobs | S3Blobs"


@contextlib.contextmanager
def unavailable(*also: type[Exception]) -> Iterator[None]:
    """A store that failed (its database, Redis, the disk; S3's errors as `also`) as the API's 503
    (`StoreUnavailable`), never a 500."""
    failed: tuple[type[Exception], ...] = (sqlite3.Error, *REDIS_ERRORS, *also)
    try:
        yield
    except failed as exc:
        log.warning("store_unavailable", error=str(exc), cause=type(exc.__cause__ or exc).__name__)
        raise StoreUnavailable("The batch lane's store (files and batches) is unavailable right now; try again "
                               "later.") from exc


async def _io(call: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """A blocking call of the disk, in a worker thread; its failure the API's 503."""
    with unavailable():
        return await asyncio.to_thread(call, *args, **kwargs)


@dataclass(slots=True)
class Opened:
    """A blob's content opened for reading: fixed once open (a delete meanwhile does not cut it short)."""

    size: int
    chunks: AsyncGenerator[bytes, None]

    @classmethod
    async def of(cls, path: Path) -> Opened:
        """The local file `path` opened: still readable once it is removed."""
        file = await _io(path.open, "rb")
        return cls(os.fstat(file.fileno()).st_size, read_chunks(file))


async def read_chunks(file: BinaryIO, chunk_bytes: int = CHUNK_BYTES) -> AsyncGenerator[bytes, None]:
    try:
        while True:
            chunk = await _io(file.read, chunk_bytes)
            if not chunk:
                return
            yield chunk
    finally:
        await asyncio.to_thread(file.close)


class Staged:
    """A local file being written (an upload as it arrives, an output file as it is assembled), handed whole to
    `Blobs.put_file` or discarded."""

    def __init__(self, directory: Path, kind: str = "upload") -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{_TEMPORARY}{kind}-{secrets.token_hex(16)}"
        self.size = 0
        self._file: BinaryIO | None = self.path.open("xb")

    @classmethod
    async def at(cls, directory: Path, kind: str = "upload") -> Staged:
        return await _io(cls, directory, kind)

    async def write(self, data: bytes) -> None:
        assert self._file is not None
        self.size += len(data)
        await _io(self._file.write, data)

    async def close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            await _io(file.close)

    async def discard(self) -> None:
        await self.close()
        await asyncio.to_thread(self.path.unlink, missing_ok=True)


async def put_chunks(blobs: Blobs, name: str, chunks: AsyncIterator[bytes] | bytes) -> None:
    """The chunks (or bytes) staged in a local file, then written once as `name`."""
    staged = await Staged.at(blobs.spool, "copy")
    try:
        if isinstance(chunks, bytes):
            await staged.write(chunks)
        else:
            async for chunk in chunks:
                await staged.write(chunk)
        await staged.close()
        await blobs.put_file(name, staged.path)
    finally:
        await staged.discard()


async def open_blob(blobs: Blobs, name: str) -> Opened | None:
    """The content `name` opened (None when there is none): still readable once deleted, or once its local copy is."""
    async with blobs.local(name) as path:
        return None if path is None else await Opened.of(path)


def check_name(name: str) -> str:
    if not name or not all(c.isalnum() or c in "._-" for c in name) or name.startswith("."):
        raise ValueError(f"not a blob name: {name!r}")
    return name


@dataclass(slots=True, frozen=True)
class LocalBlobs:
    """Contents as files of one directory (a shared volume for replicas): a file staged in its spool, renamed in."""

    root: Path

    @property
    def spool(self) -> Path:
        return self.root / ".spool"

    def _path(self, name: str) -> Path:
        return self.root / check_name(name)

    async def put_file(self, name: str, path: Path) -> None:
        target = self._path(name)

        def move() -> None:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                with open(path, "rb") as written:
                    os.fsync(written.fileno())
                os.replace(path, target)  # staged in the spool, on the same disk: a rename
            finally:
                path.unlink(missing_ok=True)

        await _io(move)

    @contextlib.asynccontextmanager
    async def local(self, name: str) -> AsyncIterator[Path | None]:
        path = self._path(name)
        yield path if await _io(path.is_file) else None

    async def delete(self, *names: str) -> None:
        paths = [self._path(name) for name in names]

        def remove() -> None:
            for path in paths:
                path.unlink(missing_ok=True)

        await _io(remove)

    async def aclose(self) -> None:
        pass
