"""One Redis connection pool per address (stores.redis): the cache, the stored responses and the
limits share it, each with its own bound on a call."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.settings import CacheSettings, LimitsSettings
from gateway.stores.cache import RedisCache, make_backend
from gateway.stores.redis import RedisPools
from gateway.stores.responses import RedisStore, make_store_backend
from gateway.tenancy.quota import Quota
from tests.redis_server import RedisServer

URL = "redis://127.0.0.1:1/0"  # never connected to here


def test_the_cache_the_store_and_the_limits_share_one_pool_per_address() -> None:
    pools = RedisPools()
    cache_settings = CacheSettings(backend="redis", redis_url=URL, redis_timeout_s=0.5)
    cache = make_backend(cache_settings, pools)
    store = make_store_backend(cache_settings, pools)
    quota = Quota(LimitsSettings(redis_url=URL, redis_timeout_s=0.25), pools)
    assert isinstance(cache, RedisCache)
    assert isinstance(store, RedisStore)
    assert quota.shared is not None
    clients = [cache._client, store._client, quota.shared._client]
    assert len(pools) == 1
    assert len({id(c.redis.connection_pool) for c in clients}) == 1
    assert [c.timeout_s for c in clients] == [0.5, 0.5, 0.25]  # each its own bound
    kwargs = clients[0].redis.connection_pool.connection_kwargs
    assert kwargs["socket_timeout"] == kwargs["socket_connect_timeout"] == 0.5  # the longest
    pools.client("redis://127.0.0.1:2/0", 1.0)
    assert len(pools) == 2


async def test_a_call_is_given_up_after_its_user_s_bound() -> None:
    client = RedisPools().client(URL, 0.05)
    with pytest.raises(TimeoutError):
        await client.bounded(asyncio.sleep(5))
    assert await client.bounded(asyncio.sleep(0, "done")) == "done"


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()


async def test_a_cancel_during_a_call_is_never_lost(redis_server: RedisServer) -> None:
    """A task cancelled while its call is under way ends cancelled, wherever the cancel lands: redis-py
    lost one that came just after a command was sent (Python 3.11's `asyncio.wait_for`), and the
    batch runner's watch of a lease, which runs until it is cancelled, went on for ever."""
    pools = RedisPools()
    client = pools.client(redis_server.url, 10)
    await client.bounded(client.redis.set("k", b"v"))
    try:
        for turns in range(1, 10):  # the cancel after this many turns of the event loop
            call = asyncio.ensure_future(client.bounded(client.redis.get("k")))
            for _ in range(turns):
                await asyncio.sleep(0)
            if call.done():  # answered before the cancel: every point of the call was tried
                break
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
    finally:
        await pools.aclose()
