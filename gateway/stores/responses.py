"""The Responses API's store: stored responses and the input items each took, so that
`GET /v1/responses/{id}`, its input items and `previous_response_id` work on any replica.

It lives in the response cache's backend: Redis when the cache is configured with Redis (shared
by replicas), in memory otherwise (an LRU bounded like the cache), both with their own TTL
(`cache.store_ttl_s`). Every response has an owner (the tenant of the key that made it) and is
reached only through its owner's view (`ResponseStore.of`): another owner's id is a 404 exactly as
an unknown one, and nothing is read, cancelled or deleted before that check.

Unlike the cache, a store that cannot be read is an error (503), not a miss: a follow-up must not
quietly lose its conversation. A failed write is logged and counted, and the answer still served.

Background responses running in this process are tracked by (owner, id), so an owner's cancel or
delete reaches them; one running on another replica sees its cancel in the store at its next check.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar, cast

import structlog
from pydantic import BaseModel

from gateway.errors import InvalidRequest, NotFound, ServiceUnavailable
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


ID = re.compile(r"[A-Za-z0-9_-]{1,128}")  # ours are `resp_<hex>`; anything else can name nothing stored
RUNNING = ("queued", "in_progress")
T = TypeVar("T")


@dataclass(slots=True)
class ResponseStore:
    """Every stored response has an owner (the tenant that made it), and the only way to one is
    through its owner's view (`of`): no code path reaches a response, or the background run
    making it, without naming whose it is. Another owner's id is exactly an unknown id."""

    backend: StoreBackend
    _running: dict[tuple[str, str], BackgroundRun] = field(default_factory=dict)

    def of(self, owner: str) -> OwnedResponses:
        return OwnedResponses(self, owner)

    def run_of(self, owner: str, response_id: str) -> BackgroundRun | None:
        """The background run of this owner's response, if it runs here."""
        return self._running.get((owner, response_id))

    def track(self, owner: str, response_id: str, run: BackgroundRun) -> None:
        """A background run of this owner's, running here until its task ends."""
        key = (owner, response_id)
        self._running[key] = run
        run.task.add_done_callback(lambda _: self._running.pop(key, None))

    async def aclose(self) -> None:
        await asyncio.gather(*(run.cancel() for run in list(self._running.values())))
        await self.backend.aclose()


@dataclass(slots=True, frozen=True)
class OwnedResponses:
    """One owner's stored responses and background runs."""

    store: ResponseStore
    owner: str

    def _key(self, response_id: str) -> str:
        if not ID.fullmatch(response_id):  # e.g. `x:resp_1` would name owner `<owner>:x`'s resp_1
            raise not_found(response_id)
        return f"{self.owner}:{response_id}"

    async def get(self, response_id: str) -> StoredResponse:
        raw = await self._needed("get", self.store.backend.get(self._key(response_id)))
        if raw is None:
            raise not_found(response_id)
        return StoredResponse.model_validate_json(raw)

    async def put(self, stored: StoredResponse) -> None:
        key = self._key(stored.response.id)
        try:
            await self.store.backend.set(key, stored.__pydantic_serializer__.to_json(stored))
        except ERRORS as exc:
            _failed("set", exc)

    async def delete(self, response_id: str) -> None:
        """Delete a response, first stopping its background run if it is this owner's and running here."""
        await self.get(response_id)  # none of this owner's: 404 before anything is touched
        run = self.store.run_of(self.owner, response_id)
        if run is not None:
            await run.cancel()
        if not await self._needed("delete", self.store.backend.delete(self._key(response_id))):
            raise not_found(response_id)

    async def cancel(self, response_id: str) -> Response:
        """Stop a background response: here if it runs here; on another replica it reads the
        cancel from the store at its next check. A finished one is returned as it is."""
        stored = await self.get(response_id)
        if not stored.response.background:
            raise InvalidRequest("Only responses created with background set to true can be cancelled", "response_id")
        if stored.response.status not in RUNNING:
            return stored.response  # done already: cancelling again changes nothing
        run = self.store.run_of(self.owner, response_id)
        if run is not None:
            return await run.cancel()
        cancelled = stored.response.model_copy(update={"status": "cancelled"})
        await self.put(StoredResponse(response=cancelled, input_items=stored.input_items))
        return cancelled

    def track(self, response_id: str, run: BackgroundRun) -> None:
        """A background run of this owner's, running here until its task ends."""
        self.store.track(self.owner, response_id, run)

    async def _needed(self, operation: str, call: Awaitable[T]) -> T:
        """A store call whose failure the client must hear of: 503 (a put's failure is only logged)."""
        try:
            return await call
        except ERRORS as exc:
            _failed(operation, exc)
            raise ServiceUnavailable("The response store is unavailable; retry later") from exc


def _failed(operation: str, exc: BaseException) -> None:
    metrics.labelled(metrics.CACHE_ERRORS, "redis").inc()
    log.warning("response_store_unavailable", operation=operation, error=str(exc))
