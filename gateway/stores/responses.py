"""The Responses API's store: stored responses and the input items each took, so that
`GET /v1/responses/{id}`, its input items and `previous_response_id` work on any replica.

It lives in the response cache's backend: Redis when the cache is configured with Redis (shared
by replicas), in memory otherwise (an LRU bounded like the cache), both with their own TTL
(`cache.store_ttl_s`). Keys are scoped by API key id, so one key never sees another's responses;
an unknown id (or another key's) is a 404.

Unlike the cache, a store that cannot be read is an error (503), not a miss: a follow-up must not
quietly lose its conversation. A failed write is logged and counted, and the answer still served.

Background responses running in this process are listed in `running`, so a cancel reaches them;
one running on another replica sees its cancel in the store at its next check.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar, cast

import structlog
from pydantic import BaseModel

from gateway.errors import NotFound, ServiceUnavailable
from gateway.protocol.responses import Item, Response
from gateway.settings import CacheSettings
from gateway.stores.cache import MemoryCache
from gateway.stores.redis import ERRORS, RedisPools
from gateway.telemetry import metrics

log = structlog.get_logger(__name__)


class StoredResponse(BaseModel):
    response: Response
    input_items: list[Item]  # everything the model read: earlier turns first, then this request's input


class StoreBackend(Protocol):
    async def get(self, key: str) -> bytes | None: ...

    async def set(self, key: str, value: bytes) -> None: ...

    async def delete(self, key: str) -> bool: ...

    async def aclose(self) -> None: ...


class MemoryStore(MemoryCache):
    async def delete(self, key: str) -> bool:
        found = await self.get(key) is not None
        if found:
            self._drop(key)
        return found


class RedisStore:
    """Redis, raising on failure (the store's callers decide what a failure means)."""

    def __init__(self, pools: RedisPools, url: str, prefix: str, ttl_s: float, timeout_s: float) -> None:
        self._client = pools.client(url, timeout_s)
        self.prefix, self.ttl_s = prefix, ttl_s

    async def get(self, key: str) -> bytes | None:
        return cast(bytes | None, await self._client.bounded(self._client.redis.get(self.prefix + key)))

    async def set(self, key: str, value: bytes) -> None:
        await self._client.bounded(self._client.redis.set(self.prefix + key, value, px=int(self.ttl_s * 1000)))

    async def delete(self, key: str) -> bool:
        return bool(await self._client.bounded(self._client.redis.delete(self.prefix + key)))

    async def aclose(self) -> None:
        pass  # the pool is the app's (stores.redis)


def make_store_backend(settings: CacheSettings, pools: RedisPools) -> StoreBackend:
    if settings.backend == "redis":
        if not settings.redis_url:
            raise ValueError("cache backend redis needs cache.redis_url (GATEWAY_CACHE__REDIS_URL)")
        prefix = settings.redis_prefix + "responses:"
        return RedisStore(pools, settings.redis_url, prefix, settings.store_ttl_s, settings.redis_timeout_s)
    return MemoryStore(settings.max_entries, settings.max_bytes, settings.store_ttl_s)


@dataclass(slots=True)
class BackgroundRun:
    """A background response generating in this process: its stream, played to nobody."""

    task: asyncio.Task[None]
    hang_up: asyncio.Event  # set: the stream ends as if its client had left (the engine request is aborted)
    cancelled: Callable[[], Awaitable[Response]]  # stores the response as it stands, cancelled, and returns it

    async def cancel(self) -> Response:
        self.hang_up.set()
        await asyncio.gather(self.task, return_exceptions=True)
        return await self.cancelled()


def not_found(response_id: str) -> NotFound:
    return NotFound(f"Response with id '{response_id}' not found.", param="response_id")


T = TypeVar("T")


@dataclass(slots=True)
class ResponseStore:
    backend: StoreBackend
    running: dict[str, BackgroundRun] = field(default_factory=dict)

    async def get(self, scope: str, response_id: str) -> StoredResponse:
        raw = await self._needed("get", self.backend.get(f"{scope}:{response_id}"))
        if raw is None:
            raise not_found(response_id)
        return StoredResponse.model_validate_json(raw)

    async def put(self, scope: str, stored: StoredResponse) -> None:
        value = stored.__pydantic_serializer__.to_json(stored)
        try:
            await self.backend.set(f"{scope}:{stored.response.id}", value)
        except ERRORS as exc:
            self._failed("set", exc)

    async def delete(self, scope: str, response_id: str) -> None:
        if not await self._needed("delete", self.backend.delete(f"{scope}:{response_id}")):
            raise not_found(response_id)

    async def _needed(self, operation: str, call: Awaitable[T]) -> T:
        """A store call whose failure the client must hear of: 503 (a put's failure is only logged)."""
        try:
            return await call
        except ERRORS as exc:
            self._failed(operation, exc)
            raise ServiceUnavailable("The response store is unavailable; retry later") from exc

    def _failed(self, operation: str, exc: BaseException) -> None:
        metrics.labelled(metrics.CACHE_ERRORS, "redis").inc()
        log.warning("response_store_unavailable", operation=operation, error=str(exc))

    async def aclose(self) -> None:
        await asyncio.gather(*(run.cancel() for run in list(self.running.values())))
        await self.backend.aclose()
