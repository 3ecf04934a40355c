"""The Responses API's store: stored responses and their input items, and conversations (`apis.conversations`), in the
cache's backend (Redis or memory), reached only through their owner's view, plus the background runs of this
process."""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, TypeVar

import structlog
from pydantic import BaseModel

from gateway.errors import InvalidRequest, NotFound, ServiceUnavailable
from gateway.protocol.response_objects import Item, Response
from gateway.settings import CacheSettings
from gateway.stores.cache import CacheBackend, MemoryCache, RedisStore
from gateway.stores.redis import ERRORS, RedisPools
from gateway.telemetry import metrics

log = structlog.get_logger(__name__)


class StoredResponse(BaseModel):
    response: Response
    input_items: list[Item]  # everything the model read: earlier turns first, then this request's input


class StoreBackend(CacheBackend, Protocol):
    async def delete(self, key: str) -> bool: ...
    async def swap(self, key: str, old: bytes, new: bytes) -> bool: ...


def make_store_backend(settings: CacheSettings, pools: RedisPools) -> StoreBackend:
    if settings.backend == "redis":
        if not settings.redis_url:
            raise ValueError("cache backend redis needs cache.redis_url (GATEWAY_CACHE__REDIS_URL)")
        prefix = settings.redis_prefix + "responses:"
        return RedisStore(pools, settings.redis_url, prefix, settings.store_ttl_s, settings.redis_timeout_s)
    return MemoryCache(settings.max_entries, settings.max_bytes, settings.store_ttl_s)


@dataclass(slots=True)
class BackgroundRun:
    task: asyncio.Task[None]
    hang_up: asyncio.Event  # set: the stream ends as if its client had left (the engine request is aborted)
    cancelled: Callable[[], Awaitable[Response]]  # stores the response as it stands, cancelled, and returns it

    async def cancel(self) -> Response:
        self.hang_up.set()
        await asyncio.gather(self.task, return_exceptions=True)
        return await self.cancelled()


def not_found(response_id: str) -> NotFound:
    return NotFound(f"Response with id '{response_id}' not found.", param="response_id")


class Kind(NamedTuple):
    """A kind of stored object: the prefix of its ids (`resp_`, `conv_`), and its unknown id's 404."""

    prefix: str
    missing: Callable[[str], NotFound]


RESPONSE = Kind("resp_", not_found)
ID = re.compile(r"[A-Za-z0-9_-]{1,128}")  # ours are `<prefix><hex>`; anything else can name nothing stored


def owned_key(owner: str, object_id: str, missing: Callable[[str], NotFound] = not_found, prefix: str = "") -> str:
    """Where one owner's stored object is kept (a response, a conversation, a stream's log): another owner's id, an id
    of another kind (not starting with `prefix`), or an id that is no id of ours names nothing, and is `missing` (a
    404 exactly as an unknown one)."""
    # no `:` (`x:resp_1` would name owner `<owner>:x`'s resp_1)
    if not (ID.fullmatch(object_id) and object_id.startswith(prefix)):
        raise missing(object_id)
    return f"{owner}:{object_id}"
RUNNING = ("queued", "in_progress")
CHANGE_TRIES = 16  # a change that finds its object written meanwhile this often gives up (a 503)
CHANGE_BACKOFF_S = 0.005  # up to this, times the tries so far, before the next: writers at once fall out of step
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


@dataclass(slots=True)
class ResponseStore:
    backend: StoreBackend
    runs: dict[str, dict[str, BackgroundRun]] = field(default_factory=dict)  # owner -> response id -> run

    def of(self, owner: str) -> OwnedResponses:
        return OwnedResponses(self, owner)

    def run_of(self, owner: str, response_id: str) -> BackgroundRun | None:
        """One owner's background run in this process (never another owner's)."""
        return self.runs.get(owner, {}).get(response_id)

    async def aclose(self) -> None:
        await asyncio.gather(*(run.cancel() for runs in self.runs.values() for run in list(runs.values())))
        await self.backend.aclose()


@dataclass(slots=True, frozen=True)
class OwnedResponses:
    """One owner's stored objects (responses, conversations) and background runs; another owner's id is an unknown id,
    and so is an id of another kind. Unlike the cache, a read that fails is a 503, not a miss (a follow-up must not
    lose its conversation); a failed write of a response is only logged."""

    store: ResponseStore
    owner: str

    def _key(self, object_id: str, kind: Kind = RESPONSE) -> str:
        # the kind's own prefix: a conversation's id never reads a response, nor the other way round
        return owned_key(self.owner, object_id, kind.missing, kind.prefix)

    async def get(self, response_id: str) -> StoredResponse:
        return await self.load(RESPONSE, response_id, StoredResponse)

    async def load(self, kind: Kind, object_id: str, model: type[M]) -> M:
        """One of this owner's objects of `kind` (its 404 when there is none)."""
        raw = await self._needed("get", self.store.backend.get(self._key(object_id, kind)))
        if raw is None:
            raise kind.missing(object_id)
        return model.model_validate_json(raw)

    async def keep(self, kind: Kind, object_id: str, value: BaseModel) -> None:
        """Store one of this owner's objects; a write that fails is a 503 (the caller must not answer as if kept)."""
        key = self._key(object_id, kind)
        await self._needed("set", self.store.backend.set(key, value.__pydantic_serializer__.to_json(value)))

    async def change(self, kind: Kind, object_id: str, model: type[M], change: Callable[[M], None]) -> M:
        """Change one of this owner's objects of `kind` and store it, unless it was written meanwhile (another
        request's change, on any replica): then read it again and change that, so that no change is lost."""
        key = self._key(object_id, kind)
        for tried in range(CHANGE_TRIES):
            if tried:
                await asyncio.sleep(random.uniform(0, CHANGE_BACKOFF_S * tried))
            raw = await self._needed("get", self.store.backend.get(key))
            if raw is None:
                raise kind.missing(object_id)
            value = model.model_validate_json(raw)
            change(value)
            if await self._needed("set", self.store.backend.swap(key, raw, value.__pydantic_serializer__.to_json(value))):
                return value
        raise ServiceUnavailable(f"'{object_id}' is being changed by other requests; retry later")

    async def drop(self, kind: Kind, object_id: str) -> None:
        if not await self._needed("delete", self.store.backend.delete(self._key(object_id, kind))):
            raise kind.missing(object_id)

    async def put(self, stored: StoredResponse) -> None:
        key = self._key(stored.response.id)
        try:
            await self.store.backend.set(key, stored.__pydantic_serializer__.to_json(stored))
        except ERRORS as exc:
            _failed("set", exc)

    async def delete(self, response_id: str) -> None:
        await self.get(response_id)  # none of this owner's: 404 before anything is touched
        run = self.store.run_of(self.owner, response_id)
        if run is not None:
            await run.cancel()
        await self.drop(RESPONSE, response_id)

    async def cancel(self, response_id: str) -> Response:
        """Stop a background response: here if it runs here; on another replica it reads the cancel from the store at
        its next check."""
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
        """Tracked until its task ends; an owner with no run left leaves no entry behind."""
        every = self.store.runs
        runs = every.setdefault(self.owner, {})
        runs[response_id] = run

        def done(_: object) -> None:
            runs.pop(response_id, None)
            if not runs and every.get(self.owner) is runs:
                del every[self.owner]

        run.task.add_done_callback(done)

    async def _needed(self, operation: str, call: Awaitable[T]) -> T:
        try:
            return await call
        except ERRORS as exc:
            _failed(operation, exc)
            raise ServiceUnavailable("The response store is unavailable; retry later") from exc


def _failed(operation: str, exc: BaseException) -> None:
    metrics.labelled(metrics.CACHE_ERRORS, "redis").inc()
    log.warning("response_store_unavailable", operation=operation, error=str(exc))
