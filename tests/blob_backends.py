"""Every backend of the batch lane's store (`stores.blobs`) for tests that must hold on each: the
`blobs` fixture, parametrized by backend — a directory, a real redis-server (one per module, each
test's keys under a prefix of its own) and moto's S3 over HTTP (one per session, a bucket per test).
A test module takes them with `from tests.blob_backends import blobs, redis_server`."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from gateway.stores.blobs import Blobs, DiskBlobs
from gateway.stores.blobs_redis import RedisBlobs
from gateway.stores.redis import RedisPools
from tests.redis_server import RedisServer

BACKENDS = ["disk", "redis", "s3"]


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One redis-server for the module's tests (each test's keys under a prefix of its own)."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


def _s3() -> Blobs:
    from gateway.settings import StoreSettings
    from gateway.stores.blobs_s3 import S3Blobs
    from tests.s3_server import shared

    server = shared()
    store = StoreSettings(backend="s3", s3_endpoint_url=server.url, s3_bucket=server.bucket(), s3_prefix="gw/",
                          s3_access_key_id="test", s3_secret_access_key="test", s3_timeout_s=10)
    return S3Blobs.from_settings(store, "batches")


@pytest.fixture(params=BACKENDS)
async def blobs(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Blobs]:
    pools = RedisPools()

    def on_redis() -> Blobs:
        server: RedisServer = request.getfixturevalue("redis_server")  # started only for this backend
        return RedisBlobs(pools.client(server.url, 5), f"test-{secrets.token_hex(4)}:files:")

    makers: dict[str, Callable[[], Blobs]] = {"disk": lambda: DiskBlobs.at(tmp_path / "store"), "redis": on_redis,
                                             "s3": _s3}
    store = makers[request.param]()
    yield store
    await store.aclose()
    await pools.aclose()
