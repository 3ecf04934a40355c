"""The batch lane's `Blobs` store in Redis: objects as strings under `<base>o:<name>`, one sorted set `<base>index` of
every name (a prefix listing is a ZRANGEBYLEX), uploads and snapshots under expiring `<base>tmp:` keys."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import secrets
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import IO, Any, BinaryIO, TypeVar, cast

import structlog

from gateway.stores.blobs import BlobsUnavailable, Opened, _read_chunks, check_name
from gateway.stores.redis import ERRORS, Client

T = TypeVar("T")
log = structlog.get_logger(__name__)

WRITE_CHUNK_BYTES = 1024 * 1024  # put_file: the most of a local file held at once
TEMPORARY_TTL_MS = 10 * 60 * 1000  # an upload or snapshot left behind expires this long after its last chunk
CONNECTIONS = 24  # calls in flight at once, each part: the pool (100) is shared with the cache and the limits
TEMPORARY_FILE = "llm-gateway-blob-"  # local temporary files' prefix (downloads)

_OPEN = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
local size = redis.call('STRLEN', KEYS[1])
if size <= tonumber(ARGV[1]) then return {size, redis.call('GET', KEYS[1])} end
redis.call('COPY', KEYS[1], KEYS[2])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return {size}
"""
_COPY = """
if redis.call('COPY', KEYS[1], KEYS[2], 'REPLACE') == 0 then return 0 end
redis.call('ZADD', KEYS[3], 0, ARGV[1])
return 1
"""
_MOVE_IN = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('RENAME', KEYS[1], KEYS[2])
redis.call('PERSIST', KEYS[2])
redis.call('ZADD', KEYS[3], 0, ARGV[1])
return 1
"""


class RedisBlobs:
    """Every write changes the object and the index together (MULTI or a Lua script). `put_file` streams APPENDs into
    a temporary key renamed at the end; `open`/`local` copy a large object to an expiring snapshot (COPY) read with
    GETRANGE, so Redis holds a copy only at its own speed, never a slow client's. At most `CONNECTIONS` calls in
    flight per part, leaving the shared pool to the cache and limits."""

    def __init__(self, client: Client, base: str) -> None:
        self._client, self._base = client, base
        self._redis = client.redis
        self._index = f"{base}index"
        self._open, self._copy, self._move_in = (self._redis.register_script(s) for s in (_OPEN, _COPY, _MOVE_IN))
        self._durability_checked = False
        self._connections = asyncio.Semaphore(CONNECTIONS)

    def _key(self, name: str) -> str:
        return f"{self._base}o:{check_name(name)}"

    def _temporary(self) -> str:
        return f"{self._base}tmp:{secrets.token_hex(12)}"

    async def _call(self, call: Awaitable[T]) -> T:
        """`call` once a connection is free, wait and call bounded by the store's timeout; a Redis down or slow:
        BlobsUnavailable."""
        try:
            result = await self._client.bounded(self._in_turn(call))
        except ERRORS as exc:
            raise BlobsUnavailable(f"the store's Redis is unavailable: {exc}") from exc
        if not self._durability_checked:
            self._durability_checked = True
            await self._check_durability()
        return result

    async def _in_turn(self, call: Awaitable[T]) -> T:
        try:
            await self._connections.acquire()
        except BaseException:  # given up waiting: the call never made
            if inspect.iscoroutine(call):
                call.close()
            raise
        try:
            return await call
        finally:
            self._connections.release()

    async def _check_durability(self) -> None:
        """A warning, once, when Redis would lose the store: no AOF, or an evicting memory policy."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.execute_command("INFO", "persistence")
        pipe.execute_command("INFO", "memory")
        with contextlib.suppress(*ERRORS):  # INFO may be refused (a managed Redis): no warning then
            persistence, memory = await self._client.bounded(pipe.execute())
            if not persistence.get("aof_enabled"):
                log.warning("store_redis_not_durable", advice="run Redis with appendonly yes (AOF)")
            if memory.get("maxmemory_policy", "noeviction") != "noeviction":
                log.warning("store_redis_evicts", maxmemory_policy=memory["maxmemory_policy"],
                            advice="give the store a Redis with maxmemory-policy noeviction")

    async def _transaction(self, *commands: tuple[Any, ...]) -> list[Any]:
        pipe = self._redis.pipeline(transaction=True)
        for command in commands:
            pipe.execute_command(*command)
        return list(await self._call(pipe.execute()))

    async def get(self, name: str) -> bytes | None:
        return cast(bytes | None, await self._call(self._redis.get(self._key(name))))

    async def put(self, name: str, data: bytes) -> None:
        await self._transaction(("SET", self._key(name), data), ("ZADD", self._index, 0, name))

    async def create(self, name: str, data: bytes) -> bool:
        # indexed either way: when SET NX fails the object exists, so the name belongs in the index
        made, _ = await self._transaction(("SET", self._key(name), data, "NX"), ("ZADD", self._index, 0, name))
        return bool(made)

    async def put_file(self, name: str, path: Path) -> int:
        key, temporary = self._key(name), self._temporary()
        try:
            size = await self._upload(path, temporary)
            if not await self._call(self._move_in(keys=[temporary, key, self._index], args=[name])):
                raise BlobsUnavailable(f"the upload of {name} expired in Redis before it was complete")
            return size
        except BaseException as exc:  # also cancelled (a shutdown)
            if not isinstance(exc, BlobsUnavailable):  # Redis is up: the part uploaded goes now, not at its expiry
                with contextlib.suppress(BlobsUnavailable):
                    await asyncio.shield(self._call(self._redis.delete(temporary)))
            raise
        finally:
            await asyncio.to_thread(path.unlink, missing_ok=True)

    async def _upload(self, path: Path, temporary: str) -> int:
        await self._transaction(("SET", temporary, b"", "PX", TEMPORARY_TTL_MS))
        size = 0
        with path.open("rb") as file:
            while chunk := await asyncio.to_thread(file.read, WRITE_CHUNK_BYTES):
                await self._transaction(("APPEND", temporary, chunk), ("PEXPIRE", temporary, TEMPORARY_TTL_MS))
                size += len(chunk)
        return size

    async def append(self, name: str, data: bytes) -> None:
        await self._transaction(("APPEND", self._key(name), data), ("ZADD", self._index, 0, name))

    async def open(self, name: str, chunk_bytes: int = 256 * 1024) -> Opened | None:
        file = await asyncio.to_thread(_nameless)
        try:
            size = await self._download(name, _writer(file), chunk_bytes)
            if size is None:
                await asyncio.to_thread(file.close)
                return None
            await asyncio.to_thread(file.seek, 0)
        except BaseException:
            await asyncio.to_thread(file.close)
            raise
        return Opened(size, _read_chunks(file, chunk_bytes))

    @contextlib.asynccontextmanager
    async def local(self, name: str) -> AsyncIterator[Path | None]:
        descriptor, temporary = tempfile.mkstemp(prefix=TEMPORARY_FILE)
        path = Path(temporary)
        try:
            with os.fdopen(descriptor, "wb") as out:
                size = await self._download(name, _writer(out))
            yield None if size is None else path
        finally:
            await asyncio.to_thread(path.unlink, missing_ok=True)

    async def _download(self, name: str, write: Callable[[bytes], Awaitable[object]],
                        whole_bytes: int = WRITE_CHUNK_BYTES) -> int | None:
        """The object's content as it is now, handed to `write` chunk by chunk; its size (None when there is none). A
        large one is read from an expiring snapshot, removed however this ends."""
        key, snapshot = self._key(name), self._temporary()
        found: list[Any] | None = [0]  # until Redis answers, a snapshot may have been made
        try:
            found = await self._call(self._open(keys=[key, snapshot], args=[whole_bytes, TEMPORARY_TTL_MS]))
            if found is None:
                return None
            size = int(found[0])
            if len(found) > 1:
                await write(bytes(found[1]))
                return size
            for offset in range(0, size, WRITE_CHUNK_BYTES):
                await write(await self._snapshot_range(snapshot, offset, min(offset + WRITE_CHUNK_BYTES, size) - 1))
            return size
        finally:  # even when cancelled: no copy of the object left in Redis until its expiry
            if found is not None and len(found) == 1:
                with contextlib.suppress(BlobsUnavailable):
                    await asyncio.shield(self._call(self._redis.delete(snapshot)))

    async def _snapshot_range(self, snapshot: str, first: int, last: int) -> bytes:
        chunk, _ = await self._transaction(("GETRANGE", snapshot, first, last), ("PEXPIRE", snapshot, TEMPORARY_TTL_MS))
        if len(chunk) != last - first + 1:
            raise BlobsUnavailable("an object being read expired in Redis (it was read too slowly)")
        return bytes(chunk)

    async def copy(self, source: str, target: str) -> bool:
        keys = [self._key(source), self._key(target), self._index]
        return bool(await self._call(self._copy(keys=keys, args=[target])))

    async def delete(self, *names: str) -> None:
        if names:
            keys = [self._key(name) for name in names]
            await self._transaction(("DEL", *keys), ("ZREM", self._index, *names))

    async def list(self, prefix: str) -> list[str]:
        directory = prefix.rpartition("/")[0]
        if directory:
            check_name(directory)
        low, high = (b"[" + prefix.encode(), b"(" + prefix.encode() + b"\xff") if prefix else (b"-", b"+")
        names = cast(list[bytes], await self._call(self._redis.zrangebylex(self._index, low, high)))
        return [name.decode() for name in names]

    async def aclose(self) -> None:
        """Nothing of its own to close: the pools are the process's."""


def _nameless() -> BinaryIO:
    return cast(BinaryIO, tempfile.TemporaryFile(prefix=TEMPORARY_FILE))


def _writer(file: IO[bytes]) -> Callable[[bytes], Awaitable[int]]:
    async def write(data: bytes) -> int:
        return await asyncio.to_thread(file.write, data)

    return write
