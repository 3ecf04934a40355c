"""The `Blobs` interface of the batch lane's durable store (files, batches, progress, leases) and its disk backend;
Redis and S3 backends live beside it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol, TypeVar

SEGMENT = re.compile(r"[A-Za-z0-9._-]+")
_TEMPORARY = ".tmp-"  # disk: a name being written (never listed)
T = TypeVar("T")


class _Missing(Exception): ...


class BlobsUnavailable(Exception): ...


async def _thread(work: Callable[[], T]) -> T:
    try:
        return await asyncio.to_thread(work)
    except OSError as exc:
        raise BlobsUnavailable(f"the disk store failed: {exc}") from exc


READS_AT_ONCE = 16  # objects a store reads at once for one request (a listing): a bound on connections


async def each(names: Iterable[str], read: Callable[[str], Awaitable[T]], at_once: int = READS_AT_ONCE) -> list[T]:
    """`read` of every name, in order, at most `at_once` at a time, so a long listing takes a few of the backend's
    connections, not one each."""
    bound = asyncio.Semaphore(at_once)

    async def one(name: str) -> T:
        async with bound:
            return await read(name)

    return list(await asyncio.gather(*(one(name) for name in names)))


def _once_more(write: Callable[[], T]) -> Callable[[], T]:
    """A disk write tried again once when a delete removed a folder on its way right then."""
    def again() -> T:
        try:
            return write()
        except FileNotFoundError:
            return write()

    return again


def _durable(out: BinaryIO, data: bytes) -> None:
    out.write(data)
    out.flush()
    os.fsync(out.fileno())


def check_name(name: str) -> str:
    """`name` when it is `/`-separated segments of `[A-Za-z0-9._-]` (never `.` or `..`); else ValueError."""
    parts = name.split("/")
    if not all(SEGMENT.fullmatch(p) and p not in (".", "..") and not p.startswith(_TEMPORARY) for p in parts):
        raise ValueError(f"not an object name: {name!r}")
    return name


@dataclass(slots=True)
class Opened:
    size: int
    chunks: AsyncIterator[bytes]

    async def aclose(self) -> None:
        closing = getattr(self.chunks, "aclose", None)
        if closing is not None:
            await closing()


class Blobs(Protocol):
    """Named objects. Every backend guarantees (tests/unit/test_blobs.py checks each): `put`/`put_file` replace whole,
    never a part; `create` is exclusive across replicas; `append` is kept once it returns (one writer per object:
    the lease holder); `open`/`local` content is fixed when they return; `list` scans only below the prefix;
    nothing blocks the event loop; an unreachable backend raises `BlobsUnavailable`, a missing object is never an
    error."""

    async def get(self, name: str) -> bytes | None: ...
    async def put(self, name: str, data: bytes) -> None: ...

    async def create(self, name: str, data: bytes) -> bool:
        """`data` as `name` only if there is none: True when made."""

    async def put_file(self, name: str, path: Path) -> int:
        """The local file `path` as `name`; its size. The file is the store's afterwards (moved or removed)."""

    async def append(self, name: str, data: bytes) -> None: ...
    async def open(self, name: str, chunk_bytes: int = 256 * 1024) -> Opened | None: ...

    def local(self, name: str) -> contextlib.AbstractAsyncContextManager[Path | None]:
        """A local file holding the object's content for blocking reads (the object itself on disk, else a temporary
        copy removed on exit); None when there is none. Read only."""

    async def copy(self, source: str, target: str) -> bool:
        ...

    async def delete(self, *names: str) -> None: ...

    async def list(self, prefix: str) -> list[str]:
        ...

    async def aclose(self) -> None: ...


@dataclass(slots=True, frozen=True)
class DiskBlobs:
    """Objects as files below a directory (a shared volume for replicas): writes go to a temporary name renamed in
    place; `create` is O_CREAT|O_EXCL; appends are fsynced. A folder a delete empties is removed."""

    root: Path

    @classmethod
    def at(cls, directory: Path) -> DiskBlobs:
        return cls(directory.expanduser())

    def _path(self, name: str) -> Path:
        return self.root / check_name(name)

    def _temporary(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        return path.with_name(f"{_TEMPORARY}{secrets.token_hex(8)}-{path.name}")

    @contextlib.contextmanager
    def _replacing(self, path: Path) -> Iterator[Path]:
        """A temporary name beside `path`, renamed onto it once written; removed when the write fails (it is never
        listed, so nothing else would)."""
        temporary = self._temporary(path)
        try:
            yield temporary
            os.replace(temporary, path)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise

    async def get(self, name: str) -> bytes | None:
        path = self._path(name)

        def read() -> bytes | None:
            try:
                return path.read_bytes()
            except (FileNotFoundError, NotADirectoryError):
                return None

        return await _thread(read)

    async def put(self, name: str, data: bytes) -> None:
        path = self._path(name)

        def write() -> None:
            with self._replacing(path) as temporary, temporary.open("wb") as out:
                _durable(out, data)

        await _thread(_once_more(write))

    async def create(self, name: str, data: bytes) -> bool:
        path = self._path(name)

        def make() -> bool:
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary = self._temporary(path)
            try:
                with temporary.open("wb") as out:
                    _durable(out, data)
                os.link(temporary, path)  # fails when `path` exists: whole content or nothing, exclusively
                return True
            except FileExistsError:
                return False
            finally:
                temporary.unlink(missing_ok=True)

        return await _thread(_once_more(make))

    async def put_file(self, name: str, path: Path) -> int:
        target = self._path(name)

        def move() -> int:
            target.parent.mkdir(parents=True, exist_ok=True)
            size = path.stat().st_size
            try:
                os.replace(path, target)  # the same disk: a rename
            except OSError:  # another disk: copied to a temporary name beside the target, renamed
                with self._replacing(target) as temporary:
                    shutil.copyfile(path, temporary)
                path.unlink(missing_ok=True)
            return size

        return await _thread(_once_more(move))

    async def append(self, name: str, data: bytes) -> None:
        path = self._path(name)

        def add() -> None:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("ab") as out:
                _durable(out, data)

        await _thread(_once_more(add))

    async def open(self, name: str, chunk_bytes: int = 256 * 1024) -> Opened | None:
        path = self._path(name)

        def opened() -> tuple[int, BinaryIO] | None:
            try:
                file = path.open("rb")
            except (FileNotFoundError, NotADirectoryError):
                return None
            return os.fstat(file.fileno()).st_size, file

        found = await _thread(opened)
        if found is None:
            return None
        size, file = found
        return Opened(size, _read_chunks(file, chunk_bytes))

    @contextlib.asynccontextmanager
    async def local(self, name: str) -> AsyncIterator[Path | None]:
        path = self._path(name)
        yield path if await _thread(path.is_file) else None

    async def copy(self, source: str, target: str) -> bool:
        source_path, target_path = self._path(source), self._path(target)

        def link() -> bool:
            with self._replacing(target_path) as temporary:
                try:
                    os.link(source_path, temporary)  # the same inode: a delete of the source keeps it
                except FileNotFoundError:
                    raise _Missing from None
                except OSError:
                    try:
                        shutil.copyfile(source_path, temporary)
                    except FileNotFoundError:
                        raise _Missing from None
            return True

        with contextlib.suppress(_Missing):
            return await _thread(link)
        return False

    async def delete(self, *names: str) -> None:
        paths = [self._path(name) for name in names]

        def remove() -> None:
            for path in paths:
                with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                    path.unlink()
            for folder in {path.parent for path in paths if path.parent.parent != self.root and path.parent != self.root}:
                with contextlib.suppress(OSError):  # not empty (or gone): kept
                    folder.rmdir()

        await _thread(remove)

    async def list(self, prefix: str) -> list[str]:
        directory = prefix.rpartition("/")[0]
        base = self.root / check_name(directory) if directory else self.root

        def walk() -> list[str]:
            names = []
            for top, dirs, files in os.walk(base):
                relative = Path(top).relative_to(self.root)
                dirs[:] = [d for d in dirs if not d.startswith(_TEMPORARY)]
                for file in files:
                    name = (relative / file).as_posix()
                    if not file.startswith(_TEMPORARY) and name.startswith(prefix):
                        names.append(name)
            return names

        return await _thread(walk)

    async def aclose(self) -> None:
        pass


async def _read_chunks(file: BinaryIO, chunk_bytes: int) -> AsyncIterator[bytes]:
    try:
        while chunk := await _thread(lambda: file.read(chunk_bytes)):
            yield chunk
    finally:
        await asyncio.to_thread(file.close)
