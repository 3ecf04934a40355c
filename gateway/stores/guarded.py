"""The one place where the batch lane's store failing becomes the API's 503 (`StoreUnavailable`), never a 500."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import structlog

from gateway.errors import StoreUnavailable
from gateway.stores.blobs import Blobs, BlobsUnavailable, Opened

log = structlog.get_logger(__name__)


@contextlib.contextmanager
def unavailable() -> Iterator[None]:
    try:
        yield
    except (BlobsUnavailable, OSError) as exc:
        log.warning("store_unavailable", error=str(exc), cause=type(exc.__cause__ or exc).__name__)
        raise StoreUnavailable("The batch lane's store (files and batches) is unavailable right now; try again "
                               "later.") from exc


async def _guarded_chunks(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    try:
        with unavailable():
            async for chunk in chunks:
                yield chunk
    finally:
        closing = getattr(chunks, "aclose", None)
        if closing is not None:
            await closing()


@dataclass(slots=True, frozen=True)
class Guarded:
    blobs: Blobs

    async def get(self, name: str) -> bytes | None:
        with unavailable():
            return await self.blobs.get(name)

    async def put(self, name: str, data: bytes) -> None:
        with unavailable():
            await self.blobs.put(name, data)

    async def create(self, name: str, data: bytes) -> bool:
        with unavailable():
            return await self.blobs.create(name, data)

    async def put_file(self, name: str, path: Path) -> int:
        with unavailable():
            return await self.blobs.put_file(name, path)

    async def append(self, name: str, data: bytes) -> None:
        with unavailable():
            await self.blobs.append(name, data)

    async def open(self, name: str, chunk_bytes: int = 256 * 1024) -> Opened | None:
        with unavailable():
            opened = await self.blobs.open(name, chunk_bytes)
        return None if opened is None else Opened(opened.size, _guarded_chunks(opened.chunks))

    @contextlib.asynccontextmanager
    async def local(self, name: str) -> AsyncIterator[Path | None]:
        with unavailable():
            async with self.blobs.local(name) as path:
                yield path

    async def copy(self, source: str, target: str) -> bool:
        with unavailable():
            return await self.blobs.copy(source, target)

    async def delete(self, *names: str) -> None:
        with unavailable():
            await self.blobs.delete(*names)

    async def list(self, prefix: str) -> list[str]:
        with unavailable():
            return await self.blobs.list(prefix)

    async def aclose(self) -> None:
        await self.blobs.aclose()
