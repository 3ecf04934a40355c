"""Every backend of the batch lane's stores for tests that must hold on each: the `records` fixture
(`stores.batchdb`), parametrized by backend — SQLite in a directory and a real redis-server (one per
module, each test's keys under a prefix of its own) — and the `blobs` fixture (`stores.blobs`): a
directory and moto's S3 over HTTP (one per session, a bucket per test)."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from gateway.stores.batchdb import Records, RedisRecords, SqliteRecords
from gateway.stores.blobs import Blobs, LocalBlobs
from gateway.stores.redis import RedisPools
from tests.redis_server import RedisServer


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One redis-server for the module's tests (each test's keys under a prefix of its own)."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


def s3_blobs(spool: Path) -> Blobs:
    from gateway.settings import StoreSettings
    from gateway.stores.blobs_s3 import S3Blobs
    from tests.s3_server import shared

    server = shared()
    store = StoreSettings(backend="s3", s3_endpoint_url=server.url, s3_bucket=server.bucket(), s3_prefix="gw/",
                          s3_access_key_id="test", s3_secret_access_key="test", s3_timeout_s=10)
    return S3Blobs.from_settings(store, "batches", spool)


@pytest.fixture(params=["sqlite", "redis"])
async def records(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Records]:
    pools = RedisPools()

    def on_redis() -> Records:
        server: RedisServer = request.getfixturevalue("redis_server")  # started only for this backend
        return RedisRecords(pools.client(server.url, 5), f"test-{secrets.token_hex(4)}:")

    makers: dict[str, Callable[[], Records]] = {"sqlite": lambda: SqliteRecords(tmp_path / "db.sqlite3"),
                                                "redis": on_redis}
    store = makers[request.param]()
    yield store
    await store.aclose()
    await pools.aclose()


@pytest.fixture(params=["local", "s3"])
async def blobs(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Blobs]:
    store = LocalBlobs(tmp_path / "store") if request.param == "local" else s3_blobs(tmp_path / "spool")
    yield store
    await store.aclose()
