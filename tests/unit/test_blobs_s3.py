"""What the S3 backend of `stores.blobs` does beyond the contract every backend passes
(tests/unit/test_blobs.py), against moto's S3 server (tests/s3_server.py): multipart uploads, a
service down or silent (a prompt error: the API's 503), every key below the prefix and its part, and
the settings it needs."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from gateway.errors import StoreUnavailable
from gateway.settings import Settings, StoreSettings
from gateway.stores.backends import open_stores
from gateway.stores.blobs import open_blob, put_chunks, unavailable
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
async def blobs(bucket: str, tmp_path: Path) -> AsyncIterator[S3Blobs]:
    store = S3Blobs.from_settings(_settings(shared().url, bucket), "batches", tmp_path / "spool")
    yield store
    await store.aclose()


def _keys(bucket: str) -> list[str]:
    pages = shared().client().get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return [item["Key"] for page in pages for item in page.get("Contents", [])]


async def test_a_large_file_goes_up_in_parts(blobs: S3Blobs, bucket: str, tmp_path: Path) -> None:
    source = tmp_path / "upload"
    data = os.urandom(MIB) * 17  # past the multipart threshold (8 MiB): three parts of at most 8 MiB
    source.write_bytes(data)
    await blobs.put_file("big", source)
    assert not source.exists()
    etag = shared().client().head_object(Bucket=bucket, Key=f"{PREFIX}batches/big")["ETag"]
    assert etag.strip('"').endswith("-3")  # a multipart upload's ETag counts its parts
    opened = await open_blob(blobs, "big")
    assert opened is not None
    read = b"".join([chunk async for chunk in opened.chunks])
    assert hashlib.sha256(read).digest() == hashlib.sha256(data).digest()


@pytest.fixture
def stopped(tmp_path: Path) -> S3Blobs:
    server = S3Server().start()
    bucket = server.bucket()
    store = S3Blobs.from_settings(_settings(server.url, bucket, s3_timeout_s=3), "batches", tmp_path / "spool")
    asyncio.run(put_chunks(store, "before", b"x"))
    server.stop()
    return store


@pytest.mark.timeout(120)  # a hang fails here rather than at the suite's bound
async def test_a_service_down_is_unavailable_promptly(stopped: S3Blobs, tmp_path: Path) -> None:
    source = tmp_path / "upload"
    source.write_bytes(b"x")
    for call in (lambda: open_blob(stopped, "before"), lambda: stopped.delete("before"),
                 lambda: stopped.put_file("e", source)):
        with pytest.raises(StoreUnavailable), unavailable():
            await call()
    assert not source.exists()  # the store's even when the upload failed
    with pytest.raises(StoreUnavailable), unavailable():
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
async def test_a_silent_service_times_out(silent: str, tmp_path: Path) -> None:
    store = S3Blobs.from_settings(_settings(silent, "bucket", s3_timeout_s=0.6), "batches", tmp_path)
    with pytest.raises(StoreUnavailable, match="unavailable"), unavailable():
        await open_blob(store, "x")


async def test_every_key_is_below_the_prefix_and_part(blobs: S3Blobs, bucket: str, tmp_path: Path) -> None:
    files = S3Blobs.from_settings(_settings(shared().url, bucket), "files", tmp_path / "spool")
    await put_chunks(files, "file-1", b"line\n")
    await put_chunks(blobs, "batch_1.input.jsonl", b"{}")
    assert sorted(_keys(bucket)) == [f"{PREFIX}batches/batch_1.input.jsonl", f"{PREFIX}files/file-1"]
    assert await open_blob(files, "batch_1.input.jsonl") is None  # each part sees only its own
    await files.aclose()


def test_settings_need_a_bucket_and_both_keys() -> None:
    with pytest.raises(ValidationError, match=r"store\.backend s3 needs store\.s3_bucket"):
        StoreSettings(backend="s3")
    with pytest.raises(ValidationError, match="go together"):
        StoreSettings(backend="s3", s3_bucket="b", s3_access_key_id="id")
    secret = StoreSettings(backend="s3", s3_bucket="b", s3_access_key_id="id", s3_secret_access_key="hush")
    assert "hush" not in repr(secret)


async def test_the_s3_backend_keeps_contents_in_s3_and_records_in_sqlite(bucket: str, tmp_path: Path) -> None:
    settings = Settings(store=_settings(shared().url, bucket), files={"dir": tmp_path / "files"},
                        batches={"dir": tmp_path / "batches"})
    files, batches = open_stores(settings, RedisPools())
    assert isinstance(files.blobs, S3Blobs)
    assert files.blobs.root == f"{PREFIX}files/"
    assert await files.records.files("t") == []
    assert (tmp_path / "files" / "files.sqlite3").exists()  # one node: SQLite (with redis_url: Redis)
    await files.aclose()
    await batches.aclose()


def test_without_boto3_the_s3_backend_says_what_to_install(monkeypatch: pytest.MonkeyPatch, bucket: str,
                                                           tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "gateway.stores.blobs_s3", None)  # as if boto3 were not installed
    settings = Settings(store=_settings(shared().url, bucket), files={"dir": tmp_path / "f"},
                        batches={"dir": tmp_path / "b"})
    with pytest.raises(ValueError, match=r"pip install 'llm-gateway\[s3\]'"):
        open_stores(settings, RedisPools())
