"""Every backend of `stores.blobs` (a local directory, moto's S3) against the same cases: a content
written once, whole, from a local file the store takes; read back fixed at open (a delete meanwhile
does not cut it short), or as a local file; deleted; a missing one is None, never an error; names
that could reach outside the store refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.stores.blobs import Blobs, open_blob, put_chunks


async def _read(blobs: Blobs, name: str) -> bytes | None:
    opened = await open_blob(blobs, name)
    return None if opened is None else b"".join([chunk async for chunk in opened.chunks])


async def test_put_file_moves_the_file_in(blobs: Blobs, tmp_path: Path) -> None:
    source = tmp_path / "upload"
    source.write_bytes(b"line\n" * 1000)
    await blobs.put_file("file-1", source)
    assert not source.exists()  # the store's now
    assert await _read(blobs, "file-1") == b"line\n" * 1000
    async with blobs.local("file-1") as path:
        assert path is not None
        assert path.read_bytes() == b"line\n" * 1000


async def test_a_missing_content_is_none(blobs: Blobs) -> None:
    assert await open_blob(blobs, "nothing") is None
    async with blobs.local("nothing") as path:
        assert path is None
    await blobs.delete("nothing")  # nothing to do: no error


async def test_open_is_fixed_at_open_and_delete_removes(blobs: Blobs) -> None:
    await put_chunks(blobs, "a", b"x" * 600_000)
    opened = await open_blob(blobs, "a")
    assert opened is not None
    await blobs.delete("a")
    assert opened.size == 600_000
    assert b"".join([chunk async for chunk in opened.chunks]) == b"x" * 600_000
    assert await open_blob(blobs, "a") is None
    assert list(blobs.spool.iterdir()) == []  # put_chunks staged it, and left nothing behind


@pytest.mark.parametrize("name", ["", "..", "../x", "a/b", "/etc/passwd", ".tmp-x", "a\x00b"])
async def test_names_are_checked(blobs: Blobs, name: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a blob name"):
        await open_blob(blobs, name)
