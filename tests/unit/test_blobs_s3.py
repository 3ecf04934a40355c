"""What the S3 backend of `stores.blobs` does beyond the contract every backend passes
(tests/unit/test_blobs.py), against moto's S3 server (tests/s3_server.py): multipart uploads, creates
raced from two replicas, appended objects' parts (hidden, numbered across replicas, cleaned up), reads
that a delete or a replace mid-way neither cuts short nor tears, a service down or silent (a prompt
BlobsUnavailable), every key below the prefix, and the settings it needs."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from gateway.settings import Settings, StoreSettings
from gateway.stores.backends import open_blobs
from gateway.stores.blobs import BlobsUnavailable
from gateway.stores.blobs_s3 import MIB, S3Blobs
from gateway.stores.redis import RedisPools
from tests.s3_server import S3Server, shared

PREFIX = "gw/"


def _settings(url: str, bucket: str, **more: Any) -> StoreSettings:
    return StoreSettings(backend="s3", s3_endpoint_url=url, s3_bucket=bucket, s3_prefix=PREFIX,
                         s3_access_key_id="test", s3_secret_access_key="test", **more)


@pytest.fixture
def bucket() -> str:
    return shared().bucket()


@pytest.fixture
async def blobs(bucket: str) -> AsyncIterator[S3Blobs]:
    store = S3Blobs.from_settings(_settings(shared().url, bucket), "batches")
    yield store
    await store.aclose()


def _keys(bucket: str) -> list[str]:
    pages = shared().client().get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return [item["Key"] for page in pages for item in page.get("Contents", [])]


async def _read(blobs: S3Blobs, name: str) -> bytes | None:
    opened = await blobs.open(name)
    if opened is None:
        return None
    return b"".join([chunk async for chunk in opened.chunks])


async def test_a_large_file_goes_up_in_parts(blobs: S3Blobs, bucket: str, tmp_path: Path) -> None:
    source = tmp_path / "upload"
    data = os.urandom(MIB) * 17  # past the multipart threshold (8 MiB): three parts of at most 8 MiB
    source.write_bytes(data)
    assert await blobs.put_file("files/o/big", source) == len(data)
    assert not source.exists()
    etag = shared().client().head_object(Bucket=bucket, Key=f"{PREFIX}batches/files/o/big")["ETag"]
    assert etag.strip('"').endswith("-3")  # a multipart upload's ETag counts its parts
    read = await _read(blobs, "files/o/big")
    assert read is not None
    assert hashlib.sha256(read).digest() == hashlib.sha256(data).digest()


async def test_creates_raced_from_two_replicas_one_wins(blobs: S3Blobs, bucket: str) -> None:
    other = S3Blobs.from_settings(_settings(shared().url, bucket), "batches")
    try:
        stores = [blobs, other] * 4
        results = await asyncio.gather(*(store.create("lease.1", str(i).encode()) for i, store in enumerate(stores)))
        assert results.count(True) == 1
        assert await other.get("lease.1") == str(results.index(True)).encode()
    finally:
        await other.aclose()


async def test_appended_parts_are_hidden_and_kept_apart(blobs: S3Blobs, bucket: str) -> None:
    for i in range(3):
        await blobs.append("b/output", f"line {i}\n".encode())
        await blobs.append("b/output/more", f"other {i}\n".encode())  # a name below the other's
    parts = [key for key in _keys(bucket) if "/~/" in key]
    assert len(parts) == 6  # one part object per append, out of every name's way
    assert sorted(await blobs.list("b/")) == ["b/output", "b/output/more"]
    assert await blobs.list("b/output/") == ["b/output/more"]
    assert sorted(await blobs.list("")) == ["b/output", "b/output/more"]
    assert await blobs.get("b/output") == b"line 0\nline 1\nline 2\n"
    assert await blobs.get("b/output/more") == b"other 0\nother 1\nother 2\n"


async def test_appends_from_another_replica_are_never_lost(blobs: S3Blobs, bucket: str) -> None:
    """A replica that appended, lost the batch's lease and took it again appends after what the other wrote."""
    other = S3Blobs.from_settings(_settings(shared().url, bucket), "batches")
    try:
        await blobs.append("b/output", b"a1\n")
        await blobs.append("b/output", b"a2\n")
        await other.append("b/output", b"b1\n")  # a new replica (nothing known): after the parts there
        await other.put("b/output", b"a1\na2\n")  # its resume cut a torn tail off
        await other.append("b/output", b"b2\n")
        await blobs.append("b/output", b"a3\n")  # what the first one knew is out of date
        assert await blobs.get("b/output") == b"a1\na2\nb2\na3\n"
        assert await other.get("b/output") == b"a1\na2\nb2\na3\n"
    finally:
        await other.aclose()


async def test_stale_parts_are_cleaned_up(blobs: S3Blobs, bucket: str) -> None:
    await blobs.append("b/errors", b"1\n")
    await blobs.append("b/errors", b"2\n")
    await blobs.put("b/errors", b"1\n")
    await blobs.append("b/errors", b"3\n")  # a new generation: the old one's parts go
    assert len([key for key in _keys(bucket) if "/~/" in key]) == 1
    assert await blobs.get("b/errors") == b"1\n3\n"
    await blobs.delete("b/errors")
    assert _keys(bucket) == []


async def test_copy_of_an_appended_object_is_one_object(blobs: S3Blobs, bucket: str) -> None:
    await blobs.append("b/output", b"1\n")
    await blobs.append("b/output", b"2\n")
    assert await blobs.copy("b/output", "files/o/out") is True
    await blobs.delete("b/output")
    assert await blobs.get("files/o/out") == b"1\n2\n"
    assert _keys(bucket) == [f"{PREFIX}batches/files/o/out"]


def _answer_lost_once(blobs: S3Blobs) -> None:
    """The next conditional PutObject that succeeds is sent again, as botocore does when its answer is lost."""
    sent: list[bool] = []

    def again(request_dict: dict[str, Any], response: Any, **_: Any) -> int | None:
        ok = response is not None and response[0].status_code == 200
        if not sent and ok and request_dict["headers"].get("If-None-Match") == "*":
            sent.append(True)
            return 0  # try again at once
        return None

    blobs.client.meta.events.register("needs-retry.s3.PutObject", again)


async def test_a_create_whose_answer_was_lost_is_still_ours(blobs: S3Blobs) -> None:
    _answer_lost_once(blobs)
    assert await blobs.create("lease.1", b"me") is True  # the second try's 412 is our own first write
    assert await blobs.create("lease.1", b"me") is False


async def test_an_append_whose_answer_was_lost_is_kept_once(blobs: S3Blobs) -> None:
    await blobs.append("b/output", b"1\n")
    _answer_lost_once(blobs)
    await blobs.append("b/output", b"2\n")
    await blobs.append("b/output", b"3\n")
    assert await blobs.get("b/output") == b"1\n2\n3\n"  # not the line written twice


def _after_get(blobs: S3Blobs, action: Any, parts: bool = False) -> None:
    """`action` once, as soon as the store's first GET (of a part, with `parts`) has its answer's head."""
    done: list[bool] = []

    def note(params: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
        context["test_key"] = params["Key"]

    def hook(context: dict[str, Any], **_: Any) -> None:
        if not done and ("/~/" in context["test_key"]) == parts:
            done.append(True)
            action()

    blobs.client.meta.events.register("provide-client-params.s3.GetObject", note)
    blobs.client.meta.events.register("after-call.s3.GetObject", hook)


async def test_a_delete_mid_download_does_not_cut_it_short(blobs: S3Blobs, bucket: str) -> None:
    data = os.urandom(3 * MIB)
    await blobs.put("f", data)
    raw = shared().client()
    _after_get(blobs, lambda: raw.delete_object(Bucket=bucket, Key=f"{PREFIX}batches/f"))
    assert await _read(blobs, "f") == data
    assert await blobs.get("f") is None


async def test_a_replace_while_parts_are_read_reads_again(blobs: S3Blobs, bucket: str) -> None:
    for i in range(5):
        await blobs.append("b/output", f"{i}\n".encode())
    raw = shared().client()
    _after_get(blobs, lambda: raw.put_object(Bucket=bucket, Key=f"{PREFIX}batches/b/output", Body=b"new\n"), parts=True)
    assert await _read(blobs, "b/output") == b"new\n"  # never the old base with a part missing


async def test_a_delete_while_parts_are_read_is_no_torn_read(blobs: S3Blobs, bucket: str) -> None:
    for i in range(5):
        await blobs.append("b/output", f"{i}\n".encode())
    raw = shared().client()

    def delete() -> None:  # as the store deletes: the base, then the parts
        raw.delete_object(Bucket=bucket, Key=f"{PREFIX}batches/b/output")
        for key in _keys(bucket):
            raw.delete_object(Bucket=bucket, Key=key)

    _after_get(blobs, delete, parts=True)
    assert await blobs.get("b/output") is None  # read again once gone, not the base with parts missing


@pytest.fixture
def stopped() -> S3Blobs:
    server = S3Server().start()
    bucket = server.bucket()
    store = S3Blobs.from_settings(_settings(server.url, bucket, s3_timeout_s=3), "batches")
    asyncio.run(store.put("before", b"x"))
    server.stop()
    return store


@pytest.mark.timeout(120)  # a hang fails here rather than at the suite's bound
async def test_a_service_down_is_unavailable_promptly(stopped: S3Blobs, tmp_path: Path) -> None:
    source = tmp_path / "upload"
    source.write_bytes(b"x")
    calls: list[Callable[[], Awaitable[object]]] = [
        lambda: stopped.get("before"), lambda: stopped.put("a", b"x"), lambda: stopped.create("b", b"x"),
        lambda: stopped.append("c", b"x"), lambda: stopped.open("before"), lambda: stopped.list("a/"),
        lambda: stopped.copy("before", "d"), lambda: stopped.delete("before"), lambda: stopped.put_file("e", source),
    ]
    for call in calls:
        with pytest.raises(BlobsUnavailable, match="The S3 store"):
            await call()
    assert not source.exists()  # the store's even when the upload failed
    with pytest.raises(BlobsUnavailable, match="The S3 store"):
        async with stopped.local("before"):
            pass


@pytest.fixture
def silent() -> Iterator[str]:
    """A loopback address that takes connections and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.timeout(120)
async def test_a_silent_service_times_out(silent: str) -> None:
    store = S3Blobs.from_settings(_settings(silent, "bucket", s3_timeout_s=0.6), "batches")
    with pytest.raises(BlobsUnavailable, match=r"ReadTimeoutError|ConnectTimeoutError"):
        await store.get("x")


async def test_every_key_is_below_the_prefix_and_part(blobs: S3Blobs, bucket: str, tmp_path: Path) -> None:
    files = S3Blobs.from_settings(_settings(shared().url, bucket), "files")
    source = tmp_path / "upload"
    source.write_bytes(b"line\n")
    await files.put_file("o/file-1", source)
    await blobs.put("record.json", b"{}")
    await blobs.create("lease.1", b"me")
    await blobs.append("out", b"1\n")
    await blobs.append("out", b"2\n")
    await blobs.copy("out", "copied")
    keys = _keys(bucket)
    assert f"{PREFIX}files/o/file-1" in keys
    assert all(key.startswith((f"{PREFIX}batches/", f"{PREFIX}files/")) for key in keys)
    assert [key for key in keys if key.startswith(f"{PREFIX}files/")] == [f"{PREFIX}files/o/file-1"]
    assert await files.list("o/") == ["o/file-1"]
    assert await files.get("record.json") is None  # each part sees only its own
    await files.aclose()


def test_settings_need_a_bucket_and_both_keys() -> None:
    with pytest.raises(ValidationError, match=r"store\.backend s3 needs store\.s3_bucket"):
        StoreSettings(backend="s3")
    with pytest.raises(ValidationError, match="go together"):
        StoreSettings(backend="s3", s3_bucket="b", s3_access_key_id="id")
    secret = StoreSettings(backend="s3", s3_bucket="b", s3_access_key_id="id", s3_secret_access_key="hush")
    assert "hush" not in repr(secret)


async def test_open_blobs_picks_s3(bucket: str) -> None:
    settings = Settings(store=_settings(shared().url, bucket))
    store = open_blobs(settings, RedisPools(), "files")
    assert isinstance(store, S3Blobs)
    assert store.root == f"{PREFIX}files/"
    await store.aclose()


def test_without_boto3_the_s3_backend_says_what_to_install(monkeypatch: pytest.MonkeyPatch, bucket: str) -> None:
    monkeypatch.setitem(sys.modules, "gateway.stores.blobs_s3", None)  # as if boto3 were not installed
    with pytest.raises(ValueError, match=r"pip install 'llm-gateway\[s3\]'"):
        open_blobs(Settings(store=_settings(shared().url, bucket)), RedisPools(), "files")
