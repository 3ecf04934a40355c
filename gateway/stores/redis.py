"""One Redis connection pool per address for the whole process; each user (cache, stored responses, limits) bounds its
own calls. No retries: a user that gives up serves without Redis."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

T = TypeVar("T")
ERRORS = (redis.RedisError, OSError, TimeoutError)  # what a Redis that is down or slow raises


class Client:
    def __init__(self, redis_client: redis.Redis, timeout_s: float) -> None:
        self.redis = redis_client
        self.timeout_s = timeout_s

    async def bounded(self, call: Awaitable[T]) -> T:
        """`call`, given up after the user's timeout. A cancel that redis-py swallowed (its `asyncio.wait_for` on
        Python 3.11 can return after a cancel) is raised, so a task cancelled mid-call still ends."""
        task = asyncio.current_task()
        cancels = task.cancelling() if task is not None else 0
        async with asyncio.timeout(self.timeout_s):
            result = await call
        if task is not None and task.cancelling() > cancels:  # asked during the call, and never raised
            raise asyncio.CancelledError
        return result


class RedisPools:
    def __init__(self) -> None:
        self._pools: dict[str, redis.ConnectionPool] = {}

    def client(self, url: str, timeout_s: float) -> Client:
        pool = self._pools.get(url)
        if pool is None:
            pool = self._pools[url] = redis.ConnectionPool.from_url(url, retry=Retry(NoBackoff(), 0))
        settings = pool.connection_kwargs  # read by each connection the pool makes
        for name in ("socket_timeout", "socket_connect_timeout"):
            settings[name] = max(settings.get(name) or 0.0, timeout_s)
        return Client(redis.Redis(connection_pool=pool), timeout_s)

    def __len__(self) -> int:
        return len(self._pools)

    async def aclose(self) -> None:
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            await pool.aclose()
