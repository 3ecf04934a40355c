"""The batch lane's records in Redis, for replicas (`stores.batchdb` says what is kept). Under the prefix:
`files:<owner hash>` a hash of an owner's FileObjects; `batch:<id>` a hash of a batch's record, owner, cancel, fencing
token and counts; `owned:<owner hash>` the set of an owner's batch ids; `runnable` a sorted set of the batches not done
(by creation); `answers:<id>` a hash of each line's answer, written with HSETNX (once per line), and `order:<id>` the
list of its custom_ids as they came; `claim:<id>` the holder of a batch's claim, expiring. Every change of a run is one
Lua script that checks the run's token first: a replica stalled past its claim is refused once another claimed."""

from __future__ import annotations

import hashlib
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from gateway.protocol.batch_objects import DONE, StoredBatch
from gateway.protocol.file_objects import FileObject
from gateway.stores.batchdb import PAGE, Answer, Fenced, merged, parsed
from gateway.stores.blobs import unavailable
from gateway.stores.redis import Client

T = TypeVar("T")
COUNTS = ("completed", "failed", "expired", "prompt", "completion")

SCRIPTS = {"claim": """
if redis.call('HEXISTS', KEYS[2], 'record') == 0 or redis.call('ZSCORE', KEYS[3], ARGV[3]) == false then return 0 end
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 0 end
return redis.call('HINCRBY', KEYS[2], 'token', 1)
""", "renew": """
if redis.call('HGET', KEYS[2], 'token') ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[2])
return 1
""", "release": """
if redis.call('HGET', KEYS[2], 'token') == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
""", "cancel": """
if redis.call('HEXISTS', KEYS[1], 'record') == 1 then redis.call('HSETNX', KEYS[1], 'cancel_at', ARGV[1]) end
return 1
""", "save": """
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'record', ARGV[2])
if ARGV[3] == '1' then redis.call('ZREM', KEYS[2], ARGV[4]) end
return 1
""", "answer": """
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then return -1 end
local kept = 0
for at = 2, #ARGV, 7 do
  if redis.call('HSETNX', KEYS[2], ARGV[at], ARGV[at + 1]) == 1 then
    kept = kept + 1
    redis.call('RPUSH', KEYS[3], ARGV[at])
    for i, field in ipairs({'completed', 'failed', 'expired', 'prompt', 'completion'}) do
      redis.call('HINCRBY', KEYS[1], field, ARGV[at + 1 + i])
    end
  end
end
return kept
"""}


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _hash(owner: str) -> str:
    return hashlib.sha256(owner.encode()).hexdigest()[:32]


class RedisRecords:
    """A replica's view of the records shared in one Redis (persistence on: AOF)."""

    def __init__(self, client: Client, prefix: str) -> None:
        self._client, self._redis, self._p = client, client.redis, prefix
        self._scripts = {name: self._redis.register_script(source) for name, source in SCRIPTS.items()}

    async def _call(self, call: Awaitable[T]) -> T:
        with unavailable():
            return await self._client.bounded(call)

    async def _script(self, name: str, keys: list[str], args: list[Any]) -> int:
        return int(await self._call(self._scripts[name](keys=keys, args=args)))

    def _batch(self, batch_id: str) -> str:
        return f"{self._p}batch:{batch_id}"

    async def add_file(self, owner: str, file: FileObject) -> None:
        await self._call(self._redis.hset(f"{self._p}files:{_hash(owner)}", file.id, file.model_dump_json()))

    async def file(self, owner: str, file_id: str) -> FileObject | None:
        raw = await self._call(self._redis.hget(f"{self._p}files:{_hash(owner)}", file_id))
        return None if raw is None else parsed(FileObject, raw)

    async def files(self, owner: str) -> list[FileObject]:
        raw = await self._call(self._redis.hvals(f"{self._p}files:{_hash(owner)}"))
        return [file for record in raw if (file := parsed(FileObject, record)) is not None]

    async def remove_file(self, owner: str, file_id: str) -> bool:
        return bool(await self._call(self._redis.hdel(f"{self._p}files:{_hash(owner)}", file_id)))

    async def create(self, stored: StoredBatch) -> None:
        batch_id = stored.batch.id
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(self._batch(batch_id), mapping={"record": stored.model_dump_json(), "token": 0,
                                                       **dict.fromkeys(COUNTS, 0)})
            pipe.sadd(f"{self._p}owned:{_hash(stored.owner.tenant)}", batch_id)
            pipe.zadd(f"{self._p}runnable", {batch_id: stored.created_ns})
            await self._call(pipe.execute())

    async def batch(self, batch_id: str) -> StoredBatch | None:
        raw = await self._call(self._redis.hgetall(self._batch(batch_id)))
        if b"record" not in raw:
            return None
        cancel = raw.get(b"cancel_at")
        counts = [int(raw.get(name.encode(), 0)) for name in COUNTS]
        return merged(raw[b"record"], None if cancel is None else int(cancel), counts)

    async def batches(self, owner: str) -> list[StoredBatch]:
        ids = await self._call(self._redis.smembers(f"{self._p}owned:{_hash(owner)}"))
        found = [await self.batch(_text(batch_id)) for batch_id in ids]
        return [stored for stored in found if stored is not None and stored.owner.tenant == owner]

    async def remove(self, batch_id: str) -> None:
        stored = await self.batch(batch_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._batch(batch_id), f"{self._p}answers:{batch_id}", f"{self._p}order:{batch_id}")
            pipe.zrem(f"{self._p}runnable", batch_id)
            if stored is not None:
                pipe.srem(f"{self._p}owned:{_hash(stored.owner.tenant)}", batch_id)
            await self._call(pipe.execute())

    async def ask_cancel(self, batch_id: str) -> None:
        await self._script("cancel", [self._batch(batch_id)], [int(time.time())])  # none on a batch deleted meanwhile

    async def runnable(self) -> list[str]:
        return [_text(batch_id) for batch_id in await self._call(self._redis.zrange(f"{self._p}runnable", 0, -1))]

    async def claim(self, batch_id: str, holder: str, ttl_s: float) -> int | None:
        keys = [f"{self._p}claim:{batch_id}", self._batch(batch_id), f"{self._p}runnable"]
        return await self._script("claim", keys, [holder, int(ttl_s * 1000), batch_id]) or None

    async def renew(self, batch_id: str, token: int, ttl_s: float) -> bool:
        keys = [f"{self._p}claim:{batch_id}", self._batch(batch_id)]
        return bool(await self._script("renew", keys, [token, int(ttl_s * 1000), "renewed"]))

    async def release(self, batch_id: str, token: int) -> None:
        await self._script("release", [f"{self._p}claim:{batch_id}", self._batch(batch_id)], [token])

    async def save(self, stored: StoredBatch, token: int) -> None:
        batch_id = stored.batch.id
        done = int(stored.batch.status in DONE)
        keys = [self._batch(batch_id), f"{self._p}runnable"]
        if not await self._script("save", keys, [token, stored.model_dump_json(), done, batch_id]):
            raise Fenced(batch_id)

    async def answer_all(self, batch_id: str, token: int, answers: list[Answer]) -> int:
        keys = [self._batch(batch_id), f"{self._p}answers:{batch_id}", f"{self._p}order:{batch_id}"]
        args: list[Any] = [token]
        for a in answers:
            value = (b"1" if a.ok else b"2" if a.expired else b"0") + a.line
            args += [a.custom_id, value, int(a.ok), int(not a.ok), int(a.expired), a.prompt, a.completion]
        kept = await self._script("answer", keys, args)
        if kept < 0:
            raise Fenced(batch_id)
        return kept

    async def answered(self, batch_id: str) -> set[str]:
        return {_text(custom_id) for custom_id in await self._call(self._redis.hkeys(f"{self._p}answers:{batch_id}"))}

    async def answers(self, batch_id: str) -> AsyncIterator[list[Answer]]:
        start = 0
        while ids := await self._call(self._redis.lrange(f"{self._p}order:{batch_id}", start, start + PAGE - 1)):
            values = await self._call(self._redis.hmget(f"{self._p}answers:{batch_id}", ids))
            yield [Answer(_text(custom_id), value[:1] == b"1", value[1:], value[:1] == b"2")
                   for custom_id, value in zip(ids, values, strict=True) if isinstance(value, bytes)]
            start += PAGE

    async def aclose(self) -> None:
        pass  # the pool is the process's (`RedisPools`)
