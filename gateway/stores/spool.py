"""The batch lane's local spool: an upload, copy or rewrite is written here before it is handed whole to the store (on
the disk backend, the same disk, so the hand-over is a rename)."""

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
        await self.close()
        with contextlib.suppress(FileNotFoundError):
            await asyncio.to_thread(self.path.unlink)


@dataclass(slots=True, frozen=True)
class Spool:
    directory: Path

    @classmethod
    def at(cls, directory: Path) -> Spool:
        return cls(directory.expanduser())

    async def stage(self, kind: str = "upload") -> Staged:
        def make() -> Staged:
            self.directory.mkdir(parents=True, exist_ok=True)
            return Staged(self.directory / f"{kind}-{secrets.token_hex(16)}")

        with unavailable():
            return await asyncio.to_thread(make)

    async def fill(self, chunks: AsyncIterator[bytes], kind: str = "copy") -> Staged:
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
    file: BinaryIO
    left: int

    def read(self, size: int = -1) -> bytes:
        size = self.left if size < 0 else min(size, self.left)
        data = self.file.read(size)
        self.left -= len(data)
        return data
