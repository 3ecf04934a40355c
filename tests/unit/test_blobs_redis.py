"""The Redis backend of the batch lane's store (stores.blobs_redis) on a real redis-server, beyond the
contract every backend passes (test_blobs.py): uploads streamed in chunks, downloads fixed at open,
an index that never drifts from the objects, keys under the store's prefix only, a Redis that dies or
stalls (BlobsUnavailable, never a hang), and two replicas racing for one name."""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pydantic
import pytest
import structlog.testing

from gateway.settings import StoreSettings
from gateway.stores import blobs_redis
from gateway.stores.backends import open_blobs
from gateway.stores.blobs import BlobsUnavailable
from gateway.stores.blobs_redis import RedisBlobs
from gateway.stores.redis import RedisPools
from tests.fakes import fake_settings
from tests.redis_server import RedisServer

BASE = "test:files:"
MB = 1024 * 1024


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path).start()
    yield server
    if server.process is not None and server.process.poll() is None:
        server.process.send_signal(signal.SIGCONT)  # a test that paused it
    server.stop()


@pytest.fixture
async def pools() -> AsyncIterator[RedisPools]:
    made = RedisPools()
    yield made
    await made.aclose()


@pytest.fixture
def blobs(redis_server: RedisServer, pools: RedisPools) -> RedisBlobs:
    return RedisBlobs(pools.client(redis_server.url, 5), BASE)


async def keys(blobs: RedisBlobs) -> list[str]:
    return sorted([key.decode() async for key in blobs._client.redis.scan_iter(count=1000)])


async def command_calls(blobs: RedisBlobs, command: str) -> int:
    stats = await blobs._client.redis.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


async def test_a_big_upload_is_streamed_in_chunks_and_replaces_whole(blobs: RedisBlobs, tmp_path: Path) -> None:
    content = bytes(range(256)) * (4 * MB // 256) + b"tail"  # four chunks and a bit
    await blobs.put("files/o/big", b"old")
    source = tmp_path / "upload"
    source.write_bytes(content)
    appends = await command_calls(blobs, "append")
    upload = asyncio.create_task(blobs.put_file("files/o/big", source))
    seen = set()
    while not upload.done():
        seen.add(await blobs.get("files/o/big"))
    assert await upload == len(content)
    assert seen <= {b"old", content}  # never a part of the new content
    chunks = -(-len(content) // blobs_redis.WRITE_CHUNK_BYTES)
    assert chunks > 1
    assert await command_calls(blobs, "append") - appends == chunks  # a chunk at a time, never the whole file
    assert await blobs.get("files/o/big") == content
    assert not source.exists()
    assert await blobs._client.redis.ttl(f"{BASE}o:files/o/big") == -1  # the temporary key's expiry is gone
    assert await keys(blobs) == [f"{BASE}index", f"{BASE}o:files/o/big"]


async def test_a_download_is_not_cut_short_by_a_delete_or_replace(blobs: RedisBlobs) -> None:
    content = b"".join(b"line %06d\n" % i for i in range(100_000))  # about 1.1 MB: read from a snapshot
    await blobs.put("batches/b/output", content)
    opened = await blobs.open("batches/b/output", chunk_bytes=64 * 1024)
    assert opened is not None
    assert opened.size == len(content)
    first = await anext(opened.chunks)
    await blobs.delete("batches/b/output")
    await blobs.put("batches/b/output", b"replaced")
    await blobs.append("batches/b/output", b" and appended")
    rest = [chunk async for chunk in opened.chunks]
    assert first + b"".join(rest) == content
    async with blobs.local("batches/b/output") as local:
        assert local is not None
        assert local.read_bytes() == b"replaced and appended"
    assert await keys(blobs) == [f"{BASE}index", f"{BASE}o:batches/b/output"]  # the snapshot removed


async def test_a_download_holds_no_copy_in_redis_however_its_reader_behaves(blobs: RedisBlobs) -> None:
    """A download is copied out of Redis before `open` returns: a reader that stalls, hangs up before
    the first chunk or is cancelled mid-way leaves no snapshot behind (a tenant starting many large
    downloads and dropping them would otherwise fill Redis, the object's size each, for minutes)."""
    await blobs.put("f", b"x" * (3 * MB))
    opened = await blobs.open("f", chunk_bytes=100)
    assert opened is not None
    assert await anext(opened.chunks) == b"x" * 100  # a reader that stalls here
    assert await keys(blobs) == [f"{BASE}index", f"{BASE}o:f"]
    never_read = await blobs.open("f", chunk_bytes=100)  # a client that hung up before the first byte
    assert never_read is not None
    assert await keys(blobs) == [f"{BASE}index", f"{BASE}o:f"]
    await opened.aclose()
    await never_read.aclose()
    for delay in (0, 0.001, 0.005, 0.02):  # cancelled at different points of the copy out of Redis
        opening = asyncio.ensure_future(blobs.open("f"))
        await asyncio.sleep(delay)
        opening.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            if (late := await opening) is not None:
                await late.aclose()
        assert await keys(blobs) == [f"{BASE}index", f"{BASE}o:f"]


async def test_a_snapshot_gone_mid_read_is_an_error_not_a_short_read(blobs: RedisBlobs,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    await blobs.put("f", b"y" * (3 * MB))
    chunks = 0

    async def transaction(*commands: tuple[object, ...]) -> list[object]:
        nonlocal chunks
        if commands[0][0] == "GETRANGE" and (chunks := chunks + 1) == 2:
            [snapshot] = [key for key in await keys(blobs) if ":tmp:" in key]
            await blobs._client.redis.delete(snapshot)  # as its expiry would after a reader stalled
        return await original(*commands)

    original = blobs._transaction
    monkeypatch.setattr(blobs, "_transaction", transaction)
    with pytest.raises(BlobsUnavailable, match="expired"):
        await blobs.open("f")


async def test_the_index_lists_exactly_the_objects_there_are(blobs: RedisBlobs, tmp_path: Path) -> None:
    names = [f"pending/batch_{i}" for i in range(6)]
    await blobs.put("source", b"s")
    shuffled = random.Random(29)  # the same rounds each run

    def writes(round_: int, name: str) -> list[Awaitable[object]]:
        """Four of the writes to `name`, picked and ordered at random, started at once."""
        upload = tmp_path / f"upload-{round_}-{name.rpartition('_')[2]}"
        upload.write_bytes(b"u")
        makers: list[Callable[[], Awaitable[object]]] = [
            lambda: blobs.put(name, b"p"), lambda: blobs.append(name, b"a"), lambda: blobs.create(name, b"c"),
            lambda: blobs.copy("source", name), lambda: blobs.put_file(name, upload),
            lambda: blobs.delete(name), lambda: blobs.delete(name), lambda: blobs.delete(name),
        ]
        return [make() for make in shuffled.sample(makers, 4)]

    for round_ in range(20):
        await asyncio.gather(*(call for name in names for call in writes(round_, name)))
        listed = set(await blobs.list("pending/"))
        there = {name for name in names if await blobs._client.redis.exists(f"{BASE}o:{name}")}
        assert listed == there
    await blobs.delete(*names)
    assert await blobs.list("pending/") == []
    assert await blobs.copy("never", "pending/copy") is False
    assert await blobs.list("pending/") == []  # a copy of nothing indexes nothing
    assert await keys(blobs) == [f"{BASE}index", f"{BASE}o:source"]


async def test_listing_a_folder_reads_only_its_names(blobs: RedisBlobs) -> None:
    for name in ("a/x", "a/y/z", "ab/x", "a-b/x", "b"):
        await blobs.put(name, b"1")
    assert sorted(await blobs.list("a/")) == ["a/x", "a/y/z"]  # not ab/ nor a-b/
    assert await blobs.list("a/y/") == ["a/y/z"]
    assert sorted(await blobs.list("")) == ["a-b/x", "a/x", "a/y/z", "ab/x", "b"]
    with pytest.raises(ValueError, match="not an object name"):
        await blobs.list("../")


async def test_the_two_parts_keep_their_keys_under_the_prefix(redis_server: RedisServer, pools: RedisPools) -> None:
    store = {"backend": "redis", "redis_url": redis_server.url, "redis_prefix": "gw:store:"}
    settings = fake_settings(store=store)
    files, batches = open_blobs(settings, pools, "files"), open_blobs(settings, pools, "batches")
    assert isinstance(files, RedisBlobs)
    assert isinstance(batches, RedisBlobs)
    await files._client.redis.set("gw:cache:x", b"someone else's")
    await files.put("o/a", b"file")
    await batches.put("o/a", b"batch")
    await batches.append("o/log", b"line\n")
    await batches.copy("o/a", "o/b")
    opened = await batches.open("o/log", chunk_bytes=2)  # a snapshot while it is read
    assert opened is not None
    assert (await files.get("o/a"), await batches.get("o/a")) == (b"file", b"batch")
    assert await files.list("o/") == ["o/a"]
    assert sorted(await batches.list("o/")) == ["o/a", "o/b", "o/log"]
    stored = await keys(files)
    assert "gw:cache:x" in stored
    others = [key for key in stored if key != "gw:cache:x"]
    assert others
    assert all(key.startswith(("gw:store:files:", "gw:store:batches:")) for key in others)
    await opened.aclose()
    await files.delete("o/a")
    assert await files._client.redis.get("gw:cache:x") == b"someone else's"
    assert await batches.get("o/a") == b"batch"


async def test_a_killed_redis_is_unavailable_at_once(blobs: RedisBlobs, redis_server: RedisServer, tmp_path: Path) -> None:
    await blobs.put("big", b"z" * 1000)
    opened = await blobs.open("big", chunk_bytes=100)
    assert opened is not None
    assert redis_server.process is not None
    redis_server.process.kill()
    redis_server.process.wait()
    upload = tmp_path / "upload"
    upload.write_bytes(b"u")
    calls = [
        blobs.get("a"), blobs.put("a", b"x"), blobs.create("a", b"x"), blobs.append("a", b"x"),
        blobs.put_file("a", upload), blobs.open("a"), blobs.copy("a", "b"), blobs.delete("a"), blobs.list("a/"),
    ]
    for call in calls:
        with pytest.raises(BlobsUnavailable, match="unavailable"):
            await call
    assert b"".join([chunk async for chunk in opened.chunks]) == b"z" * 1000  # copied out at open: read whole
    with pytest.raises(BlobsUnavailable):
        async with blobs.local("a"):
            pass
    redis_server.start()  # back at the same address: the store serves again
    assert await blobs.get("big") is None  # it kept nothing (no persistence in this test's Redis)
    await blobs.put("a", b"back")
    assert await blobs.get("a") == b"back"


async def test_a_stalled_redis_is_given_up_after_the_store_s_timeout(redis_server: RedisServer, pools: RedisPools) -> None:
    blobs = RedisBlobs(pools.client(redis_server.url, 0.3), BASE)
    await blobs.put("a", b"x")
    assert redis_server.process is not None
    redis_server.process.send_signal(signal.SIGSTOP)
    try:
        for call in (blobs.get("a"), blobs.append("a", b"y"), blobs.list("")):
            with pytest.raises(BlobsUnavailable):
                await call
    finally:
        redis_server.process.send_signal(signal.SIGCONT)
    assert await blobs.get("a") in (b"x", b"xy")  # the append may have reached Redis before it stalled


async def test_two_replicas_racing_to_create_one_wins(redis_server: RedisServer) -> None:
    replicas = [RedisPools(), RedisPools()]  # two processes' pools on one Redis
    stores = [RedisBlobs(pools.client(redis_server.url, 5), BASE) for pools in replicas]
    try:
        for round_ in range(20):
            name = f"leases/batch_{round_}"
            made = await asyncio.gather(*(store.create(name, b"%d" % i) for i, store in enumerate(stores * 4)))
            assert made.count(True) == 1
            winner = made.index(True) % 2
            assert await stores[1 - winner].get(name) == b"%d" % made.index(True)
            assert await stores[0].list("leases/") == await stores[1].list("leases/")
    finally:
        for pools in replicas:
            await pools.aclose()


async def test_a_redis_that_would_lose_the_store_is_warned_of_once(redis_server: RedisServer, pools: RedisPools) -> None:
    client = pools.client(redis_server.url, 5)
    await client.redis.config_set("maxmemory-policy", "allkeys-lru")  # a cache's Redis
    with structlog.testing.capture_logs() as logs:
        blobs = RedisBlobs(client, BASE)
        await blobs.put("a", b"x")
        await blobs.get("a")
    assert [line["event"] for line in logs] == ["store_redis_not_durable", "store_redis_evicts"]
    await client.redis.config_set("maxmemory-policy", "noeviction")
    await client.redis.config_set("appendonly", "yes")
    try:
        with structlog.testing.capture_logs() as logs:
            await RedisBlobs(client, BASE).get("a")
        assert logs == []
    finally:
        await client.redis.config_set("appendonly", "no")  # a Redis writing its first AOF refuses to stop


def test_the_redis_backend_needs_its_url() -> None:
    with pytest.raises(pydantic.ValidationError, match=r"store\.backend redis needs store\.redis_url"):
        StoreSettings(backend="redis")
    assert StoreSettings(backend="redis", redis_url="redis://127.0.0.1:6379/0").redis_url


async def test_an_upload_cancelled_mid_way_leaves_no_part_in_redis(blobs: RedisBlobs, tmp_path: Path) -> None:
    """A put_file cancelled (a shutdown, a client gone) removes what it had sent rather than leave up
    to 200 MB in Redis until the temporary key expires."""
    for delay in (0.001, 0.005, 0.02, 0.05):
        upload = tmp_path / "upload"
        upload.write_bytes(b"u" * (8 * MB))
        putting = asyncio.ensure_future(blobs.put_file("f", upload))
        await asyncio.sleep(delay)
        putting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await putting
        assert [key for key in await keys(blobs) if ":tmp:" in key] == []
