"""The batch lane's local spool: files on this machine's disk that an upload, a copy between the two
stores or a rewrite is written to before it is handed to the store whole (`Blobs.put_file`). It is
local for every backend (`files.dir/.spool` and `batches.dir/.spool`: for the disk backend the same
disk as the store, so handing a file over is a rename), and what is in it is never read by another
process: a file left by a crash is only litter.

A disk that fails here is the store being unavailable (`StoreUnavailable`, `stores.guarded`)."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from gateway.stores.guarded import unavailable


class Staged:
    """A file being received in the spool: written chunk by chunk, then handed to a store (which
    takes it: nothing is left under its name) or discarded."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.size = 0
        self._file: BinaryIO | None = path.open("xb")

    async def write(self, data: bytes) -> None:
        assert self._file is not None
        self.size += len(data)
        with unavailable():
            await asyncio.to_thread(self._file.write, data)

    async def close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            with unavailable():
                await asyncio.to_thread(file.close)

    async def discard(self) -> None:
        """Remove it, unless a store took it (then there is nothing left under its name)."""
        await self.close()
        with contextlib.suppress(FileNotFoundError):
            await asyncio.to_thread(self.path.unlink)


@dataclass(slots=True, frozen=True)
class Spool:
    """A local directory of staged files (made when first needed)."""

    directory: Path

    @classmethod
    def at(cls, directory: Path) -> Spool:
        return cls(directory.expanduser())

    async def stage(self, kind: str = "upload") -> Staged:
        """A new, empty staged file."""
        def make() -> Staged:
            self.directory.mkdir(parents=True, exist_ok=True)
            return Staged(self.directory / f"{kind}-{secrets.token_hex(16)}")

        with unavailable():
            return await asyncio.to_thread(make)

    async def fill(self, chunks: AsyncIterator[bytes], kind: str = "copy") -> Staged:
        """A staged file holding these chunks, closed (discarded if they fail)."""
        staged = await self.stage(kind)
        try:
            async for chunk in chunks:
                await staged.write(chunk)
            await staged.close()
        except BaseException:
            await staged.discard()
            raise
        return staged

    async def head(self, path: Path, size: int) -> Staged:
        """A staged file holding the first `size` bytes of the local file `path`, closed."""
        staged = await self.stage("head")
        await staged.close()

        def copy() -> None:
            with path.open("rb") as source, staged.path.open("wb") as target:
                shutil.copyfileobj(_Limited(source, size), target)

        try:
            with unavailable():
                await asyncio.to_thread(copy)
        except BaseException:
            await staged.discard()
            raise
        staged.size = size
        return staged


@dataclass(slots=True)
class _Limited:
    """A file read no further than `left` bytes."""

    file: BinaryIO
    left: int

    def read(self, size: int = -1) -> bytes:
        size = self.left if size < 0 else min(size, self.left)
        data = self.file.read(size)
        self.left -= len(data)
        return data
