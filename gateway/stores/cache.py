"""Response cache for deterministic requests (temperature 0, or a fixed seed), keyed by a hash of the canonical
request and of the identity of what answers it (`backends.registry.identity`: the weights, the settings that change
an answer), so an answer is served only while what gave it would give it now; in memory (LRU with TTL) or in Redis (a Redis that fails means uncached, never an error)."""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from typing import Generic, Protocol, TypeVar, cast

import orjson
import structlog
from pydantic import BaseModel

from gateway.settings import CacheSettings
from gateway.stores.redis import ERRORS, RedisPools
from gateway.telemetry import metrics

log = structlog.get_logger(__name__)
NOT_IN_KEY = {"stream", "stream_options", "user"}
_NOT_IN_BODY = NOT_IN_KEY | {"model"}  # the model is in the key as the one that answers
AnswerT = TypeVar("AnswerT", bound=BaseModel)


class CacheBackend(Protocol):
    async def get(self, key: str) -> bytes | None: ...
    async def set(self, key: str, value: bytes) -> None: ...
    async def aclose(self) -> None: ...


def cache_key(route: str, model: str, body: BaseModel, tenant: str = "", identity: str = "") -> str:
    serializer = body.__pydantic_serializer__  # what model_dump calls, without its Python layer
    fields = serializer.to_python(body, mode="json", by_alias=True, exclude=_NOT_IN_BODY)
    whole = {"route": route, "model": model, "identity": identity, "tenant": tenant, "body": fields}
    try:
        canonical = orjson.dumps(whole, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # orjson refuses integers past 64 bits (free-form tools, schemas), lone surrogates
        canonical = json.dumps(whole, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(canonical).hexdigest()


class MemoryCache:
    def __init__(self, max_entries: int, max_bytes: int, ttl_s: float) -> None:
        self.max_entries, self.max_bytes, self.ttl_s = max_entries, max_bytes, ttl_s
        self._items: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self.bytes = 0

    async def get(self, key: str) -> bytes | None:
        return self.peek(key)

    def peek(self, key: str) -> bytes | None:
        item = self._items.get(key)
        if item is None:
            return None
        expires, value = item
        if expires < time.monotonic():
            self._drop(key)
            return None
        self._items.move_to_end(key)
        return value

    async def set(self, key: str, value: bytes) -> None:
        if len(value) > self.max_bytes:
            return
        if key in self._items:
            self._drop(key)
        self._items[key] = (time.monotonic() + self.ttl_s, value)
        self.bytes += len(value)
        while len(self._items) > self.max_entries or self.bytes > self.max_bytes:
            self._drop(next(iter(self._items)))

    async def swap(self, key: str, old: bytes, new: bytes) -> bool:
        """Set `key` to `new` if it still holds `old` (no await in between: nothing runs meanwhile)."""
        if self.peek(key) != old:
            return False
        await self.set(key, new)
        return True

    async def delete(self, key: str) -> bool:
        found = self.peek(key) is not None
        if found:
            self._drop(key)
        return found

    def _drop(self, key: str) -> None:
        _, value = self._items.pop(key)
        self.bytes -= len(value)

    def __len__(self) -> int:
        return len(self._items)

    async def aclose(self) -> None:
        self._items.clear()


_SWAP = """
local now = redis.call('GET', KEYS[1])
if not now or redis.sha1hex(now) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 1
"""


class RedisStore:
    """Values in Redis under a prefix, each kept `ttl_s`; a Redis that fails raises (`stores.redis.ERRORS`)."""

    def __init__(self, pools: RedisPools, url: str, prefix: str, ttl_s: float, timeout_s: float) -> None:
        self._client = pools.client(url, timeout_s)
        self.prefix, self.ttl_s = prefix, ttl_s

    async def get(self, key: str) -> bytes | None:  # no decode_responses: bytes
        return cast(bytes | None, await self._client.bounded(self._client.redis.get(self.prefix + key)))

    async def set(self, key: str, value: bytes) -> None:
        await self._client.bounded(self._client.redis.set(self.prefix + key, value, px=int(self.ttl_s * 1000)))

    async def swap(self, key: str, old: bytes, new: bytes) -> bool:
        """Set `key` to `new` if it still holds `old`, in one step on the server (compared by digest: `old` is not
        sent again)."""
        digest = hashlib.sha1(old, usedforsecurity=False).hexdigest()
        ttl_ms = int(self.ttl_s * 1000)
        swapped = self._client.redis.eval(_SWAP, 1, self.prefix + key, digest, new, ttl_ms)
        return bool(await self._client.bounded(swapped))

    async def delete(self, key: str) -> bool:
        return bool(await self._client.bounded(self._client.redis.delete(self.prefix + key)))

    async def aclose(self) -> None:
        pass  # the pool is the app's (stores.redis)


class RedisCache(RedisStore):
    """The cache's Redis: one that fails is a miss, never an error."""

    async def get(self, key: str) -> bytes | None:
        try:
            return await super().get(key)
        except ERRORS as exc:
            self._failed("get", exc)
            return None

    async def set(self, key: str, value: bytes) -> None:
        try:
            await super().set(key, value)
        except ERRORS as exc:
            self._failed("set", exc)

    def _failed(self, operation: str, exc: BaseException) -> None:
        metrics.labelled(metrics.CACHE_ERRORS, "redis").inc()
        log.warning("cache_unavailable", backend="redis", operation=operation, error=str(exc), serving="uncached")


class Hit(Generic[AnswerT]):
    """A cached answer's JSON, parsed into its model only when asked: a non-streamed hit is answered from the bytes."""

    __slots__ = ("_answer", "_kind", "raw")

    def __init__(self, raw: bytes, kind: type[AnswerT]) -> None:
        self.raw = raw
        self._kind = kind
        self._answer: AnswerT | None = None

    def answer(self) -> AnswerT:
        if self._answer is None:
            self._answer = self._kind.model_validate_json(self.raw)
        return self._answer


def make_backend(settings: CacheSettings, pools: RedisPools) -> CacheBackend | None:
    if settings.backend == "off":
        return None
    if settings.backend == "redis":
        if not settings.redis_url:
            raise ValueError("cache backend redis needs cache.redis_url (GATEWAY_CACHE__REDIS_URL)")
        return RedisCache(pools, settings.redis_url, settings.redis_prefix, settings.ttl_s, settings.redis_timeout_s)
    return MemoryCache(settings.max_entries, settings.max_bytes, settings.ttl_s)


class ResponseCache:
    def __init__(self, backend: CacheBackend | None) -> None:
        self.backend = backend

    def key_for(self, route: str, model: str, body: BaseModel, tenant: str = "", identity: str = "") -> str | None:
        deterministic = getattr(body, "temperature", None) == 0 or getattr(body, "seed", None) is not None
        if self.backend is None or not deterministic:
            return None
        return cache_key(route, model, body, tenant, identity)

    async def get(self, key: str, model: str, kind: type[AnswerT]) -> Hit[AnswerT] | None:
        backend = self.backend
        assert backend is not None
        raw = backend.peek(key) if type(backend) is MemoryCache else await backend.get(key)
        if raw is None:
            metrics.labelled(metrics.CACHE_MISSES, model).inc()
            return None
        metrics.labelled(metrics.CACHE_HITS, model).inc()
        return Hit(raw, kind)

    async def put(self, key: str, answer: BaseModel) -> bytes:
        """Store the answer's JSON (without None fields, as `api.requests.json_response` writes it); the JSON back."""
        assert self.backend is not None
        raw = answer.__pydantic_serializer__.to_json(answer, exclude_none=True)
        await self.backend.set(key, raw)
        return raw

    def storer(self, key: str) -> Storer:
        """The hand-off that stores a whole answer under `key` once a service has it."""
        return Storer(self, key)


class Storer:
    """Stores a whole answer and keeps what it wrote, so a non-streamed answer goes out as those bytes instead of
    being serialized again."""

    __slots__ = ("_answer", "_cache", "_key", "_raw")

    def __init__(self, cache: ResponseCache, key: str) -> None:
        self._cache, self._key = cache, key
        self._answer: BaseModel | None = None
        self._raw = b""

    async def __call__(self, answer: BaseModel) -> None:
        self._raw = await self._cache.put(self._key, answer)
        self._answer = answer

    def written(self, answer: BaseModel) -> bytes | None:
        return self._raw if answer is self._answer else None
