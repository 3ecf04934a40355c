"""The batch lane's stores on local disk for unit tests (as the app builds them with the default
`store.backend`), and a batch's objects reached by its id alone, as a test that plays another
replica, or a crash, needs them; and a store that can be taken down (`Flaky`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from gateway.stores.batches import BatchObjects, BatchStore
from gateway.stores.blobs import Blobs, BlobsUnavailable, DiskBlobs, Opened
from gateway.stores.files import FileStore
from gateway.stores.spool import Spool


def disk_files(directory: Path) -> FileStore:
    return FileStore.on(DiskBlobs.at(directory), Spool.at(directory / ".spool"))


def disk_batches(directory: Path) -> BatchStore:
    return BatchStore.on(DiskBlobs.at(directory), Spool.at(directory / ".spool"))


def batch_in(directory: Path, batch_id: str) -> BatchObjects:
    """The objects of the batch `batch_id`, whoever its owner (a test's view, never the API's)."""
    store = disk_batches(directory)
    [record] = [n for n in asyncio.run(store.blobs.list("")) if n.endswith(f"/{batch_id}/record.json")]
    return BatchObjects(store.blobs, store.spool, record.partition("/")[0], batch_id)


def read(batch: BatchObjects, part: str) -> bytes | None:
    """One of a batch's objects, whole (None: there is none)."""
    return asyncio.run(batch.blobs.get(batch.name(part)))


class Flaky:
    """A store that is down while `down` is set: every call raises `BlobsUnavailable`, as a backend
    does when its server is unreachable; up, it is the `DiskBlobs` it wraps. `calls` records each
    call's name and first argument (what a test may check was asked, or not), and `refused` counts the
calls refused while down."""

    def __init__(self, blobs: Blobs) -> None:
        self.blobs = blobs
        self.down = False
        self.calls: list[tuple[str, str]] = []
        self.refused = 0  # calls refused while down

    def _call(self, method: str, name: str) -> None:
        self.calls.append((method, name))
        if self.down:
            self.refused += 1
            raise BlobsUnavailable("connection refused (a test's store is down)")

    async def get(self, name: str) -> bytes | None:
        self._call("get", name)
        return await self.blobs.get(name)

    async def put(self, name: str, data: bytes) -> None:
        self._call("put", name)
        await self.blobs.put(name, data)

    async def create(self, name: str, data: bytes) -> bool:
        self._call("create", name)
        return await self.blobs.create(name, data)

    async def put_file(self, name: str, path: Path) -> int:
        self._call("put_file", name)
        return await self.blobs.put_file(name, path)

    async def append(self, name: str, data: bytes) -> None:
        self._call("append", name)
        await self.blobs.append(name, data)

    async def open(self, name: str, chunk_bytes: int = 256 * 1024) -> Opened | None:
        self._call("open", name)
        return await self.blobs.open(name, chunk_bytes)

    @contextlib.asynccontextmanager
    async def local(self, name: str) -> AsyncIterator[Path | None]:
        self._call("local", name)
        async with self.blobs.local(name) as path:
            yield path

    async def copy(self, source: str, target: str) -> bool:
        self._call("copy", source)
        return await self.blobs.copy(source, target)

    async def delete(self, *names: str) -> None:
        self._call("delete", ",".join(names))
        await self.blobs.delete(*names)

    async def list(self, prefix: str) -> list[str]:
        self._call("list", prefix)
        return await self.blobs.list(prefix)

    async def aclose(self) -> None:
        await self.blobs.aclose()
