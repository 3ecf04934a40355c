"""Every backend of `stores.blobs` against the same cases: what `stores.files` and `stores.batches`
rely on (atomic replace, exclusive create, durable append, open fixed at open, independent copy,
listing by prefix, names checked). The S3 backend runs against moto's S3 server (tests/s3_server.py),
one for the session, a bucket per test."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway.stores.blobs import Blobs


async def _read(blobs: Blobs, name: str) -> bytes | None:
    opened = await blobs.open(name, chunk_bytes=3)
    if opened is None:
        return None
    data = b"".join([chunk async for chunk in opened.chunks])
    assert opened.size == len(data)
    return data


async def test_put_get_replace(blobs: Blobs) -> None:
    assert await blobs.get("a/b") is None
    await blobs.put("a/b", b"one")
    assert await blobs.get("a/b") == b"one"
    await blobs.put("a/b", b"two!")
    assert await blobs.get("a/b") == b"two!"
    assert await _read(blobs, "a/b") == b"two!"


async def test_create_is_exclusive(blobs: Blobs) -> None:
    results = await asyncio.gather(*(blobs.create("lease/1", str(i).encode()) for i in range(8)))
    assert results.count(True) == 1
    assert await blobs.get("lease/1") == str(results.index(True)).encode()
    assert await blobs.create("lease/1", b"x") is False


async def test_put_file_moves_the_file_in(blobs: Blobs, tmp_path: Path) -> None:
    source = tmp_path / "upload"
    source.write_bytes(b"line 1\nline 2\n")
    assert await blobs.put_file("files/o/f", source) == 14
    assert await _read(blobs, "files/o/f") == b"line 1\nline 2\n"
    async with blobs.local("files/o/f") as local:
        assert local is not None
        assert local.read_bytes() == b"line 1\nline 2\n"
    async with blobs.local("files/o/none") as local:
        assert local is None


async def test_append_makes_and_extends(blobs: Blobs) -> None:
    await blobs.append("b/output", b'{"a":1}\n')
    await blobs.append("b/output", b'{"b":2}\n')
    assert await blobs.get("b/output") == b'{"a":1}\n{"b":2}\n'
    assert await _read(blobs, "b/output") == b'{"a":1}\n{"b":2}\n'
    async with blobs.local("b/output") as local:
        assert local is not None
        assert local.read_bytes() == b'{"a":1}\n{"b":2}\n'
    await blobs.put("b/output", b'{"a":1}\n')  # a torn tail cut off by writing the good part again
    await blobs.append("b/output", b'{"c":3}\n')
    assert await blobs.get("b/output") == b'{"a":1}\n{"c":3}\n'


async def test_open_is_fixed_at_open(blobs: Blobs) -> None:
    await blobs.put("f", b"0123456789" * 100)
    opened = await blobs.open("f", chunk_bytes=10)
    assert opened is not None
    await blobs.delete("f")
    await blobs.put("f", b"other")
    data = b"".join([chunk async for chunk in opened.chunks])
    assert data == b"0123456789" * 100
    assert await blobs.open("missing") is None


async def test_copy_is_independent(blobs: Blobs) -> None:
    assert await blobs.copy("none", "x") is False
    await blobs.put("src", b"input")
    assert await blobs.copy("src", "batch/input") is True
    await blobs.delete("src")
    assert await blobs.get("batch/input") == b"input"
    assert await blobs.get("src") is None


async def test_delete_and_list(blobs: Blobs) -> None:
    for name in ("files/o1/file-a", "files/o1/file-a.json", "files/o2/file-b", "pending/batch_1"):
        await blobs.put(name, b"x")
    assert sorted(await blobs.list("files/o1/")) == ["files/o1/file-a", "files/o1/file-a.json"]
    assert sorted(await blobs.list("files/")) == ["files/o1/file-a", "files/o1/file-a.json", "files/o2/file-b"]
    assert await blobs.list("pending/") == ["pending/batch_1"]
    assert await blobs.list("nothing/") == []
    await blobs.delete("files/o1/file-a", "files/o1/file-a.json", "never/was")
    assert await blobs.list("files/o1/") == []
    assert await blobs.get("files/o1/file-a") is None


@pytest.mark.parametrize("name", ["../x", "a/../b", "/abs", "a//b", "a/./b", "a b", "a/.tmp-x", ""])
async def test_names_are_checked(blobs: Blobs, name: str) -> None:
    with pytest.raises(ValueError, match="not an object name"):
        await blobs.put(name, b"x")
    with pytest.raises(ValueError, match="not an object name"):
        await blobs.get(name)
